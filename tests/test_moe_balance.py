"""The auxiliary-loss-free balance rule: its arithmetic (ties, no tokens, centring), and the step that applies it,
eager and compiled, against the rule by hand. Every layout's move equals one process's in
tests/test_deepseek_v3.py's equivalence matrix."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from functitan import optim
from functitan.moe import BIAS, LoadBalance, count_load
from functitan.moe._balance import TIE, _move
from functitan.step import make_train_step
from functitan.train_state import TrainState
from functitan.transforms import value_and_grad


def test_the_move_is_the_sign_of_mean_minus_load_centred_with_ties_and_empty_steps_at_zero():
    r = 1e-3
    torch.testing.assert_close(_move(torch.tensor([3.0, 1.0, 2.0, 2.0]), r), torch.tensor([-r, r, 0.0, 0.0]))
    # not centred by itself: three below the mean, one above -> centred over the experts
    torch.testing.assert_close(_move(torch.tensor([1.0, 1.0, 1.0, 5.0]), r), torch.tensor([r, r, r, -r]) - r / 2)
    # a sum's rounding (a load scaled by 1/tokens, averaged over ranks) is a tie, not a move
    scaled = torch.tensor([3.0, 1.0, 2.0, 2.0]) / 3.0
    scaled[2] *= 1 + TIE / 10
    torch.testing.assert_close(_move(scaled, r), torch.tensor([-r, r, 0.0, 0.0]))
    assert torch.equal(_move(torch.zeros(4), r), torch.zeros(4))  # no token routed: no move


def _routed(p, batch):
    """A toy routed layer: 4 experts, top-1 over the scores plus the bias, the bias's gradient its load."""
    x = batch["x"]  # (tokens, 3)
    scores = (x @ p["router"].T).sigmoid()  # (tokens, 4)
    with torch.no_grad():
        chosen = (scores + p["bias"]).argmax(-1)
        load = torch.zeros(4).scatter_add_(0, chosen, torch.ones(chosen.shape))  # (bincount breaks the graph)
    out = count_load((scores.gather(1, chosen[:, None]) * (x @ p["w"])).squeeze(-1), p["bias"], load)
    return ((out - batch["y"]) ** 2).mean(), load


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_the_step_moves_each_bias_by_its_load_outside_the_optimizer_eager_and_compiled(compile):
    g = torch.Generator().manual_seed(0)
    params = {"router": torch.randn(4, 3, generator=g), "w": torch.randn(3, generator=g), "bias": torch.zeros(4)}
    params = {k: v.requires_grad_() for k, v in params.items()}
    batches = [{"x": torch.randn(32, 3, generator=g), "y": torch.randn(32, generator=g)} for _ in range(3)]
    balance = LoadBalance.from_specs({"router": ("router", "embed"), "w": ("embed",), "bias": (BIAS,)}, 0.01)
    assert balance is not None and balance.names == {"bias"}
    opt = optim.adamw(0.1, weight_decay=0.5, mask=None)  # would decay the bias: the rule's value must win
    grad_fn = lambda p, b: value_and_grad(lambda q: _routed(q, b)[0])(p)  # noqa: E731
    step = make_train_step(grad_fn, opt, balance=balance, compile=compile, max_norm=1e-2)
    state = TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=0)
    bias = torch.zeros(4)
    quiet = warnings.catch_warnings() if compile else contextlib.nullcontext()
    with quiet:
        if compile:  # dynamo instantiates an autograd.Function to trace it, which warns (torch 2.13)
            warnings.filterwarnings("ignore", ".*should not be instantiated", DeprecationWarning)
        bias = _steps(step, state, batches, bias)
    assert bias.abs().max() > 0


def _steps(step, state, batches, bias):
    for b in batches:
        load = _routed({k: v.detach() for k, v in state.params.items()}, b)[1]
        move = 0.01 * torch.sign(load.mean() - load)
        bias = bias + move - move.mean()
        w_before = state.params["w"].detach().clone()
        state, metrics = step(state, b)
        torch.testing.assert_close(state.params["bias"].detach(), bias, atol=1e-7, rtol=0)
        assert not torch.equal(state.params["w"].detach(), w_before)
        assert metrics["moe_bias_norm"] == pytest.approx(float(bias.norm()), rel=1e-6)
        assert metrics["grad_norm"] < 10  # the loads (tens) are not in it
    return bias
