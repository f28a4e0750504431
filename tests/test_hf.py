"""Hugging Face interop: our Llama against transformers' LlamaForCausalLM, files both ways, error messages."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # build from configs; nothing may download
transformers = pytest.importorskip("transformers", minversion="5.0")  # 5.x: rope_parameters, dtype
safetensors_torch = pytest.importorskip("safetensors.torch")

from functitan import checkpoint as ckpt  # noqa: E402
from functitan.checkpoint import export_hf  # noqa: E402
from models import llama  # noqa: E402
from models.llama import config_from_hf  # noqa: E402

M = llama.MODEL


def config_to_hf(cfg, **kw):
    return {"architectures": ["LlamaForCausalLM"], **llama.config_to_hf(cfg, **kw)}


def load_hf(path, **kw):
    return ckpt.load_hf(path, M, **kw)


def save_hf(params, cfg, out, **kw):
    return ckpt.save_hf(params, M, cfg, out, **kw)


def to_hf_state_dict(params, cfg):
    return ckpt.to_hf_state_dict(params, M, cfg)


def from_hf_state_dict(sd, cfg, **kw):
    return ckpt.from_hf_state_dict(sd, M, cfg, **kw)


def import_hf(src, out, **kw):
    return ckpt.import_hf(src, out, M, **kw)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_model(*, tied: bool, rope: bool, seed: int = 0):
    """A tiny random LlamaForCausalLM; every weight (norms included) random, so a swapped key shows."""
    rope_params = {**(LLAMA3_ROPE if rope else {"rope_type": "default"}), "rope_theta": 10000.0 if rope else 500000.0}
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_parameters=rope_params,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied,rope", [(False, True), (True, False)], ids=["untied-llama3rope", "tied-defaultrope"])
def test_load_hf_logits_match_transformers(tmp_path, tied, rope):
    model = _hf_model(tied=tied, rope=rope)
    model.save_pretrained(tmp_path)
    cfg, params = load_hf(tmp_path)
    assert cfg == llama.LlamaConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        norm_eps=1e-5,
        rope_theta=10000.0 if rope else 500000.0,
        rope_scaling=llama.RopeScaling(original_max_position_embeddings=16) if rope else None,
        max_seq_len=64,
        tie_embeddings=tied,
    )
    ours = llama.apply(params, TOKENS, cfg)
    theirs = _hf_logits(model, TOKENS)
    assert ours.shape == theirs.shape == (2, 24, 128)
    assert (ours - theirs).abs().max().item() < 1e-5


def test_save_hf_round_trip_through_from_pretrained(tmp_path):
    model = _hf_model(tied=False, rope=True)
    model.save_pretrained(tmp_path / "src")
    cfg, params = load_hf(tmp_path / "src")
    save_hf(params, cfg, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    original, reloaded = model.state_dict(), back.state_dict()
    assert sorted(original) == sorted(reloaded)
    for key, value in original.items():
        assert torch.equal(value, reloaded[key]), key
    assert back.config.rope_parameters == {**LLAMA3_ROPE, "rope_theta": 10000.0}
    assert torch.equal(_hf_logits(back, TOKENS), _hf_logits(model, TOKENS))
    # the export reads back into the same config and the same tensors
    cfg2, params2 = load_hf(tmp_path / "out")
    assert cfg2 == cfg
    assert all(
        torch.equal(a, b)
        for a, b in zip(to_hf_state_dict(params, cfg).values(), to_hf_state_dict(params2, cfg2).values())
    )


def test_tied_export_writes_no_lm_head_and_accepts_equal_one(tmp_path):
    model = _hf_model(tied=True, rope=False)
    model.save_pretrained(tmp_path / "src")
    cfg, params = load_hf(tmp_path / "src")
    sd = to_hf_state_dict(params, cfg)
    assert "lm_head.weight" not in sd and len(sd) == 1 + 2 * 9 + 1
    with_head = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}
    assert torch.equal(from_hf_state_dict(with_head, cfg)["embed"]["weight"], sd["model.embed_tokens.weight"])
    with pytest.raises(
        ValueError, match="'lm_head.weight' differs from 'model.embed_tokens.weight' but the config ties them"
    ):
        from_hf_state_dict({**sd, "lm_head.weight": torch.zeros(128, 64)}, cfg)
    save_hf(params, cfg, tmp_path / "out")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.tie_word_embeddings is True
    assert (_hf_logits(back, TOKENS) - llama.apply(params, TOKENS, cfg)).abs().max().item() < 1e-5


def test_sharded_export_writes_index_and_loads_back(tmp_path):
    model = _hf_model(tied=False, rope=True)
    model.save_pretrained(tmp_path / "src")
    cfg, params = load_hf(tmp_path / "src")
    save_hf(params, cfg, tmp_path / "out")  # a stale single file that the sharded export must remove
    save_hf(params, cfg, tmp_path / "out", max_shard_bytes=40_000, dtype=torch.bfloat16)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert not (out / "model.safetensors").exists()
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert len(index["weight_map"]) == 1 + 2 * 9 + 2
    n_params = sum(p.numel() for p in model.parameters())
    assert index["metadata"]["total_size"] == 2 * n_params
    for name in shards:  # each shard under the limit unless it holds one tensor alone
        tensors = safetensors_torch.load_file(out / name)
        assert sum(t.numel() * 2 for t in tensors.values()) <= 40_000 or len(tensors) == 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    cfg2, params2 = load_hf(out, dtype=torch.float32)
    assert cfg2 == cfg
    want = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    got = to_hf_state_dict(params2, cfg2)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    back = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())


def test_config_round_trip_and_both_rope_layouts():
    cfg = llama.config("llama3_8b")
    d = config_to_hf(cfg, transformers_version="5.24.0")
    assert d["rope_parameters"]["rope_type"] == "llama3" and d["head_dim"] == 128
    assert config_from_hf(d) == cfg
    legacy = config_to_hf(cfg, transformers_version="4.46.0")
    assert "rope_parameters" not in legacy and legacy["rope_scaling"]["factor"] == 8.0
    assert legacy["rope_theta"] == 500000.0
    assert config_from_hf(legacy) == cfg
    hf = transformers.LlamaConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert hf.rope_parameters == d["rope_parameters"] and hf.num_key_value_heads == 8
    # n_kv_heads=None (multi-head attention) comes back explicit
    mha = llama.LlamaConfig(n_heads=8, n_kv_heads=None)
    assert config_from_hf(config_to_hf(mha)).n_kv_heads == 8
    # a minimal config takes HF's defaults, as transformers would
    minimal = config_from_hf(
        {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10}
    )
    assert (minimal.norm_eps, minimal.rope_theta, minimal.max_seq_len, minimal.n_kv_heads) == (1e-6, 10000.0, 2048, 4)


def test_unsupported_config_names_the_key():
    d = config_to_hf(llama.config("debug"))
    with pytest.raises(ValueError, match=r"rope_parameters\.rope_type='yarn' is not supported"):
        config_from_hf({**d, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='dynamic' is not supported"):
        config_from_hf({**{k: v for k, v in d.items() if k != "rope_parameters"}, "rope_scaling": {"type": "dynamic"}})
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        config_from_hf({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="mlp_bias=True is not supported"):
        config_from_hf({**d, "mlp_bias": True})
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        config_from_hf({**d, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="head_dim=64 is not supported"):
        config_from_hf({**d, "head_dim": 64})
    with pytest.raises(ValueError, match="model_type='mistral' is not supported"):
        config_from_hf({**d, "model_type": "mistral"})
    with pytest.raises(ValueError, match=r"lacks \['low_freq_factor'\]"):
        config_from_hf(
            {
                **d,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            }
        )
    with pytest.raises(ValueError, match=r"lacks \['hidden_size'\]"):
        config_from_hf({k: v for k, v in d.items() if k != "hidden_size"})


def test_state_dict_errors_name_both_keys():
    cfg = llama.config("debug", n_layers=1)
    sd = to_hf_state_dict(llama.init(cfg, 0), cfg)
    bad = {**sd, "model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 256)}
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' \(functitan 'layers\.0\.attn\.wk'\) "
        r"has shape \(64, 256\), expected \(128, 256\)",
    ):
        from_hf_state_dict(bad, cfg)
    missing = {k: v for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' \(functitan 'layers\.0\.mlp\.w_up'\) is missing"
    ):
        from_hf_state_dict(missing, cfg)
    with pytest.raises(
        ValueError, match=r"\['model\.layers\.1\.input_layernorm\.weight'\] .*map to no llama parameter"
    ):
        from_hf_state_dict({**sd, "model.layers.1.input_layernorm.weight": torch.ones(256)}, cfg)
    # old checkpoints carry RoPE buffers: ignored
    with_buffer = {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}
    assert torch.equal(
        from_hf_state_dict(with_buffer, cfg)["layers"][0]["attn"]["wq"], sd["model.layers.0.self_attn.q_proj.weight"]
    )
    params = llama.init(cfg, 0)
    params["layers"][0]["mlp"]["w_down"] = torch.zeros(3, 3)
    with pytest.raises(
        ValueError, match=r"'layers\.0\.mlp\.w_down' \('model\.layers\.0\.mlp\.down_proj\.weight'\) has shape \(3, 3\)"
    ):
        to_hf_state_dict(params, cfg)
    assert llama.hf_tensors(cfg)["layers.0.mlp_norm.weight"].key == "model.layers.0.post_attention_layernorm.weight"


def test_load_hf_refuses_pickle_and_reports_missing_shard(tmp_path):
    cfg = llama.config("debug", n_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(
        ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json .*pytorch_model\.bin.*never pickle"
    ):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="names 'model-00001-of-00002.safetensors', which is missing"):
        load_hf(tmp_path)


def test_import_then_export_round_trips_through_a_functitan_checkpoint(tmp_path):
    model = _hf_model(tied=False, rope=True)
    model.save_pretrained(tmp_path / "src")
    cfg = import_hf(tmp_path / "src", tmp_path / "ckpt", dtype=torch.bfloat16)
    assert cfg.rope_scaling is not None
    assert (tmp_path / "ckpt" / "model_config.json").is_file()
    assert export_hf(tmp_path / "ckpt", tmp_path / "out") == cfg  # the config comes from the checkpoint
    cfg2, params2 = load_hf(tmp_path / "out")
    assert cfg2 == cfg and params2["layers"][1]["mlp"]["w_up"].dtype == torch.bfloat16
    assert torch.equal(
        params2["layers"][1]["mlp"]["w_up"], model.model.layers[1].mlp.up_proj.weight.detach().to(torch.bfloat16)
    )
    assert torch.equal(params2["output"]["weight"], model.lm_head.weight.detach().to(torch.bfloat16))


def test_export_without_a_model_config_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"no model_config.json in .* or its parents; the trainer writes one"):
        export_hf(tmp_path, tmp_path / "out")


def _save_sharded_params(out_dir, cfg):
    import torch.distributed as dist

    from functitan.mesh import make_mesh
    from functitan.sharding import default_rules, place

    params = place(llama.init(cfg, 3), llama.specs(cfg), default_rules(), make_mesh(dp_shard=1, tp=2))
    assert isinstance(params["layers"][0]["attn"]["wq"], torch.distributed.tensor.DTensor)
    save_hf(params, cfg, out_dir, max_shard_bytes=100_000)
    return dist.get_rank(), sorted(os.listdir(out_dir))


def test_save_hf_gathers_dtensors_and_only_rank0_writes(tmp_path, gloo):
    cfg = llama.LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)
    results = gloo.run(_save_sharded_params, 2, str(tmp_path / "dist"), cfg)
    files = results[0][1]
    assert results == [(0, files), (1, files)]  # rank 1 returns after the files are complete
    assert "model.safetensors.index.json" in files and "config.json" in files
    save_hf(llama.init(cfg, 3), cfg, tmp_path / "ref", max_shard_bytes=100_000)
    assert sorted(os.listdir(tmp_path / "ref")) == files
    for name in files:
        if name.endswith(".safetensors"):
            a = safetensors_torch.load_file(tmp_path / "dist" / name)
            b = safetensors_torch.load_file(tmp_path / "ref" / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert (tmp_path / "dist" / name).read_text() == (tmp_path / "ref" / name).read_text()
