"""Check mode's view of the model's own torch ops: every use of a parameter, not only the Layout's calls.

``functitan.model.check_names`` runs the loss once under ``Tracker``, a ``TorchFunctionMode`` over a
``NameTable``. For each torch op the model itself calls (ops inside functitan or torch are the library's):

- a view of a param (``w[e]``, ``stack[i]``, ``w.T``, ``w.transpose``, ``w.unbind``, ``w.float()``) is
  recorded with the names its dims keep, so ``layout.einsum`` checks the view against its pattern;
- a raw contraction (``x @ w``, ``torch.matmul``, ``F.linear``, ``torch.einsum``, ``F.embedding``) of a param
  or view with a tp-sharded dim is refused: only the Layout runs the collectives a sharded dim needs, and a
  raw one computes with this rank's shard as if it were the whole (wrong values under TP, or a shape error);
- a slice, an index or a split of a tp-sharded dim is refused: each tp rank holds a different piece of it;
- a param added or multiplied elementwise onto an activation whose names are known (the output of a Layout
  call, carried through elementwise ops) must name the trailing dims it broadcasts over as the activation
  does: a bias declared on the wrong dim is right while every rank holds whole tensors (one process, FSDP) and
  a shape error or a wrong sum once that dim is sharded. A broadcast error on a param names the param.

Every refusal names the param, its declared names, the call site and the fix.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._names import NameTable, Use, site

__all__ = ["Tracker"]

_LIBRARY = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))

_CONTRACTIONS = {
    "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "linear", "bilinear", "einsum", "tensordot",
    "addmm", "baddbmm", "inner", "outer", "dot", "embedding",
}  # fmt: skip
_SAME = {"float", "to", "contiguous", "clone", "detach", "type_as", "requires_grad_", "half", "bfloat16", "double"}
_ELEMENTWISE_BINARY = {
    "add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_",
    "mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_",
}  # fmt: skip
_ELEMENTWISE_UNARY = {
    "gelu", "silu", "relu", "tanh", "sigmoid", "exp", "neg", "__neg__", "float", "to", "type_as", "dropout",
    "layer_norm", "rms_norm", "softplus", "square", "contiguous", "clone",
}  # fmt: skip
_PROPERTIES = {torch.Tensor.T: "T", torch.Tensor.mT: "mT"}  # a property's getter reaches the mode as __get__
_GETSET = type(torch.Tensor.T)


class Tracker(TorchFunctionMode):
    """Records the views and activation names of one check run in ``table`` and refuses what it cannot train."""

    def __init__(self, table: NameTable):
        super().__init__()
        self.table = table

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        frame = _user_frame()
        if frame is None:  # functitan's or torch's own op (a Layout call runs its collectives' plan itself)
            return func(*args, **kwargs)
        owner = getattr(func, "__self__", None)
        name = str((_PROPERTIES.get(owner) if isinstance(owner, _GETSET) else None) or getattr(func, "__name__", ""))
        if name == "scaled_dot_product_attention" and self.table.cp > 1:
            raise ValueError(
                f"parallelism.cp={self.table.cp}: {site(frame)} calls F.scaled_dot_product_attention itself, which "
                f"under context parallelism sees only this rank's chunks of the sequence; call "
                f"layout.attention(q, k, v) instead (or set parallelism.cp=1)"
            )
        uses = [(i, u) for i, a in enumerate(args) if (u := self.table.lookup(a)) is not None]
        if not uses:
            return self._activation(name, func, args, kwargs)
        if name in _CONTRACTIONS:
            self._raw_contraction(name, uses, frame)
        if name in _ELEMENTWISE_BINARY:
            return self._elementwise(name, func, args, kwargs, uses, frame)
        out = func(*args, **kwargs)
        i, use = uses[0]
        if i == 0:
            self._view(name, use, args, kwargs, out, frame)
        return out

    # -- a param or a view of one
    def _view(self, name: str, use: Use, args: tuple, kwargs: dict, out: Any, frame: FrameType) -> None:
        names = use.names
        if names is None:
            derived: Any = None
        elif name in _SAME:
            derived = names
        elif name in ("T", "t", "mT"):
            derived = tuple(reversed(names)) if name != "mT" else (*names[:-2], names[-1], names[-2])
        elif name in ("transpose", "swapaxes", "swapdims"):
            a, b = (_dim(d, len(names)) for d in (args[1:3] if len(args) >= 3 else (kwargs["dim0"], kwargs["dim1"])))
            lst = list(names)
            lst[a], lst[b] = lst[b], lst[a]
            derived = tuple(lst)
        elif name == "permute":
            dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            derived = tuple(names[_dim(d, len(names))] for d in dims)
        elif name in ("select", "unbind"):
            d = _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), len(names))
            self._refuse_cut(use, names[d], f"{name}(dim={d})", frame)
            derived = names[:d] + names[d + 1 :]
        elif name in ("chunk", "split", "tensor_split", "narrow"):
            d = _dim(kwargs.get("dim", args[2] if len(args) > 2 else 0), len(names))
            self._refuse_cut(use, names[d], f"{name}(dim={d})", frame)
            derived = names
        elif name == "__getitem__":
            derived = self._indexed(use, names, args[1], frame)
        else:
            derived = None  # reshape, view, flatten, ...: the dims have no names any more
        expr = f"{use.expr}.{name}" if name != "__getitem__" else f"{use.expr}[...]"
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.table.add_view(t, use._replace(names=derived, expr=expr))

    def _indexed(self, use: Use, names: tuple, index: Any, frame: FrameType) -> tuple | None:
        idx = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in idx):
            e = idx.index(Ellipsis)
            fill = len(names) - sum(1 for i in idx if i is not None and i is not Ellipsis)
            idx = idx[:e] + (slice(None),) * fill + idx[e + 1 :]
        out: list[str | None] = []
        d = 0
        for i in idx:
            if i is None:
                out.append(None)
                continue
            if d >= len(names):
                return None
            n = names[d]
            whole = isinstance(i, slice) and i == slice(None)
            if not whole:
                self._refuse_cut(use, n, f"{use.expr}[...]", frame)
            if isinstance(i, slice):
                out.append(n)
            elif isinstance(i, int) or (isinstance(i, Tensor) and i.dim() == 0):
                pass  # the dim is indexed away
            else:
                return None  # advanced indexing: leave the names unknown
            d += 1
        return (*out, *names[d:])

    def _refuse_cut(self, use: Use, dim: str | None, how: str, frame: FrameType) -> None:
        if dim is not None and dim == self.table.tp_sharded(use):
            raise ValueError(
                f"param {use.path!r} (names {list(use.declared)}) is cut along its dim {dim!r} by {how} at "
                f"{site(frame)}, and tp={self.table.tp} shards that dim: each tp rank holds a different piece "
                f"of it; declare the pieces as params of their own, or index another dim (e.g. a stack's leading dim)"
            )

    def _raw_contraction(self, name: str, uses: list, frame: FrameType) -> None:
        for _, use in uses:
            sharded = self.table.tp_sharded(use)
            if sharded is not None and (use.names is None or sharded in use.names):
                what = "F.embedding" if name == "embedding" else f"a raw {name.strip('_')}"
                fix = (
                    "look it up with layout.embed(tokens, table, num_rows)"
                    if name == "embedding"
                    else "contract it with layout.einsum('<input names>, "
                    + " ".join(n or "_" for n in use.names or use.declared)
                    + " -> <output names>', x, "
                    + use.expr
                    + ")"
                )
                raise ValueError(
                    f"param {use.path!r} (names {list(use.declared)}) is contracted by {what} at {site(frame)}, "
                    f"but tp={self.table.tp} shards its dim {sharded!r}: only a Layout contraction runs the "
                    f"collectives a sharded dim needs; {fix}"
                )

    # -- activations and the params added to them
    def _elementwise(self, name: str, func: Any, args: tuple, kwargs: dict, uses: list, frame: FrameType) -> Any:
        others = [a for i, a in enumerate(args) if i not in {j for j, _ in uses}]
        acts = [(a, n) for a in others if (n := self.table.activation_names(a)) is not None]
        for _, use in uses:
            if use.names is None or not acts or None in use.names:
                continue
            act, act_names = acts[0]
            tail = act_names[len(act_names) - len(use.names) :] if len(use.names) <= len(act_names) else None
            if tail is not None and tuple(use.names) != tuple(tail):
                raise ValueError(
                    f"param {use.path!r} (names {list(use.declared)}) at {site(frame)} is {_verb(name)} a tensor "
                    f"whose trailing dims are {list(tail)} (of {list(act_names)}): its dims {list(use.names)} "
                    f"broadcast over dims of other names, right only while no rank shards them; declare it with "
                    f"the names of the dims it is {_verb(name).split()[0]} to, Param({tuple(use.shape)}, "
                    f"{tuple(tail)})"
                )
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            use = uses[0][1]
            shapes = [tuple(a.shape) for a in args if isinstance(a, Tensor)]
            raise ValueError(
                f"param {use.path!r} (shape {use.shape}, names {list(use.declared)}) used as {use.expr} does not "
                f"broadcast at {site(frame)} with shapes {shapes} ({str(e).splitlines()[0]}); declare it with the "
                f"size and names of the dims it is {_verb(name).split()[0]} to"
            ) from None
        if acts and isinstance(out, Tensor) and out.shape == acts[0][0].shape:
            self.table.name_activation(out, acts[0][1])
        return out

    def _activation(self, name: str, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if (name in _ELEMENTWISE_BINARY or name in _ELEMENTWISE_UNARY) and isinstance(out, Tensor):
            for a in args:
                names = self.table.activation_names(a)
                if names is not None and a.shape == out.shape:
                    self.table.name_activation(out, names)
                    break
        return out


def _verb(name: str) -> str:
    return "multiplied onto" if "mul" in name else "divided into" if "div" in name else "added to"


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _user_frame() -> FrameType | None:
    """The model's frame that called this op, or None when the op runs inside functitan or torch."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_LIBRARY[0]) and "<" not in path[:1]:
            return None if path.startswith(_LIBRARY[1]) else frame
        frame = frame.f_back
    return None
