"""A model that is not Llama gets FSDP, TP and sequence parallelism by annotating its params and contractions."""

import pytest
import torch
import torch.nn.functional as F

from functitan.mesh import make_mesh
from functitan.random import fold_in, generator, key
from functitan.sharding import Layout, default_rules, place
from functitan.transforms import value_and_grad
from functitan.tree import flatten_with_names, map_with_names

VOCAB, DIM, HIDDEN, LAYERS = 40, 16, 32, 2


def specs():
    # the only sharding the model declares: logical names per parameter dim
    layer = {"norm": ("embed",), "w_in": ("mlp", "embed"), "w_out": ("embed", "mlp")}
    return {"embed": ("vocab", "embed"), "layers": [dict(layer) for _ in range(LAYERS)]}


def init(k):
    shapes = {
        "embed": (VOCAB, DIM),
        "layers": [{"norm": (DIM,), "w_in": (HIDDEN, DIM), "w_out": (DIM, HIDDEN)} for _ in range(LAYERS)],
    }
    return map_with_names(
        lambda n, s: torch.randn(s, generator=generator(fold_in(k, n))) * 0.3,
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )


def block(p, x, layout):
    h = F.layer_norm(x, (DIM,))
    h = layout.einsum("batch seq embed, embed -> batch seq embed", h, p["norm"])
    h = F.gelu(layout.einsum("batch seq embed, mlp embed -> batch seq mlp", h, p["w_in"]))
    return x + layout.einsum("batch seq mlp, embed mlp -> batch seq embed", h, p["w_out"])


def loss(params, batch, layout=Layout()):
    table = layout.param(params["embed"])
    x = layout.embed(batch["inputs"], table, VOCAB)
    for p in params["layers"]:
        x = layout.block(block, p, x, layout)
    logits = layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, table)  # tied head
    return layout.cross_entropy(logits, batch["targets"], VOCAB)


def _batch():
    t = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _grads(degrees, sp):
    mesh = make_mesh(**degrees)
    layout = Layout(mesh, default_rules(sequence_parallel=sp))
    params = place(init(key(0)), specs(), layout.rules, mesh)
    b = {k: v.chunk(layout.dp_size)[layout.dp_rank] for k, v in _batch().items()}
    value, grads = value_and_grad(loss)(params, b, layout)
    value = value.clone()
    torch.distributed.all_reduce(value)
    return value.item() / torch.distributed.get_world_size(), {
        n: g.full_tensor() for n, g in flatten_with_names(grads)[0]
    }


@pytest.mark.parametrize(
    "degrees,sp", [(dict(dp_shard=2), False), (dict(dp_shard=1, tp=2), True), (dict(dp_shard=2, tp=2), False)]
)
def test_custom_model_gets_every_layout(degrees, sp, gloo):
    ref_loss, ref_grads = value_and_grad(loss)(init(key(0)), _batch())
    world = degrees.get("dp_shard", 1) * degrees.get("tp", 1)
    value, grads = gloo.run(_grads, world, degrees, sp)[0]
    assert value == pytest.approx(ref_loss.item(), abs=1e-6)
    for name, g in flatten_with_names(ref_grads)[0]:
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------------------------- through the CLI
# Models in files outside the package, passed as --model.name=path/to/file.py: tests/assets/tiny_gpt.py (biases,
# learned positions, fused qkv, tied head) and tests/assets/bad_model.py (a misnamed contraction).

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ASSETS = Path(__file__).parent / "assets"
CLI_FLAGS = {
    "training.steps": 3,
    "training.batch_size": 4,
    "training.seq_len": 32,
    "data.max_corpus_bytes": 200_000,
    "metrics.log_every": 1,
    "optimizer.eps": 1e-6,
}


