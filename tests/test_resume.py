"""Exact resume: a run saved at step 10 and resumed reproduces the uninterrupted run's losses bit for bit."""

import json

import pytest
import torch

from functitan.testing import run_distributed

from test_train import _train

CKPT = {"checkpoint.enable": True, "checkpoint.interval": 10, "checkpoint.keep_last": 2}


def _losses(run_dir: str) -> dict[int, float]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


class _Crash(Exception):
    pass


def _crash_at_step(step: int) -> None:
    """Make the trainer's step raise once ``step`` steps are done (in this worker process only)."""
    import functitan.train as train_module

    make = train_module.make_train_step

    def crashing(*args, **kwargs):
        train_step = make(*args, **kwargs)

        def step_fn(state, batch):
            if state.step == step:
                raise _Crash(f"simulated crash after step {step}")
            return train_step(state, batch)

        return step_fn

    train_module.make_train_step = crashing


def _interrupted_and_resumed(layout: dict, root: str):
    import functitan.train as train_module

    straight = _train({**layout, **CKPT, "training.steps": 14, "metrics.run_dir": root, "metrics.run_name": "straight"})
    original = train_module.make_train_step
    _crash_at_step(10)
    try:
        _train({**layout, **CKPT, "training.steps": 14, "metrics.run_dir": root, "metrics.run_name": "resumed"})
    except _Crash:
        pass
    train_module.make_train_step = original
    resumed = _train({**layout, **CKPT, "training.steps": 14, "metrics.run_dir": root, "metrics.run_name": "resumed"})
    return straight[1], resumed[1], resumed[2]


@pytest.mark.parametrize("world,layout", [(1, {}), (2, {"parallelism.dp_shard": 2})])
def test_resume_after_step_10_is_bit_exact(world, layout, tmp_path):
    straight_params, resumed_params, data_state = run_distributed(_interrupted_and_resumed, world, layout, str(tmp_path))[0]
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert [s for s in resumed if s > 10] == [11, 12, 13, 14]  # the second run started at step 11
    for step in (11, 12, 13, 14):
        assert resumed[step] == straight[step], step  # bit for bit
    for name, p in straight_params.items():
        assert torch.equal(resumed_params[name], p), name
    assert data_state["seq"] == 14 * 8
