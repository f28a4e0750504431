"""Qwen3: parameter counts of the published sizes, HF logits and files both ways, names, layouts, gradients."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # build from configs; nothing may download
transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors.torch")

from functitan import checkpoint as ckpt  # noqa: E402
from functitan.model import check_names, count, gradcheck  # noqa: E402
from functitan.tree import flatten_with_names  # noqa: E402
from models import qwen3  # noqa: E402

M = qwen3.MODEL
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
LOGITS_ATOL = 1e-5  # fp32; measured max |ours - HF| = 1.3e-6 (RoPE tables in fp64 vs HF's fp32, summation order)


@pytest.mark.parametrize("flavor", ["0.6b", "1.7b", "4b", "8b", "14b", "32b"])
def test_published_sizes_count_exactly_as_transformers(flavor):
    cfg = M.config(flavor)
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in qwen3.config_to_hf(cfg).items() if k != "model_type"})
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(hf_cfg)
    assert count(M.params(cfg)) == sum(p.numel() for p in hf.parameters())  # a tied head counted once
    assert qwen3.config_from_hf(hf_cfg.to_dict()) == cfg


def _hf_model(tied: bool, seed: int = 0):
    """A tiny random Qwen3ForCausalLM with head_dim != hidden / heads; every weight (norms too) random."""
    config = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_load_hf_logits_match_transformers_and_export_round_trips(tmp_path, tied):
    model = _hf_model(tied)
    model.save_pretrained(tmp_path / "src")
    cfg, params = ckpt.load_hf(tmp_path / "src", M)
    assert cfg == qwen3.Qwen3Config(
        vocab_size=96,
        dim=48,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=80,
        rope_theta=10000.0,
        max_seq_len=64,
        tie_embeddings=tied,
    )
    with torch.no_grad():
        theirs = model(TOKENS).logits
    ours = M.apply(params, TOKENS, cfg)
    assert ours.shape == theirs.shape == (2, 20, 96)
    assert (ours - theirs).abs().max().item() < LOGITS_ATOL
    ckpt.save_hf(params, M, cfg, tmp_path / "out")
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    original, reloaded = model.state_dict(), back.state_dict()
    assert sorted(original) == sorted(reloaded)
    for key, value in original.items():
        assert torch.equal(value, reloaded[key]), key
    assert back.config.tie_word_embeddings is tied and back.config.head_dim == 16
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, theirs)


def test_unsupported_config_names_the_key():
    d = qwen3.config_to_hf(M.config("8b"))
    assert qwen3.config_from_hf(d) == M.config("8b")
    assert qwen3.config_from_hf(qwen3.config_to_hf(M.config("8b"), transformers_version="4.51.0")) == M.config("8b")
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        qwen3.config_from_hf({**d, "use_sliding_window": True})
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        qwen3.config_from_hf({**d, "attention_bias": True})
    with pytest.raises(ValueError, match=r"rope_parameters\.rope_type='yarn' is not supported"):
        qwen3.config_from_hf({**d, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}})
    with pytest.raises(ValueError, match=r"layer_types holds \['full_attention', 'sliding_attention'\]"):
        qwen3.config_from_hf({**d, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match="model_type='qwen2' is not supported"):
        qwen3.config_from_hf({**d, "model_type": "qwen2"})


def test_check_names_and_layout_errors():
    cfg = M.config("debug")
    named = {n for n, _ in flatten_with_names(M.params(cfg), is_leaf=lambda x: hasattr(x, "names"))[0]}
    assert check_names(M, cfg) == named  # every param, q/k norms included, goes through a named contraction
    with pytest.raises(
        ValueError, match=r"parallelism.tp=4 does not divide model.n_kv_heads=2.*A tp that works for this model: 2"
    ):
        qwen3.check_layout(cfg, tp=4)
    with pytest.raises(ValueError, match="needs training.seq_len divisible by 2, got 33"):
        qwen3.check_layout(cfg, tp=2, seq_len=33, sequence_parallel=True)


def test_gradcheck_qk_norms_and_gqa_under_every_layout():
    # the q/k norm weights are replicated while their activations are split by heads (TP) or by sequence (SP)
    # pp_fsdp_zb: ZB-H1's W pass, whose group of an FSDP bucket walked through a q/k norm's node that an earlier
    # group had freed ("backward through the graph a second time", the last stage's ranks)
    layouts = ("fsdp", "hsdp", "tp", "tp_sp", "fsdp_tp_sp", "pp_fsdp_zb")
    assert gradcheck("models.qwen3", flavor="debug", layouts=layouts) == {n: {} for n in layouts}
    # the tied variant: one table is both the embedding and the vocab-parallel head
    assert gradcheck("models.qwen3", flavor="debug", overrides={"tie_embeddings": True}, layouts=("tp_sp",)) == {
        "tp_sp": {}
    }


def test_pyproject_entry_points_name_the_models():
    import tomllib
    from pathlib import Path

    from functitan.model import load_model
    from models import deepseek_v3, gpt2, llama, qwen3_moe

    eps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["entry-points"][
        "functitan.models"
    ]
    assert {name: load_model(value) for name, value in eps.items()} == {
        "llama": llama.MODEL,
        "gpt2": gpt2.MODEL,
        "qwen3": M,
        "qwen3_moe": qwen3_moe.MODEL,
        "deepseek_v3": deepseek_v3.MODEL,
    }