def _cli(tmp_path, model: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "functitan.cli",
        "train",
        "--nproc",
        "2",
        f"--model.name={model}",
        *[f"--{k}={v}" for k, v in CLI_FLAGS.items()],
        f"--metrics.run_dir={tmp_path}",
        "--metrics.run_name=cli",
        *flags,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _train_in_process(overrides: dict) -> list[float]:
    from functitan.config import apply_overrides
    from functitan.job_config import JobConfig
    from functitan.train import run

    out = run(apply_overrides(JobConfig(), {**CLI_FLAGS, **overrides}))
    with open(f"{out['run_dir']}/metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def test_model_file_outside_the_package_trains_under_fsdp2_through_the_cli(tmp_path, gloo):
    model = str(ASSETS / "tiny_gpt.py")
    out = _cli(tmp_path / "fsdp", model, "--parallelism.dp_shard=2")
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "fsdp" / "cli" / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f]
    ref = gloo.run(
        _train_in_process, 1, {"model.name": model, "metrics.run_dir": str(tmp_path / "ref"), "metrics.run_name": "ref"}
    )[0]
    assert len(losses) == 3 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), atol=2e-5, rtol=1e-4)
    record = json.loads((tmp_path / "fsdp" / "cli" / "model_config.json").read_text())
    assert record["name"] == model and record["config"]["dim"] == 32


BAD_NAMES = (
    r"functitan: error: param 'w_in' is declared with names \['mlp', 'embed'\] but the contraction at .*bad_model\.py:\d+ in apply "
    r"calls its dims \['hidden', 'embed'\]"
)


def test_a_misnamed_contraction_is_refused_through_the_cli_on_2_tp_ranks(tmp_path):
    # (tests/test_model.py checks TP and FSDP through train.run; this is the command as a user types it)
    out = _cli(tmp_path, str(ASSETS / "bad_model.py"), "--parallelism.dp_shard=1", "--parallelism.tp=2")
    assert out.returncode != 0
    assert re.search(BAD_NAMES, out.stderr), out.stderr[-3000:]
    assert not (tmp_path / "cli" / "metrics.jsonl").exists()  # refused before the first step


def test_gradcheck_reports_the_misnamed_mlp_by_name_on_every_layout():
    """Its wrong embedding gradient under TP (~8e-6 at init std 0.02) was the report; the name check runs first."""
    from functitan.model import check_names, gradcheck, load_model

    bad = load_model(str(ASSETS / "bad_model.py"))
    with pytest.raises(ValueError, match=BAD_NAMES.removeprefix("functitan: error: ")):
        check_names(bad, bad.config("debug"))
    report = gradcheck(str(ASSETS / "bad_model.py"), layouts=("fsdp", "tp"))
    for layout in ("fsdp", "tp"):
        assert re.match(BAD_NAMES.replace("functitan: error: ", "ValueError: "), report[layout]["error"]), report


# ----------------------------------------------------------------------------------------------- a user's MoE
# tests/assets/tiny_moe.py: written from docs/moe.md and docs/models.md, with its own router z-loss; RAW takes the
# z-loss as a plain per-rank .mean(), the mistake the loss contract warns about. gradcheck's comparison, with the
# ranks of each world in the session's pool.

TINY_MOE = str(ASSETS / "tiny_moe.py")
MOE_LAYOUTS = {2: ("fsdp", "ep", "cp", "tp_sp"), 4: ("fsdp_ep", "ep_tp_sp")}


def _moe_ranks(model: str, layouts: tuple[str, ...]):
    from functitan.model import _gradcheck

    return _gradcheck._worker(model, "debug", {}, layouts, 4, 16, 0, 1)


@pytest.mark.parametrize("world", sorted(MOE_LAYOUTS))
def test_gradcheck_passes_a_users_moe_and_names_the_router_a_per_rank_z_loss_gets_wrong(world, gloo):
    from functitan.model import _gradcheck

    reports = {}
    for model in (TINY_MOE, f"{TINY_MOE}:RAW"):
        wait = gloo.submit(_moe_ranks, world, model, MOE_LAYOUTS[world])
        ref = _gradcheck._train(model, "debug", {}, None, 4, 16, 0, 1)
        got = wait()[0]
        reports[model] = {
            n: _gradcheck._differences(*got[n], *ref, 1, 1e-6, 1e-4) if got[n][0] is not None else got[n][1]
            for n in MOE_LAYOUTS[world]
        }
    assert reports[TINY_MOE] == {n: {} for n in MOE_LAYOUTS[world]}
    for n, bad in reports[f"{TINY_MOE}:RAW"].items():
        if "tp_sp" not in n:  # rows or cp chunks split over ranks whose gradients are averaged: the mean of equal
            assert bad == {}, n  # per-rank means is right
        else:  # tp ranks share a sequence and sum their gradients: the router's, through the z-loss, counts tp times
            assert {"layers.0.moe.router.weight", "layers.1.moe.router.weight"} <= set(bad), (n, bad)
