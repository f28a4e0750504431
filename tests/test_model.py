"""The model interface: one declaration per param, resolution by name, the name check and the gradient check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from functitan.model import Param, check_names, count, gradcheck, init, load_model, normal, ones, specs
from functitan.tree import flatten_with_names

ROOT = Path(__file__).resolve().parents[1]
TINY = f"{ROOT / 'tests' / 'assets' / 'tiny_gpt.py'}"


_IMPORT_ALL = """
import importlib, pkgutil, sys
import functitan
names = [m.name for m in pkgutil.walk_packages(functitan.__path__, "functitan.")]
for name in names:
    importlib.import_module(name)
print(len(names), " ".join(sorted(m for m in sys.modules if m == "models" or m.startswith("models."))))
"""


def test_functitan_imports_no_model():
    # every module of the library, imported in a fresh interpreter: none of them may bring in models/
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    count, *models = out.stdout.split()
    assert int(count) > 50 and models == []


def test_one_declaration_gives_init_specs_and_counts():
    decl = {"w": Param((3, 4), ("mlp", "embed"), normal(0.5)), "n": {"weight": Param((4,), ("embed",), ones())}}
    assert specs(decl) == {"w": ("mlp", "embed"), "n": {"weight": ("embed",)}}
    assert count(decl) == 16 and count(decl, exclude=lambda name, p: name == "w") == 4
    a, b = init(decl, 7), init(decl, 7)
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["n"]["weight"], torch.ones(4))
    assert 0.2 < a["w"].std().item() < 1.0  # drawn with std 0.5
    assert init(decl, 7, device="meta")["w"].is_meta
    with pytest.raises(ValueError, match=r"Param shape \(3, 4\) has 2 dims but names \('mlp',\) has 1"):
        Param((3, 4), ("mlp",))


# the published sizes (Llama 3 paper / HF configs): all params, and without the embedding and output tables
LLAMA_COUNTS = {
    "debug": (3_280_128, 3_148_032),
    "llama3_1b": (1_235_814_400, 973_146_112),
    "llama3_8b": (8_030_261_248, 6_979_588_096),
    "llama3_70b": (70_553_706_496, 68_452_360_192),
    "llama3_405b": (405_853_388_800, 401_650_696_192),
}
# name: (shape, sum, sum of squares) of every leaf of init(llama debug, key 0), fp32 drawn, summed in fp64
LLAMA_DEBUG_INIT = {
    "embed.weight": ((258, 256), 5.2852553e00, 2.6438156e01),
    "layers.0.attn.wk": ((128, 256), 2.1721228e00, 1.3072712e01),
    "layers.0.attn.wo": ((256, 256), 7.7153862e00, 2.6413232e01),
    "layers.0.attn.wq": ((256, 256), 9.6690011e-01, 2.6225630e01),
    "layers.0.attn.wv": ((128, 256), -1.2378495e00, 1.2964092e01),
    "layers.0.attn_norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "layers.0.mlp.w_down": ((256, 768), 8.6000286e00, 7.8575201e01),
    "layers.0.mlp.w_gate": ((768, 256), 5.4715812e00, 7.8734421e01),
    "layers.0.mlp.w_up": ((768, 256), -3.5937174e00, 7.8661065e01),
    "layers.0.mlp_norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "layers.1.attn.wk": ((128, 256), 4.5686791e-01, 1.3070800e01),
    "layers.1.attn.wo": ((256, 256), 9.9778421e00, 2.6145579e01),
    "layers.1.attn.wq": ((256, 256), -7.7505359e-01, 2.6161338e01),
    "layers.1.attn.wv": ((128, 256), 1.7204595e00, 1.3061497e01),
    "layers.1.attn_norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "layers.1.mlp.w_down": ((256, 768), -1.6441008e00, 7.8671744e01),
    "layers.1.mlp.w_gate": ((768, 256), -6.6925642e00, 7.8435325e01),
    "layers.1.mlp.w_up": ((768, 256), -1.0700055e00, 7.8466048e01),
    "layers.1.mlp_norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "layers.2.attn.wk": ((128, 256), 2.9422432e00, 1.3183681e01),
    "layers.2.attn.wo": ((256, 256), 3.1767069e00, 2.6161543e01),
    "layers.2.attn.wq": ((256, 256), 2.3517790e00, 2.6232789e01),
    "layers.2.attn.wv": ((128, 256), 2.5427628e00, 1.3082221e01),
    "layers.2.attn_norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "layers.2.mlp.w_down": ((256, 768), -1.0343213e01, 7.8791488e01),
    "layers.2.mlp.w_gate": ((768, 256), -9.8840106e00, 7.8586991e01),
    "layers.2.mlp.w_up": ((768, 256), 1.3746284e01, 7.8479012e01),
    "layers.2.mlp_norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "layers.3.attn.wk": ((128, 256), -4.0186917e-01, 1.3081397e01),
    "layers.3.attn.wo": ((256, 256), -5.3697042e00, 2.6162844e01),
    "layers.3.attn.wq": ((256, 256), 4.0683641e00, 2.6191574e01),
    "layers.3.attn.wv": ((128, 256), 4.4274900e00, 1.3110118e01),
    "layers.3.attn_norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "layers.3.mlp.w_down": ((256, 768), -1.2828579e01, 7.8273280e01),
    "layers.3.mlp.w_gate": ((768, 256), 1.0044909e01, 7.8363548e01),
    "layers.3.mlp.w_up": ((768, 256), -1.4198293e01, 7.8818449e01),
    "layers.3.mlp_norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "norm.weight": ((256,), 2.5600000e02, 2.5600000e02),
    "output.weight": ((258, 256), 5.7662689e00, 2.6516935e01),
}


def test_llama_declaration_keeps_its_values_and_counts():
    llama = load_model("llama")
    for flavor, (total, body) in LLAMA_COUNTS.items():
        decl = llama.params(llama.config(flavor))
        assert count(decl) == total, flavor
        assert count(decl, exclude=lambda name, p: name.startswith(("embed", "output"))) == body, flavor
    # drawn from fold_in(key, dotted name) in fp32: every leaf's values as before the declaration existed
    params = dict(flatten_with_names(init(llama.params(llama.config("debug")), 0))[0])
    assert params.keys() == LLAMA_DEBUG_INIT.keys()
    for name, (shape, total, squares) in LLAMA_DEBUG_INIT.items():
        p = params[name].double()
        assert tuple(p.shape) == shape and p.dtype == torch.float64, name
        assert p.sum().item() == pytest.approx(total, rel=1e-5, abs=1e-5), name
        assert p.pow(2).sum().item() == pytest.approx(squares, rel=1e-5), name


def test_load_model_by_plugin_module_and_file():
    assert load_model("llama").name == "llama"
    assert load_model("models.llama").name == "llama"
    assert load_model(TINY).name == "tiny_gpt" and load_model(f"{TINY}:BAD").name == "tiny_gpt_bad"
    with pytest.raises(ValueError, match=r"model.name='lama' is not an installed model; choose one of \[.*'llama'"):
        load_model("lama")
    with pytest.raises(ValueError, match=r"file 'nope/model.py' does not exist"):
        load_model("nope/model.py")
    with pytest.raises(ValueError, match=rf"model.name='{TINY}:NOPE': {TINY} has no attribute 'NOPE'; define"):
        load_model(f"{TINY}:NOPE")  # the file, not the module name it was imported under
    m = load_model("llama")
    assert m.config("debug", n_layers="3").n_layers == 3  # strings from the command line are converted
    with pytest.raises(
        ValueError,
        match=r"model.n_layer is not a field of llama's config \(LlamaConfig\) \(did you mean 'n_layers'\?\)",
    ):
        m.config("debug", n_layer=3)
    with pytest.raises(ValueError, match=r"model.flavor='8b' is not a llama flavor"):
        m.config("8b")


def test_check_names_names_the_param_both_lists_and_the_call_site():
    good = load_model(TINY)
    used = check_names(good, good.config("debug"))
    assert "layers.0.fc" in used and "wpe" in used
    bad = load_model(f"{TINY}:BAD")
    with pytest.raises(
        ValueError,
        match=r"param 'layers\.0\.fc' is declared with names \['mlp', 'embed'\] but the "
        r"contraction at .*tiny_gpt\.py:\d+ in block calls its dims \['hidden', 'embed'\]",
    ):
        check_names(bad, bad.config("debug"))


def _train_bad(argv):
    from functitan.config import parse_config
    from functitan.job_config import JobConfig
    from functitan.train import run

    try:
        run(parse_config(JobConfig, argv))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "layout", [["--parallelism.tp=2", "--parallelism.dp_shard=1"], ["--parallelism.dp_shard=2"]], ids=["tp2", "fsdp2"]
)
def test_trainer_refuses_a_misnamed_contraction_before_any_collective(tmp_path, layout, gloo):
    argv = [
        f"--model.name={TINY}:BAD",
        "--training.steps=1",
        "--training.seq_len=16",
        "--training.batch_size=4",
        "--data.max_corpus_bytes=50000",
        f"--metrics.run_dir={tmp_path}",
        *layout,
    ]
    errors = gloo.run(_train_bad, 2, argv)
    assert all(e is not None and "param 'layers.0.fc' is declared with names ['mlp', 'embed']" in e for e in errors)


def test_gradcheck_passes_for_llama_and_a_gpt_with_biases_and_positions():
    for name, kw in (
        ("llama", {"overrides": {"dim": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "n_layers": 2}}),
        (TINY, {}),
    ):
        report = gradcheck(name, layouts=("fsdp", "tp", "tp_sp", "hsdp", "fsdp_tp_sp"), **kw)
        assert report == {"fsdp": {}, "tp": {}, "tp_sp": {}, "hsdp": {}, "fsdp_tp_sp": {}}, (name, report)


def test_gradcheck_names_exactly_the_params_a_layout_gets_wrong():
    # q * q_scale on head-sharded q: without SP each tp rank holds part of q_scale's gradient and nothing sums
    # it (a raw multiply bypasses the Layout); with SP, Layout.param sums every tp-replicated gradient
    report = gradcheck(TINY, flavor="raw", layouts=("tp", "tp_sp"))
    assert sorted(report["tp"]) == ["layers.0.q_scale", "layers.1.q_scale"] and report["tp_sp"] == {}


def test_cli_trains_a_model_from_a_file(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functitan.cli",
            "train",
            f"--model.name={TINY}",
            "--training.steps=2",
            "--training.seq_len=16",
            "--training.batch_size=2",
            "--data.max_corpus_bytes=50000",
            f"--metrics.run_dir={tmp_path}",
            "--metrics.run_name=t",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 steps, first loss" in out.stdout
    record = (tmp_path / "t" / "model_config.json").read_text()
    assert '"name": "' + TINY in record and '"dim": 32' in record


def test_cli_gradcheck_lists_the_wrong_params():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functitan.cli",
            "gradcheck",
            f"--model.name={TINY}",
            "--model.flavor=raw",
            "--layouts=tp",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 1 and "tp           2 differ" in out.stdout and "layers.1.q_scale" in out.stdout


def _run(overrides):
    from functitan.config import ConfigError, apply_overrides
    from functitan.job_config import JobConfig
    from functitan.train import run

    try:
        out = run(apply_overrides(JobConfig(), overrides))
    except ConfigError as e:
        return str(e)
    return out["run_dir"]


def test_load_path_model_and_flags_never_disagree_silently(tmp_path, gloo):
    import json

    small = {
        "training.steps": 2,
        "training.seq_len": 16,
        "training.batch_size": 2,
        "data.max_corpus_bytes": 50_000,
        "metrics.run_dir": str(tmp_path),
        "checkpoint.interval": 2,
    }
    first = gloo.run(
        _run,
        1,
        {
            **small,
            "metrics.run_name": "a",
            "checkpoint.enable": True,
            "model.dim": 32,
            "model.n_heads": 4,
            "model.n_kv_heads": 2,
            "model.ffn_dim": 64,
            "model.n_layers": 2,
        },
    )[0]
    ckpt = f"{first}/checkpoints/2"
    clash = gloo.run(_run, 1, {**small, "metrics.run_name": "b", "checkpoint.load_path": ckpt, "model.n_layers": 3})[0]
    assert "[model] flags conflict with the checkpoint's model" in clash and "n_layers=3 vs 2" in clash
    flavor = gloo.run(
        _run, 1, {**small, "metrics.run_name": "c", "checkpoint.load_path": ckpt, "model.flavor": "debug"}
    )[0]
    assert "dim=256 vs 32" in flavor
    same = gloo.run(_run, 1, {**small, "metrics.run_name": "d", "checkpoint.load_path": ckpt, "model.n_layers": 2})[0]
    ran = json.loads((tmp_path / "d" / "config.json").read_text())["model"]
    assert (
        same.endswith("/d")
        and ran["name"] == "llama"
        and ran["overrides"]["n_layers"] == 2
        and ran["overrides"]["dim"] == 32
    )
