"""Check mode for ``Layout``: every use of a parameter against its declared names.

A model says what a parameter's dims are called twice: once in its declaration (``Param(shape, names)``) and
again in each ``layout.einsum`` pattern that uses it. The pattern's names decide the tensor-parallel
collectives, so a pattern that calls ``mlp`` "hidden" silently computes the wrong thing under TP. Instead of
trusting the patterns, ``functitan.model.check_names`` runs the model once on meta tensors with a Layout that
carries this table, and every call compares its pattern with the declaration. ``functitan._usage`` follows the
params through the model's own torch ops (a slice ``w[e]``, ``stack[i]``, ``w.T``), so a view is checked with
the names its dims keep, and refuses what no Layout call sees: a raw contraction of a tp-sharded dim, a slice
of one, and a bias added to a dim of another name.
"""

from __future__ import annotations

from types import FrameType
from typing import Any, NamedTuple

from torch import Tensor

from ._rules import Rules, default_rules, logical_to_mesh_axes
from ._tp import parse_einsum

__all__ = ["NameTable", "Use", "site"]


class Use(NamedTuple):
    """What check mode knows of a parameter or a view of one."""

    path: str  # the param's dotted key path
    declared: tuple[str, ...]  # its declared names
    shape: tuple[int, ...]  # its declared shape
    names: tuple[str | None, ...] | None  # this view's dims (None: unknown, e.g. after a reshape)
    expr: str  # how the model took it: "w", "w[...]", "w.T"


class NameTable:
    """``{id(param tensor): (dotted key path, declared names, declared shape)}`` for one check run, and the views
    and activation names found while it runs.

    ``tp`` and ``rules``: the layout the check is for; a tp-sharded dim is one the rules map to ``tp`` while
    ``tp > 1`` (with tp = 1 only the names are compared). Built and used by ``functitan.model.check_names``; the
    param tensors must stay alive while it is used (views and activations are kept alive by the table)."""

    def __init__(
        self,
        entries: dict[int, tuple[str, tuple[str, ...], tuple[int, ...]]],
        *,
        tp: int = 1,
        rules: Rules | None = None,
        cp: int = 1,
        cp_attention: str = "allgather",
    ):
        self._entries = {i: Use(path, tuple(n), tuple(s), tuple(n), path) for i, (path, n, s) in entries.items()}
        self._views: dict[int, tuple[Use, Tensor]] = {}
        self._acts: dict[int, tuple[tuple[str, ...], Tensor]] = {}
        self.tp, self.cp, self.cp_attention = tp, cp, cp_attention
        self.rules = rules if rules is not None else default_rules()
        self.sequence_parallel = tp > 1 and any(n == "seq" and _has_tp(a) for n, a in self.rules)
        self.seen: set[str] = set()  # key paths of the params some contraction used (for the report)

    def attention(self, q: Tensor, k: Tensor) -> None:
        """``layout.attention`` of ``q (batch, heads, seq, d)`` and ``k (batch, kv_heads, seq, d)``, whole heads:
        Ulysses turns the sequence split into a head split over tp x cp, so both counts must divide by it."""
        n = self.tp * self.cp
        if self.cp > 1 and self.cp_attention == "ulysses" and (q.shape[1] % n or k.shape[1] % n):
            tp = f"tp={self.tp} x " if self.tp > 1 else ""
            raise ValueError(
                f"parallelism.cp_attention=ulysses splits attention's heads over {tp}cp={self.cp} = {n} ranks, but "
                f"the model has {q.shape[1]} heads and {k.shape[1]} kv heads; set parallelism.cp_attention=allgather "
                f"or ring, or a cp whose product with tp divides both"
            )

    # -- what the tracker records
    def lookup(self, t: Any) -> Use | None:
        if not isinstance(t, Tensor):
            return None
        hit = self._entries.get(id(t))
        if hit is not None:
            return hit
        view = self._views.get(id(t))
        return view[0] if view is not None and view[1] is t else None

    def add_view(self, t: Tensor, use: Use) -> None:
        self._views[id(t)] = (use, t)

    def name_activation(self, t: Any, names: tuple[str, ...]) -> None:
        if isinstance(t, Tensor) and len(names) == t.dim():
            self._acts[id(t)] = (tuple(names), t)

    def activation_names(self, t: Any) -> tuple[str, ...] | None:
        hit = self._acts.get(id(t)) if isinstance(t, Tensor) else None
        return hit[0] if hit is not None and hit[1] is t else None

    def tp_sharded(self, use: Use) -> str | None:
        """The declared name of ``use``'s param that the rules shard over tp (None when tp = 1 or none is)."""
        if self.tp <= 1:
            return None
        axes = logical_to_mesh_axes(use.declared, self.rules)
        return next((n for n, a in zip(use.declared, axes) if "tp" in a), None)

    # -- the Layout's calls
    def check_einsum(self, pattern: str, w: Any, frame: FrameType) -> None:
        use = self.lookup(w)
        if use is None:
            return  # not a parameter (an activation contracted with an activation)
        self.seen.add(use.path)
        inputs = parse_einsum(pattern, len(pattern.split("->")[0].split(",")))[0]
        used = inputs[-1]
        if use.names is None:
            if self.tp_sharded(use) is not None:
                raise ValueError(
                    f"param {use.path!r} (names {list(use.declared)}) is contracted at {site(frame)} as {use.expr}, "
                    f"a reshaped view whose dims have no names, while tp={self.tp} shards its dim "
                    f"{self.tp_sharded(use)!r}; contract the param itself (or an index or slice of it) with its "
                    f"declared names"
                )
            return
        if tuple(used) != tuple(use.names):
            what = "" if use.expr == use.path else f" and used as {use.expr}, whose dims are {list(use.names)},"
            raise ValueError(
                f"param {use.path!r} is declared with names {list(use.declared)}{what} but the contraction at "
                f"{site(frame)} calls its dims {list(used)} ({pattern!r}); use the declared names in the pattern "
                f"(they decide the tensor-parallel collectives)"
            )
        sharded = self.tp_sharded(use)
        out = tuple(pattern.split("->")[1].split())
        if self.sequence_parallel and len(inputs) == 2 and sharded in out and sharded not in inputs[0]:
            if "seq" not in inputs[0]:
                raise ValueError(
                    f"param {use.path!r} (names {list(use.declared)}) is contracted column-parallel at {site(frame)} "
                    f"({pattern!r}) with an input without a 'seq' dim: under sequence parallelism (tp={self.tp}) "
                    f"each rank holds its own piece of the sequence, which this contraction would not gather (a "
                    f"token-indexed or capacity-dispatched MoE); keep the token dim named 'seq' in the input (e.g. "
                    f"dispatch after the contraction), or set parallelism.sequence_parallel=false"
                )

    def check_rows(self, table: Any, num_rows: int, frame: FrameType) -> None:
        use = self.lookup(table)
        if use is None:
            return
        self.seen.add(use.path)
        shape = use.shape if use.expr == use.path else tuple(table.shape)  # a view: its own rows (stack[i])
        if len(shape) != 2 or shape[0] != num_rows:
            raise ValueError(
                f"param {use.path!r} (shape {shape}, names {list(use.declared)}) is looked up at {site(frame)} as "
                f"{use.expr}, a table of {num_rows} rows; pass the table's row count (its shape[0] = {shape[0]})"
            )


def _has_tp(axes: Any) -> bool:
    return axes == "tp" or (isinstance(axes, tuple) and "tp" in axes)


def site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
