"""Zero-bubble's split backward (`functitan.pipeline._split_backward`): B gives the input gradient, W the weights'
gradients from what B kept, together exactly the one-pass backward and no more work (no recomputation)."""

from __future__ import annotations

import optree
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from functitan.pipeline._split_backward import input_grad
from functitan.random import PRNGKey
from functitan.sharding import Layout
from models import llama

CFG = llama.config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _stage():
    params = llama.init(CFG, PRNGKey(0))
    layers = params["layers"]
    weights = optree.tree_leaves(layers)
    for w in weights:
        w.requires_grad_(True)
    x = torch.randn(2, 16, CFG.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    dout = torch.randn(2, 16, CFG.dim, generator=torch.Generator().manual_seed(2))
    return (lambda: Layout().blocks(llama.block, layers, x, CFG, Layout())), x, dout, weights


def test_b_and_w_give_the_one_pass_gradients():
    f, x, dout, weights = _stage()
    expected = torch.autograd.grad(f(), [x, *weights], dout)
    dx, w_pass = input_grad(f(), x, dout, weights)
    got = [dx, *w_pass()]
    assert len(got) == len(expected) == 1 + 18  # 9 weights a block
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
        assert not g.requires_grad  # a gradient, no graph kept alive


def test_w_recomputes_nothing():
    """FLOPs of B + W equal those of the one-pass backward, and W's are the weight matmuls' dW alone."""
    f, x, dout, weights = _stage()
    out = f()
    with FlopCounterMode(display=False) as full:
        torch.autograd.grad(out, [x, *weights], dout)
    out = f()
    with FlopCounterMode(display=False) as b:
        _, w_pass = input_grad(out, x, dout, weights)
    with FlopCounterMode(display=False) as w:
        w_pass()
    tokens = x.shape[0] * x.shape[1]
    matrices = [t for t in weights if t.dim() == 2]
    assert len(matrices) == 14  # q, k, v, o, gate, up, down in each of 2 blocks
    assert w.get_total_flops() == sum(2 * tokens * t.numel() for t in matrices)  # dW = dy^T x, once each
    assert b.get_total_flops() + w.get_total_flops() == full.get_total_flops()


def test_w_on_plain_weights_calls_no_autograd_engine(monkeypatch):
    f, x, dout, weights = _stage()
    _, w_pass = input_grad(f(), x, dout, weights)
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    grads = w_pass()
    assert calls == [] and all(g is not None for g in grads)


@pytest.mark.parametrize("case", ["cast", "tied", "scaled", "unused"])
def test_w_falls_back_to_autograd_where_the_weight_branch_is_not_the_bare_leaf(case):
    """A cast or scaled weight, one weight used twice, a weight not used: W matches the one-pass backward."""
    g = torch.Generator().manual_seed(0)
    w1, w2, w3 = (torch.randn(8, 8, generator=g, requires_grad=True) for _ in range(3))
    x = torch.randn(4, 8, generator=g, requires_grad=True)

    def f():
        if case == "cast":
            h = x.double() @ w1.double().t()
            return (h.float() @ w2.t()).tanh()
        if case == "tied":
            return ((x @ w1.t()).tanh() @ w1.t()) @ w2
        if case == "scaled":
            return (x @ (2 * w1).t()).tanh() * w2[0]
        return (x @ w1.t()).tanh() @ w2

    dout = torch.randn(4, 8, generator=g)
    weights = [w1, w2, w3]
    expected = torch.autograd.grad(f(), [x, *weights], dout, allow_unused=True)
    dx, w_pass = input_grad(f(), x, dout, weights)
    got = [dx, *w_pass()]
    for i, (a, e) in enumerate(zip(got, expected)):
        if e is None:
            assert a is None, f"input {i}"
        else:
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"input {i}: {m}")
