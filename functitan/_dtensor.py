"""The three DTensor internals functitan's hot paths use, in one place, and a counter of DTensor op dispatch.

Written against torch 2.13 (pinned once, in pyproject.toml): ``DTensor._local_tensor`` (the shard),
``DTensor._spec`` (mesh, placements and global shape/stride/dtype), and ``DTensor.__new__(DTensor, local,
spec, requires_grad=...)`` (a DTensor around a shard without ``from_local``'s autograd Function and checks).
A torch upgrade that renames them breaks only this file; ``tests/test_dtensor_dispatch.py`` checks them.

Why not the public API: every op on a DTensor goes through sharding propagation, 15-60 us per op when its
strategy is cached and up to minutes the first time on a 4-D mesh (``benchmarks/dtensor_vs_local.py``);
``to_local``/``from_local`` are autograd Functions (~75-170 us a leaf). Gradient accumulation, the optimizer,
clipping, the pipeline executor and checkpoint staging therefore compute on ``local(x)`` and wrap results with
``wrap(result, spec(x))``. ``CountDTensorOps`` counts what still dispatches, so a test can hold it at zero.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor
from torch.compiler import is_compiling
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DTensor", "DTensorSpec", "local", "spec", "wrap", "CountDTensorOps"]


def local(x: Tensor) -> Tensor:
    """This rank's shard of ``x`` (``x`` itself for a plain tensor); no autograd edge, no dispatch."""
    if type(x) is not DTensor:
        return x
    if is_compiling():  # dynamo traces to_local (a view in the graph), not the attribute read
        return x.to_local()
    return x._local_tensor


class TracedSpec(NamedTuple):
    """What ``spec`` gives while dynamo traces: the fields of a DTensorSpec that ``wrap`` and the layout checks
    read, from public attributes (dynamo cannot hold a DTensorSpec object)."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: Any
    stride: tuple[int, ...]


def spec(x: Tensor) -> DTensorSpec | None:
    """The DTensor spec of ``x`` (None for a plain tensor); a ``TracedSpec`` under ``torch.compile``."""
    if type(x) is not DTensor:
        return None
    if is_compiling():
        return TracedSpec(x.device_mesh, x.placements, x.shape, x.stride())  # type: ignore[return-value]
    return x._spec


def wrap(t: Tensor, s: DTensorSpec | None, requires_grad: bool = False) -> Tensor:
    """``t`` (a shard) as a DTensor with spec ``s`` (``t`` itself when ``s`` is None), ~1-3 us.

    The result is an autograd leaf: call under ``torch.no_grad()`` or on tensors without history. A dtype
    change (fp32 updates of a bf16 param) gets a spec with the new dtype; global shape and stride stay.
    """
    if s is None:
        return t.requires_grad_(requires_grad) if requires_grad else t
    if is_compiling():  # dynamo traces from_local (nothing at run time), not DTensor.__new__
        out = DTensor.from_local(t, s.mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride)
        return out.requires_grad_(requires_grad) if requires_grad else out
    if s.tensor_meta is not None and s.tensor_meta.dtype != t.dtype:
        s = DTensorSpec(
            s.mesh, s.placements, tensor_meta=TensorMeta(s.tensor_meta.shape, s.tensor_meta.stride, t.dtype)
        )
    # DTensor.__new__ alone: DTensor.__init__ does nothing but costs ~2 us under its dynamo-disable wrapper.
    return DTensor.__new__(DTensor, t, s, requires_grad=requires_grad)


class CountDTensorOps(TorchDispatchMode):
    """Counts the aten ops dispatched with a DTensor argument while active (``.count``, ``.ops`` by name).

    A dispatch mode sees every op before the DTensor subclass does, so this counts exactly the ops that pay
    DTensor's sharding propagation. The mode costs a Python call per op: for tests, not for training.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            name = str(func)
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
