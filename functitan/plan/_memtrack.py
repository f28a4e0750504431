"""Live tensor bytes of a traced step, as torch's ``MemTracker`` counts them, at a fraction of its cost per op.

``MemTracker`` (``torch.distributed._tools.mem_tracker``) keeps per-module, per-category snapshots, deep-copied
at each new peak, behind module and optimizer hooks that functional code never fires: about a third of a
fake trace's time. The planner reads one number, the peak of the total, so this mode keeps only what that
number needs, with MemTracker's rules: each tensor storage an op returns is counted once, by its bytes, from
the op that made it to the moment it is freed (a weak reference's callback); DTensor ops are left to desugar
into the local ops that allocate; ops of a nested fake mode (DTensor's sharding propagation) are not counted;
a fake ``wait_tensor`` returns its input (as eager does); ``UntypedStorage.resize_`` (not a dispatched op) is
followed; the peak is taken after every op. ``tests/test_plan.py`` checks it equals MemTracker to the byte.
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LiveBytes"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_DEVICE = torch.ops.prim.device.default


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages under ``t``, through wrapper subclasses (``torch.distributed._tools.get_untyped_storages``:
    importing that package imports its estimators and inductor, 0.7 s of a plan's start)."""
    if not is_traceable_wrapper_subclass(t):
        return [t.untyped_storage()]
    attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = (getattr(t, a) for a in attrs)
    return [st for x in inner if isinstance(x, torch.Tensor) for st in _storages(x)]


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: step()`` then ``m.peak`` (bytes); ``track_external(*tensors)`` counts tensors
    made before it (params, optimizer state) from the start; ``m.current``: the bytes alive now."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes counted]
        self._refs: dict[int, weakref.ref] = {}  # keeps the weak references (and their callbacks) alive
        self.at_backward: int | None = None  # live bytes when the first backward op ran (the first microbatch's
        #                                     forward done: its saved activations, params and state)
        self._fake_on_entry: Any = None
        self._resize: Any = None

    def track_external(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    if st not in self._sizes:
                        self._add(st)

    def _add(self, st: torch.UntypedStorage) -> None:
        cell = [st.nbytes()]
        self._sizes[st] = cell
        key = id(cell)

        def freed(_: weakref.ref, cell: list = cell, key: int = key) -> None:
            self.current -= cell[0]
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(st, freed)
        self.current += cell[0]

    def _track(self, t: torch.Tensor) -> None:
        for st in _storages(t):
            cell = self._sizes.get(st)
            if cell is not None:  # as MemTracker: a storage already counted ends the walk (a resize noted)
                if cell[0] != st.nbytes():
                    self.current += st.nbytes() - cell[0]
                    cell[0] = st.nbytes()
                return
            self._add(st)

    def __enter__(self) -> LiveBytes:
        self._fake_on_entry = _fake_mode()
        self._resize = torch.UntypedStorage.resize_
        original = self._resize

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            cell = self._sizes.get(st)
            if cell is not None and cell[0] != st.nbytes():
                self.current += st.nbytes() - cell[0]
                cell[0] = st.nbytes()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        self.peak = max(self.peak, self.current)
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*args)

    def _device(self, func, args, kwargs) -> Any:
        """A device query (``prim.device``): passed on. ``_trace._StepMode`` answers it here instead."""
        return func(*args, **(kwargs or {}))

    def _call(self, func, args, kwargs) -> Any:
        """The op itself, below this mode. ``_trace._StepMode`` counts it and answers host reads here: one mode
        on the stack instead of three (each costs a Python call and a re-dispatch per op)."""
        return func(*args, **(kwargs or {}))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # allocates nothing (half the ops a step dispatches: the autograd engine's checks)
            return self._device(func, args, kwargs)
        if DTensor in types:
            return NotImplemented  # let DTensor run its local ops, which allocate
        if self.at_backward is None and torch._C._current_autograd_node() is not None:
            self.at_backward = self.current
        fake = _fake_mode()
        if func is _WAIT and fake is not None:
            res = args[0]  # the fake impl returns a new tensor; eager waits in place
        else:
            res = self._call(func, args, kwargs)
        if fake is self._fake_on_entry:  # not DTensor's sharding propagation
            if isinstance(res, torch.Tensor):  # most ops: one tensor, no tree to walk
                self._track(res)
            else:
                for t in optree.tree_leaves(res, none_is_leaf=False):
                    if isinstance(t, torch.Tensor):
                        self._track(t)
            if self.current > self.peak:
                self.peak = self.current
        return res


def _fake_mode() -> Any:
    """The innermost active FakeTensorMode (``torch._guards.active_fake_mode`` without building the mode stack's
    list per op: a FakeTensorMode always sits in the FAKE slot, the innermost of nested ones)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
