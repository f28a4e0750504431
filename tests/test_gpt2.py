"""GPT-2: parameter counts of the published sizes, HF logits and files both ways, names, layouts, gradients."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # build from configs; nothing may download
transformers = pytest.importorskip("transformers", minversion="5.0")
safetensors_torch = pytest.importorskip("safetensors.torch")

from functitan import checkpoint as ckpt  # noqa: E402
from functitan.model import check_names, count, gradcheck, init  # noqa: E402
from functitan.sharding import default_rules, logical_to_mesh_axes  # noqa: E402
from functitan.tree import flatten_with_names  # noqa: E402
from models import gpt2  # noqa: E402

M = gpt2.MODEL
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
LOGITS_ATOL = 1e-5  # fp32; measured max |ours - HF| = 1.2e-6 (GELU tanh vs HF's gelu_new, summation order)


def _hf_config(**kw):
    return transformers.GPT2Config(**{k: v for k, v in kw.items() if k != "model_type"})


@pytest.mark.parametrize("flavor", ["124m", "355m", "774m", "1.5b"])
def test_published_sizes_count_exactly_as_transformers(flavor):
    cfg = M.config(flavor)
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(_hf_config(**gpt2.config_to_hf(cfg)))
    theirs = sum(p.numel() for p in hf.parameters())  # the tied head counted once, as HF does
    assert count(M.params(cfg)) == theirs
    if flavor == "124m":
        assert theirs == 124_439_808
    assert {x.device.type for _, x in flatten_with_names(init(M.params(cfg), 0, device="meta"))[0]} == {"meta"}


def _hf_model(tied: bool, seed: int = 0):
    """A tiny random GPT2LMHeadModel; every weight (norms and biases too) random, so a swapped key shows."""
    config = transformers.GPT2Config(
        vocab_size=96,
        n_positions=32,
        n_embd=48,
        n_layer=2,
        n_head=4,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if ".ln_" in name and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_load_hf_logits_match_transformers_and_export_round_trips(tmp_path, tied):
    model = _hf_model(tied)
    model.save_pretrained(tmp_path / "src")
    cfg, params = ckpt.load_hf(tmp_path / "src", M)
    assert cfg == gpt2.GPT2Config(
        vocab_size=96, dim=48, n_layers=2, n_heads=4, ffn_dim=192, max_seq_len=32, tie_embeddings=tied
    )
    with torch.no_grad():
        theirs = model(TOKENS).logits
    ours = M.apply(params, TOKENS, cfg)
    assert ours.shape == theirs.shape == (2, 20, 96)
    assert (ours - theirs).abs().max().item() < LOGITS_ATOL
    # export, then transformers reads back the same tensors and the same logits
    ckpt.save_hf(params, M, cfg, tmp_path / "out")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    original, reloaded = model.state_dict(), back.state_dict()
    assert sorted(original) == sorted(reloaded)
    for key, value in original.items():
        assert torch.equal(value, reloaded[key]), key
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, theirs)
    assert ckpt.load_hf(tmp_path / "out", M)[0] == cfg


def test_base_model_files_without_prefix_and_mask_buffers_load(tmp_path):
    """The hub's gpt2 checkpoint holds GPT2Model's keys ("h.0.attn.c_attn.weight") and old mask buffers."""
    model = _hf_model(True)
    sd = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    cfg = gpt2.config_from_hf(model.config.to_dict())
    params = ckpt.from_hf_state_dict(sd, M, cfg)
    with torch.no_grad():
        assert (M.apply(params, TOKENS, cfg) - model(TOKENS).logits).abs().max().item() < LOGITS_ATOL


def test_fused_qkv_layout_and_conv1d_transposes():
    cfg = gpt2.GPT2Config(vocab_size=96, dim=48, n_layers=1, n_heads=4, ffn_dim=192, max_seq_len=32)
    params = init(M.params(cfg), 0)
    sd = ckpt.to_hf_state_dict(params, M, cfg)
    w = params["layers"][0]["attn"]["c_attn"]["weight"]  # (3, heads, embed): q, k, v
    hf = sd["transformer.h.0.attn.c_attn.weight"]  # (embed, 3 * embed), Conv1D
    assert w.shape == (3, 48, 48) and hf.shape == (48, 144)
    assert torch.equal(hf[:, 48:96], w[1].t())  # k is HF's second block of output columns
    assert torch.equal(sd["transformer.h.0.mlp.c_fc.weight"], params["layers"][0]["mlp"]["c_fc"]["weight"].t())
    assert torch.equal(sd["transformer.h.0.attn.c_attn.bias"][96:], params["layers"][0]["attn"]["c_attn"]["bias"][2])


def test_unsupported_config_names_the_key():
    d = gpt2.config_to_hf(M.config("124m"))
    assert gpt2.config_from_hf(d) == M.config("124m")
    assert gpt2.config_from_hf({**d, "activation_function": "gelu_pytorch_tanh"}) == M.config("124m")
    for key, value in [
        ("activation_function", "relu"),
        ("scale_attn_by_inverse_layer_idx", True),
        ("add_cross_attention", True),
        ("scale_attn_weights", False),
    ]:
        with pytest.raises(ValueError, match=f"config.json {key}={value!r} is not supported"):
            gpt2.config_from_hf({**d, key: value})
    with pytest.raises(ValueError, match=r"lacks \['n_head'\]"):
        gpt2.config_from_hf({k: v for k, v in d.items() if k != "n_head"})
    with pytest.raises(ValueError, match="model_type='llama' is not supported"):
        gpt2.config_from_hf({**d, "model_type": "llama"})


def test_column_parallel_biases_are_sharded_and_row_parallel_bias_replicated():
    rules = default_rules(sequence_parallel=True)
    decl = M.params(M.config("debug"))["layers"][0]
    axes = {
        n: logical_to_mesh_axes(p.names, rules)
        for n, p in flatten_with_names(decl, is_leaf=lambda x: hasattr(x, "names"))[0]
    }
    fsdp = ("dp_shard", "ep", "cp")  # FSDP shards the embed dim over dp_shard x cp (ep's ranks too, under ep)
    assert axes["attn.c_attn.weight"] == ((), ("tp",), fsdp)  # q, k, v of this rank's heads
    assert axes["attn.c_attn.bias"] == ((), ("tp",))  # the column-parallel bias: sliced like its output
    assert axes["mlp.c_fc.bias"] == (("tp",),)
    assert axes["attn.c_proj.bias"] == axes["mlp.c_proj.bias"] == (fsdp,)  # row parallel: whole on every tp rank


def test_check_names_and_layout_errors():
    cfg = M.config("debug")
    seen = check_names(M, cfg)
    named = [n for n, _ in flatten_with_names(M.params(cfg), is_leaf=lambda x: hasattr(x, "names"))[0]]
    # every weight goes through a named contraction or lookup; the biases are plain adds
    assert seen == {n for n in named if not n.endswith("bias")}
    with pytest.raises(
        ValueError,
        match=r"parallelism.tp=3 does not divide model.n_heads=4, model.ffn_dim=256.*A tp that works for this model: 2",
    ):
        gpt2.check_layout(cfg, tp=3)
    with pytest.raises(ValueError, match="training.seq_len=2048 exceeds model.max_seq_len=1024"):
        gpt2.check_layout(cfg, tp=1, seq_len=2048)
    assert gpt2.flops_per_token(M.config("124m"), 1024) == 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 768 * 1024


def test_gradcheck_biases_positions_and_fused_qkv_under_every_layout():
    # TP shards the column-parallel biases, SP splits the positions; biases and norms are drawn random
    report = gradcheck("models.gpt2", flavor="debug", layouts=("fsdp", "hsdp", "tp", "tp_sp"))
    assert report == {"fsdp": {}, "hsdp": {}, "tp": {}, "tp_sp": {}}


def test_cli_trains_gpt2(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "functitan.cli",
        "train",
        "--model.name=models.gpt2",
        "--model.flavor=debug",
        "--training.steps=3",
        "--training.batch_size=4",
        "--training.seq_len=32",
        "--data.max_corpus_bytes=200000",
        "--metrics.log_every=1",
        f"--metrics.run_dir={tmp_path}",
        "--metrics.run_name=g",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "functitan: 3 steps, first loss" in out.stdout
    import json

    record = json.loads((tmp_path / "g" / "model_config.json").read_text())
    assert record["name"] == "models.gpt2" and record["config"]["dim"] == 64
