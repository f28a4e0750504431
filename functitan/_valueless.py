"""Tensors without values: the planner's traced step (``functitan.plan``) runs the trainer's own step on meta
tensors, which have shapes, dtypes and storages of a size but no data. The few places whose path depends on
values (the MoE dispatch's split sizes, a pipeline's exchange of objects) take a stand-in path there."""

from __future__ import annotations

from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

__all__ = ["valueless"]


def valueless(t: Tensor) -> bool:
    """``t`` has no values to read: a meta tensor (the planner's trace) or a fake one (``FakeTensorMode``)."""
    return t.device.type == "meta" or is_fake(t)
