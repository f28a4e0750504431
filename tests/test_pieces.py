"""Models declare pieces (embed, block, head); the library composes apply, loss and the pipeline stages."""

import dataclasses

import pytest
import torch

from functitan.model import Model, Pieces, init
from functitan.sharding import Layout
from models import gpt2, llama, qwen3

CFG = llama.config("debug", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)


def test_composed_apply_and_loss_are_embed_blocks_head_and_cross_entropy():
    params = init(llama.params(CFG), 0)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    x = llama.embed(params, tokens[:, :-1], CFG)
    for p in params["layers"]:
        x = llama.block(p, x, CFG, Layout())
    logits = llama.head(params, x, CFG)
    assert torch.equal(llama.MODEL.apply(params, tokens[:, :-1], CFG), logits)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert torch.equal(llama.loss(params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, CFG), want)


@pytest.mark.parametrize(
    ("model", "cfg", "width", "first", "last"),
    [
        (llama.MODEL, CFG, 32, ("embed",), ("norm", "output")),
        (gpt2.MODEL, gpt2.MODEL.config("debug", n_layers=3), 64, ("wte", "wpe"), ("ln_f", "wte")),  # tied
        (qwen3.MODEL, qwen3.MODEL.config("debug"), 4 * 32, ("embed",), ("norm", "output")),
    ],
)
def test_stages_take_their_keys_and_costs_from_the_declaration(model, cfg, width, first, last):
    import math

    decl = model.params(cfg)
    matrices = sum(math.prod(p.shape) for p in _leaves(decl["layers"][0]) if len(p.shape) >= 2)
    sm = model.stages(cfg, Layout(), seq_len=16)
    assert (sm.first_keys, sm.last_keys, sm.n_blocks) == (first, last, cfg.n_layers)
    assert sm.block_cost == 2 * matrices + 2 * 16 * width  # qwen3: heads * head_dim (128), not dim (64)
    assert sm.first_cost == cfg.dim * len(first)
    assert sm.last_cost == 2 * cfg.vocab_size * cfg.dim + 5 * cfg.vocab_size + 4 * cfg.dim


@pytest.mark.parametrize("model", [llama.MODEL, gpt2.MODEL, qwen3.MODEL], ids=lambda m: m.name)
def test_a_stages_first_and_last_pieces_gather_only_the_keys_they_read(model, monkeypatch):
    """The pipeline executor hands a stage's pieces the rank's whole param tree, blocks included. Each piece gathers
    (``layout.param``: an FSDP all-gather per leaf and microbatch) only its own keys: gathering the whole tree in
    every microbatch made a pp 2 x fsdp 2 step 1.3x slower than fsdp 4 on 4 CPU ranks (1.05x with this)."""
    cfg = model.config("debug", n_layers=2)
    params = init(model.params(cfg), 0)
    gathered: list = []
    real = Layout.param
    monkeypatch.setattr(Layout, "param", lambda self, p: gathered.append(p) or real(self, p))
    sm = model.stages(cfg, Layout(), seq_len=8)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    mb = {"inputs": tokens, "targets": tokens}
    read = {k: {id(x) for x in _leaves(params[k])} for k in params if k != sm.blocks_key}

    def keys_of(tensors):
        return {k for k, ids in read.items() if ids & {id(t) for t in tensors}}, len(tensors)

    h = sm.first(params, mb)
    assert keys_of(gathered) == (set(sm.first_keys), sum(len(read[k]) for k in sm.first_keys))
    gathered.clear()
    sm.last(params, h, mb)
    assert keys_of(gathered) == (set(sm.last_keys), sum(len(read[k]) for k in sm.last_keys))


def _leaves(tree):
    import optree

    from functitan.model import is_param

    return optree.tree_leaves(tree, is_leaf=is_param)


def test_a_model_may_override_a_piece_composed_function_or_give_none_and_be_told():
    mine = lambda params, tokens, cfg, layout=None: "mine"  # noqa: E731
    model = dataclasses.replace(llama.MODEL, apply=mine)
    assert model.apply is mine and model.loss is not mine and model.stages is not None
    with pytest.raises(TypeError, match=r"gives no apply and no loss; give pieces=Pieces\(embed=, block=, head="):
        Model(name="bare", configs={"x": CFG}, params=llama.params, flops_per_token=llama.flops_per_token)
    assert isinstance(llama.MODEL.pieces, Pieces)
