"""The library API given what users get wrong: one message naming the leaf or argument and the fix (each of
these was a deep traceback or a silently wrong result in a user's review)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functitan import optim
from functitan.model import count, init, specs
from functitan.random import key
from functitan.transforms import split_batch


def test_a_0d_tensor_in_a_batch_that_is_split_into_microbatches_is_named():
    batch = {"inputs": torch.ones(4, 2), "scale": torch.tensor(2.0)}
    with pytest.raises(ValueError, match=r"batch leaf 'scale' is a 0-d tensor: microbatches split every tensor"):
        split_batch(batch, 2)
    # a Python number goes to every microbatch
    assert [m["scale"] for m in split_batch({"inputs": torch.ones(4, 2), "scale": 2.0}, 2)] == [2.0, 2.0]


def test_adamw_given_another_optimizers_state_says_so():
    p = {"w": torch.ones(2)}
    sgd_state = optim.sgd(0.1, momentum=0.9).init(p)
    with pytest.raises(TypeError, match=r"adamw.update got a tuple as its state, not adamw's"):
        optim.adamw(0.1).update(p, sgd_state, p)


def test_inject_hyperparams_schedules_a_learning_rate_that_defaults_to_none():
    state = optim.inject_hyperparams(optim.adafactor)(learning_rate=lambda t: 0.1 / (1 + t)).init(
        {"w": torch.ones(4, 4)}
    )
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.1)


def test_masked_and_multi_transform_take_the_none_gradients_of_integer_leaves():
    from functitan.transforms import value_and_grad

    params = {"a": torch.ones(4, 4), "n": torch.tensor(3), "z": torch.ones(4)}
    _, grads = value_and_grad(lambda p: p["a"].sum() * p["n"] + p["z"].sum())(params)
    assert grads["n"] is None
    for opt, z_step in (
        (optim.masked(optim.sgd(0.1), lambda name, p: p.ndim == 2), 1.0),  # z passes through unchanged
        (
            optim.multi_transform({"s": optim.sgd(0.1), "t": optim.sgd(0.2)}, lambda n, p: "s" if p.ndim == 2 else "t"),
            0.2,
        ),
    ):
        updates, _ = opt.update(grads, opt.init(params), params)
        assert updates["n"] is None and float(updates["a"].abs().max()) == pytest.approx(0.3)
        assert float(updates["z"].abs().max()) == pytest.approx(z_step)


def test_inject_hyperparams_passes_a_mask_through_and_schedules_the_learning_rate():
    # a callable mask used to be taken for a schedule (called with the step count: "missing argument 'param'")
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    opt = optim.inject_hyperparams(optim.adamw)(
        learning_rate=lambda step: 0.1 * (step + 1), weight_decay=0.5, mask=lambda name, p: name == "w"
    )
    state = opt.init(params)
    assert sorted(state.hyperparams) == ["learning_rate", "weight_decay"]
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    for lr in (0.1, 0.2):
        updates, state = opt.update(zeros, state, params)
        assert float(updates["w"].abs().max()) == pytest.approx(lr * 0.5) and float(updates["b"].abs().max()) == 0


def test_a_declaration_holding_a_tensor_names_the_leaf_and_param():
    for fn in (specs, lambda d: init(d, key(0))):
        with pytest.raises(TypeError, match=r"declaration leaf 'w' is a Tensor, not a functitan.model.Param"):
            fn({"w": torch.zeros(3)})
    assert count({"w": torch.zeros(3, 4), "b": torch.zeros(4)}) == 16  # counting a tree of tensors is fine
    with pytest.raises(TypeError, match=r"declaration leaf 'w' is a int, not a functitan.model.Param"):
        count({"w": 3})


def test_keys_take_any_integer_and_refuse_the_rest():
    assert key(np.int64(3)) == key(3)
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError, match=r"seed must be an int, got"):
            key(bad)


def test_a_model_whose_loss_cannot_take_the_trainers_arguments_is_refused_when_declared():
    import dataclasses

    from functitan.model import Model

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        vocab_size: int = 8

    with pytest.raises(TypeError, match=r"model 'x': loss <lambda>\(p, b\) cannot be called as loss\(params, batch, "):
        Model(
            name="x",
            configs={"debug": Cfg()},
            params=lambda c: {},
            loss=lambda p, b: p,  # the trainer calls loss(params, batch, cfg, layout)
            apply=lambda p, tokens, cfg, layout: p,
            flops_per_token=lambda c, s: 1.0,
        )
