"""The seam between the commit protocol (_save.py) and a checkpoint format (_orbax.py, _dcp.py): what a rank
writes of each leaf (``Leaf``, its ``Piece`` blocks) and the four methods a format implements (``Format``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import _layout as L

__all__ = ["Format", "Leaf", "Piece"]


@dataclass
class Piece:
    box: L.Box  # global (offset, shape) this rank writes
    local: tuple[slice, ...]  # the same block in this rank's local tensor
    staging: Any = None  # torch.Tensor or np.ndarray, allocated once, reused by every async save
    source: Any = None  # what this save writes: the staging buffer, or (synchronous save) the live value


@dataclass
class Leaf:
    """One leaf of the saved tree as this rank writes it: its name and Orbax key metadata, global shape and dtype,
    and the blocks (``pieces``) this rank is the writer of."""

    name: str
    keys: tuple[dict, ...]
    vtype: str
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Any  # what the format decided for this leaf (Orbax: its zarr.json), from ``Format.layout``
    pieces: list[Piece] = field(default_factory=list)
    writes_metadata: bool = False  # this rank writes the leaf's metadata (zarr.json): the lowest rank holding it


class Format(Protocol):
    """What a checkpoint format decides; the commit protocol (_save.py) does the rest, the same for every format.

    ``name`` is recorded in ``_COMMIT``. ``layout(boxes, dtype)`` is called once per leaf when the tree's
    structure is first seen (Orbax: the zarr.json, with chunks cut where writers meet). ``write(item, plan,
    rank, background=)`` writes this rank's pieces (``piece.source``, global ``piece.box``) under ``item``,
    fsynced, and returns ``({file: size}, part)``: ``part`` (JSON) is what ``finish`` needs from this rank.
    ``finish(item, plan, empty, parts)`` runs on the leader with every rank's part, writes the format's index
    and returns ``({file: size}, {array: shape})``. ``checksummed(rel)``: the files the marker keeps a crc32 of.
    """

    name: str

    def layout(self, boxes: L.Boxes, dtype: np.dtype) -> Any: ...

    def write(self, item: str, plan: list[Leaf], rank: int, *, background: bool = False) -> tuple[dict, Any]: ...

    def finish(self, item: str, plan: list[Leaf], empty: list, parts: list) -> tuple[dict, dict]: ...

    def checksummed(self, rel: str) -> bool: ...
