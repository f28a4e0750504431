"""The functional Llama: meta init, layout-independent init, GQA/RoPE against direct formulas, config errors."""

import math
import resource

import pytest
import torch
import torch.nn.functional as F
from support import TINY_LLAMA

from functitan.mesh import make_mesh
from functitan.random import key
from functitan.sharding import default_rules, place
from functitan.tree import flatten_with_names, tree_leaves
from models import llama


def test_published_shapes():
    assert llama.num_params(llama.CONFIGS["llama3_8b"]) == 8_030_261_248
    assert llama.num_params(llama.CONFIGS["llama3_1b"]) == 1_235_814_400  # tied embeddings
    assert llama.num_params(llama.CONFIGS["llama3_70b"]) == 70_553_706_496
    assert llama.num_params(llama.CONFIGS["llama3_405b"]) == 405_853_388_800


def test_llama3_8b_init_on_meta_allocates_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = llama.init(llama.CONFIGS["llama3_8b"], key(0), device="meta")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    leaves = tree_leaves(params)
    assert all(p.is_meta for p in leaves)
    assert sum(p.numel() for p in leaves) == 8_030_261_248
    assert grown_kib < 50_000  # 32 GB of fp32 weights would be 3.2e7 KiB


def test_specs_mirror_params_and_name_every_dim():
    params = llama.init(TINY_LLAMA, key(0))
    specs = llama.specs(TINY_LLAMA)
    named_p, _ = flatten_with_names(params)
    named_s, _ = flatten_with_names(specs, is_leaf=lambda s: isinstance(s, tuple))
    assert [n for n, _ in named_p] == [n for n, _ in named_s]
    for (name, p), (_, s) in zip(named_p, named_s):
        assert len(s) == p.ndim, name


def test_init_is_deterministic_and_keyed_by_name():
    a, b = llama.init(TINY_LLAMA, key(3)), llama.init(TINY_LLAMA, key(3))
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)))
    c = llama.init(TINY_LLAMA, key(4))
    assert not torch.equal(a["layers"][0]["attn"]["wq"], c["layers"][0]["attn"]["wq"])
    assert not torch.equal(a["layers"][0]["attn"]["wq"], a["layers"][1]["attn"]["wq"])


def _gathered_init(degrees):
    mesh = make_mesh(**degrees)
    params = place(llama.init(TINY_LLAMA, key(7)), llama.specs(TINY_LLAMA), default_rules(), mesh)
    return {n: p.full_tensor() for n, p in flatten_with_names(params)[0]}


@pytest.mark.parametrize("degrees", [dict(dp_shard=4), dict(dp_replicate=2, dp_shard=2), dict(dp_shard=2, tp=2)])
def test_init_is_identical_across_meshes(degrees, gloo):
    ref = dict(flatten_with_names(llama.init(TINY_LLAMA, key(7)))[0])
    for rank_params in gloo.run(_gathered_init, 4, degrees):
        assert rank_params.keys() == ref.keys()
        for n, full in rank_params.items():
            assert torch.equal(full, ref[n]), n


def _reference_forward(params, tokens, cfg):
    """Llama written out directly (HF semantics): repeat_kv, explicit causal softmax, rotate_half."""
    b, s = tokens.shape
    hd, h, kv = cfg.head_dim, cfg.n_heads, cfg.kv_heads
    x = params["embed"]["weight"][tokens]
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).double() / hd))
    ang = torch.outer(torch.arange(s).double(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()

    def rot(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    mask = torch.full((s, s), float("-inf")).triu(1)
    for p in params["layers"]:
        y = norm(x, p["attn_norm"]["weight"])
        q = (y @ p["attn"]["wq"].T).view(b, s, h, hd).transpose(1, 2)
        k = (y @ p["attn"]["wk"].T).view(b, s, kv, hd).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        v = (y @ p["attn"]["wv"].T).view(b, s, kv, hd).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        a = torch.softmax(rot(q) @ rot(k).transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
        x = x + a.transpose(1, 2).reshape(b, s, -1) @ p["attn"]["wo"].T
        y = norm(x, p["mlp_norm"]["weight"])
        x = x + (F.silu(y @ p["mlp"]["w_gate"].T) * (y @ p["mlp"]["w_up"].T)) @ p["mlp"]["w_down"].T
    return norm(x, params["norm"]["weight"]) @ params["output"]["weight"].T


def test_apply_matches_a_direct_implementation():
    params = llama.init(TINY_LLAMA, key(1))
    params["norm"]["weight"] = torch.rand(TINY_LLAMA.dim) + 0.5  # non-trivial norm weights
    tokens = torch.randint(0, TINY_LLAMA.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        llama.apply(params, tokens, TINY_LLAMA), _reference_forward(params, tokens, TINY_LLAMA), atol=2e-5, rtol=1e-4
    )


def test_llama3_rope_scaling_matches_the_published_rule():
    cfg = llama.config("debug", dim=256, n_heads=2, n_kv_heads=2, rope_scaling=llama.RopeScaling())
    cos, _ = llama.rope_tables(cfg, 2)
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).double() / hd))
    wavelen = 2 * math.pi / inv
    expected = []
    for f, w in zip(inv.tolist(), wavelen.tolist()):  # Meta's apply_scaling, element by element
        if w < 8192 / 4:
            expected.append(f)
        elif w > 8192 / 1:
            expected.append(f / 8)
        else:
            smooth = (8192 / w - 1) / (4 - 1)
            expected.append((1 - smooth) * f / 8 + smooth * f)
    torch.testing.assert_close(
        cos[1, : hd // 2].double(), torch.tensor(expected, dtype=torch.float64).cos(), atol=1e-6, rtol=0
    )


def test_tied_embeddings_have_no_output_head():
    cfg = llama.config("debug", tie_embeddings=True, n_layers=1)
    params = llama.init(cfg, key(0))
    assert "output" not in params and "output" not in llama.specs(cfg)
    assert llama.apply(params, torch.zeros(1, 4, dtype=torch.long), cfg).shape == (1, 4, cfg.vocab_size)


def test_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"model.dim=100 is not divisible by model.n_heads=8; choose n_heads among"):
        llama.LlamaConfig(dim=100, n_heads=8)
    with pytest.raises(
        ValueError,
        match=r"model.n_heads=8 is not divisible by model.n_kv_heads=3; choose n_kv_heads among \[1, 2, 4, 8\]",
    ):
        llama.LlamaConfig(dim=64, n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown Llama config 'llama9'"):
        llama.config("llama9")
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds model.max_seq_len=64"):
        llama.apply(llama.init(TINY_LLAMA, key(0)), torch.zeros(1, 65, dtype=torch.long), TINY_LLAMA)


def test_layouts_that_cannot_split_the_model_fail_before_launch():
    cfg = llama.config("debug")  # 8 heads, 4 kv heads, ffn 768
    with pytest.raises(
        ValueError,
        match=r"parallelism.tp=3 does not divide model.n_heads=8, model.n_kv_heads=4; .* A tp that works for this model: 2",
    ):
        llama.check_layout(cfg, tp=3)
    with pytest.raises(
        ValueError, match=r"parallelism.tp=8 does not divide model.n_kv_heads=4; .*A tp that works for this model: 4"
    ):
        llama.check_layout(cfg, tp=8)
    with pytest.raises(
        ValueError,
        match=r"sequence parallelism with parallelism.tp=4 needs training.seq_len divisible by 4, got 130; use seq_len=128",
    ):
        llama.check_layout(cfg, tp=4, seq_len=130, sequence_parallel=True)
    llama.check_layout(cfg, tp=4, seq_len=128, sequence_parallel=True)  # fine
