"""The nn.Module Llama of benchmarks/torch_llama.py against models.llama: same logits, same AdamW step."""

import optree
import pytest
import torch
from support import TINY_LLAMA

from benchmarks.torch_llama import Llama, from_functional, module_name, to_functional
from functitan import optim
from functitan.mesh import make_mesh
from functitan.random import key
from functitan.sharding import default_rules, place
from functitan.transforms import value_and_grad
from functitan.tree import flatten_with_names
from models import llama


def _batch(cfg, b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "inputs": torch.randint(0, cfg.vocab_size, (b, s), generator=g),
        "targets": torch.randint(0, cfg.vocab_size, (b, s), generator=g),
    }


@pytest.mark.parametrize(
    "cfg", [TINY_LLAMA, llama.config("debug", n_layers=1, tie_embeddings=True, vocab_size=64)], ids=["gqa", "tied"]
)
def test_logits_equal_functional(cfg):
    params = llama.init(cfg, key(1))
    model = from_functional(params, cfg)
    tokens = _batch(cfg)["inputs"]
    ref = llama.apply(params, tokens, cfg)
    out = model(tokens)
    assert out.shape == (2, 16, cfg.vocab_size)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ("output.weight" in dict(model.named_parameters())) == (not cfg.tie_embeddings)


def test_round_trip_and_names():
    params = llama.init(TINY_LLAMA, key(2))
    back = to_functional(from_functional(params, TINY_LLAMA))
    named = flatten_with_names(back)[0]
    assert [n for n, _ in named] == [n for n, _ in flatten_with_names(params)[0]]
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(params), optree.tree_leaves(back)))
    assert module_name("layers.1.mlp.w_gate") == "layers.1.feed_forward.w1.weight"
    assert module_name("embed.weight") == "tok_embeddings.weight"


def test_adamw_step_equals_torch_adamw():
    params = llama.init(TINY_LLAMA, key(3))
    model = from_functional(params, TINY_LLAMA)
    hp = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    # the same decay split on both sides: matrices decay, norms do not
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if optim.default_decay_mask(name, p) else no_decay).append(p)
    assert len(no_decay) == 2 * TINY_LLAMA.n_layers + 1  # norms (default_decay_mask decays every matrix)
    torch_opt = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(hp["b1"], hp["b2"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )
    opt = optim.adamw(1e-2, mask=optim.default_decay_mask, **hp)
    state = opt.init(params)
    grad_fn = value_and_grad(lambda p, b: llama.loss(p, b, TINY_LLAMA))
    for step in range(2):
        batch = _batch(TINY_LLAMA, seed=step)
        loss, grads = grad_fn(params, batch)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)

        torch_opt.zero_grad(set_to_none=True)
        torch_loss = model.loss(batch["inputs"], batch["targets"])
        torch_loss.backward()
        torch_opt.step()
        torch.testing.assert_close(torch_loss.detach(), loss, rtol=1e-5, atol=1e-6)
    for (name, ours), theirs in zip(flatten_with_names(params)[0], optree.tree_leaves(to_functional(model))):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(optree.tree_leaves(params)[1], optree.tree_leaves(llama.init(TINY_LLAMA, key(3)))[1])


def test_from_dtensor_params_on_one_rank_mesh():
    mesh = make_mesh(device="cpu")
    params = llama.init(TINY_LLAMA, key(4))
    placed = place(params, llama.specs(TINY_LLAMA), default_rules(), mesh)
    model = from_functional(placed, TINY_LLAMA)
    tokens = _batch(TINY_LLAMA)["inputs"]
    torch.testing.assert_close(model(tokens), llama.apply(params, tokens, TINY_LLAMA), rtol=1e-5, atol=1e-5)


def test_meta_module_allocates_nothing():
    with torch.device("meta"):
        model = Llama(llama.CONFIGS["llama3_8b"])
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == llama.num_params(llama.CONFIGS["llama3_8b"])


def test_errors_name_the_key_path():
    params = llama.init(TINY_LLAMA, key(5))
    params["layers"][1]["attn"]["wk"] = torch.zeros(3, 32)
    with pytest.raises(
        ValueError, match=r"params\['layers.1.attn.wk'\] has shape \(3, 32\) but the config gives \(16, 32\)"
    ):
        from_functional(params, TINY_LLAMA)
    del params["layers"][1]["attn"]["wk"]
    with pytest.raises(ValueError, match=r"differ at 'layers.1.attn'"):
        from_functional(params, TINY_LLAMA)
    with pytest.raises(ValueError, match=r"'layers.0.attn.w_q' is not a Llama parameter name"):
        module_name("layers.0.attn.w_q")
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        from_functional(llama.init(TINY_LLAMA, key(5)), TINY_LLAMA)(torch.zeros(1, 65, dtype=torch.long))
