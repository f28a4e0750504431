"""The one pytree a training run carries from step to step (and into every checkpoint)."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["TrainState"]


class TrainState(NamedTuple):
    """Everything needed to continue a run exactly.

    Attributes:
        step: steps completed (Python int).
        params: the parameter tree (DTensor leaves in storage placement, or plain tensors on one device).
        opt_state: the optimizer state (NamedTuples of trees mirroring params; a 0-d int64 step count).
        data_state: the data iterator's state, a small tree of Python ints, identical on every rank.
        rng: the run's PRNG key (a Python int, see functitan.random).
    """

    step: int
    params: Any
    opt_state: Any
    data_state: Any
    rng: int
