"""Check mode for ``Layout``: every contraction's names against the parameter's declared names.

A model says what a parameter's dims are called twice: once in its declaration (``Param(shape, names)``) and
again in each ``layout.einsum`` pattern that uses it. The pattern's names decide the tensor-parallel
collectives, so a pattern that calls ``mlp`` "hidden" silently computes the wrong thing under TP. Instead of
trusting the patterns, ``functitan.model.check_names`` runs the model once on meta tensors with a Layout that
carries this table, and every call compares its pattern with the declaration.
"""

from __future__ import annotations

from types import FrameType
from typing import Any

from torch import Tensor

from ._tp import parse_einsum

__all__ = ["NameTable"]


class NameTable:
    """``{id(param tensor): (dotted key path, declared names, declared shape)}`` for one check run.

    Built and used by ``functitan.model.check_names``; the tensors must stay alive while it is used."""

    def __init__(self, entries: dict[int, tuple[str, tuple[str, ...], tuple[int, ...]]]):
        self._entries = dict(entries)
        self.seen: set[str] = set()  # key paths of the params some contraction used (for the report)

    def _lookup(self, t: Tensor) -> tuple[str, tuple[str, ...], tuple[int, ...]] | None:
        return self._entries.get(id(t))

    def check_einsum(self, pattern: str, w: Any, frame: FrameType) -> None:
        hit = self._lookup(w)
        if hit is None:
            return  # not a parameter (an activation contracted with an activation)
        path, names, _ = hit
        self.seen.add(path)
        used = parse_einsum(pattern, len(pattern.split("->")[0].split(",")))[0][-1]
        if tuple(used) != tuple(names):
            raise ValueError(
                f"param {path!r} is declared with names {list(names)} but the contraction at {_site(frame)} calls its "
                f"dims {list(used)} ({pattern!r}); use the declared names in the pattern (they decide the "
                f"tensor-parallel collectives)"
            )

    def check_rows(self, table: Any, num_rows: int, frame: FrameType) -> None:
        hit = self._lookup(table)
        if hit is None:
            return
        path, names, shape = hit
        self.seen.add(path)
        if len(shape) != 2 or shape[0] != num_rows:
            raise ValueError(
                f"param {path!r} (shape {shape}, names {list(names)}) is looked up at {_site(frame)} as a table of "
                f"{num_rows} rows; pass the table's declared row count (its shape[0] = {shape[0]})"
            )


def _site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
