"""What a checkpoint looks like on disk: array names, the Orbax ``_METADATA``, zarr3 specs, shard boxes.

One checkpoint ("item") directory, readable by ``orbax.checkpoint`` as it is::

    <dir>/_METADATA              Orbax tree metadata (JSON): key paths, value types, format flags
    <dir>/_COMMIT                functitan's commit marker (JSON): every file's size; written last
    <dir>/<name>/zarr.json       one zarr3 array per leaf; <name> = the key path joined with "."
    <dir>/<name>/c/<i>/<j>       one file per writer's shard (zarr3 sharding codec, small inner chunks)

A leaf's zarr chunk grid is cut where the writers' shards meet, so no file is written by two processes;
inner chunks of at most ``INNER_CHUNK_BYTES`` keep a reader with another sharding from reading much more
than it needs. Every chunk carries a crc32c, which tensorstore checks on read.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import numpy as np
import optree
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..tree import keystr

METADATA = "_METADATA"
COMMIT = "_COMMIT"
FORMAT = "functitan.checkpoint/1"
INNER_CHUNK_BYTES = 4 << 20
TMP_MARK = ".tmp-"


# torch dtype <-> numpy dtype. bf16 and fp8 have no numpy dtype: ml_dtypes supplies them, and tensors are
# reinterpreted bit for bit through an unsigned int of the same width (never through float32). Built on first use:
# importing ml_dtypes costs about a second, which every process importing the trainer would pay otherwise.
@cache
def torch_to_np() -> dict[torch.dtype, np.dtype]:
    import ml_dtypes

    return {
        torch.float64: np.dtype(np.float64),
        torch.float32: np.dtype(np.float32),
        torch.float16: np.dtype(np.float16),
        torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
        torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
        torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
        torch.int64: np.dtype(np.int64),
        torch.int32: np.dtype(np.int32),
        torch.int16: np.dtype(np.int16),
        torch.int8: np.dtype(np.int8),
        torch.uint8: np.dtype(np.uint8),
        torch.bool: np.dtype(np.bool_),
        torch.complex64: np.dtype(np.complex64),
    }


@cache
def np_to_torch() -> dict[np.dtype, torch.dtype]:
    return {v: k for k, v in torch_to_np().items()}


_BITS_VIEW = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def np_dtype(dtype: torch.dtype, name: str) -> np.dtype:
    table = torch_to_np()
    if dtype not in table:
        raise TypeError(f"{name}: dtype {dtype} cannot be checkpointed; supported: {sorted(map(str, table))}")
    return table[dtype]


def torch_dtype(dtype: np.dtype, name: str, where: str) -> torch.dtype:
    table = np_to_torch()
    if np.dtype(dtype) not in table:
        raise ValueError(
            f"{name}: {where} stores dtype {np.dtype(dtype)}, which has no torch equivalent here; supported: "
            f"{sorted(str(d) for d in table)}"
        )
    return table[np.dtype(dtype)]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a CPU tensor (bf16/fp8 through their bits, never via float32)."""
    if t.dtype in _BITS_VIEW:
        return t.view(_BITS_VIEW[t.dtype]).numpy().view(torch_to_np()[t.dtype])
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """The inverse of ``as_numpy``: a CPU tensor sharing ``a``'s memory."""
    dt = np_to_torch()[a.dtype]
    if dt in _BITS_VIEW:
        bits = {1: np.uint8, 2: np.uint16}[a.dtype.itemsize]
        return torch.from_numpy(np.require(a, requirements="C").view(bits)).view(dt)
    return torch.from_numpy(np.require(a, requirements="C"))


# ------------------------------------------------------------------------------------------- names


def _key_metadata(acc: Any) -> tuple[dict, ...]:
    """Orbax's ``key_metadata`` of one accessor path (see ``named_leaves``)."""
    keys = []
    for entry in acc:
        if hasattr(entry, "field"):
            keys.append({"key": str(entry.field), "key_type": 2})
        elif isinstance(entry, optree.MappingEntry):
            k = str(entry.key)
            if "." in k or "/" in k or not k:
                raise ValueError(
                    f"{keystr(acc)}: the dict key {entry.key!r} contains '.' or '/' (or is empty); checkpoint "
                    f"array names join keys with '.', so rename the key (e.g. replace '.' with '_')"
                )
            keys.append({"key": k, "key_type": 2})
        elif isinstance(entry, optree.SequenceEntry):
            keys.append({"key": str(entry.index), "key_type": 1})
        else:
            raise TypeError(f"{keystr(acc)}: pytree node {type(entry).__name__} has no checkpoint key")
    return tuple(keys)


def named_leaves(tree: Any) -> tuple[list[tuple[str, tuple[dict, ...], Any]], optree.PyTreeSpec]:
    """``[(dotted_name, key_metadata, leaf)]`` and the treedef.

    ``key_metadata`` is Orbax's ``[{"key": "params", "key_type": 2}, ...]`` (2: a dict key or a NamedTuple
    field, 1: a sequence index). The dotted name is also the array's directory, so a dict key holding a
    "." or a "/" would be ambiguous and is rejected.
    """
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree)
    return [(keystr(acc), _key_metadata(acc), leaf) for acc, leaf in zip(accessors, leaves)], treedef


def _is_empty_node(x: Any) -> bool:
    return x is None or (isinstance(x, (tuple, list, dict)) and len(x) == 0)


def empty_value_type(x: Any) -> str:
    """The ``value_type`` orbax-checkpoint (0.12, default options) records for an empty node.

    An empty NamedTuple (optax's ``EmptyState()``) is recorded as "None": Orbax writes it so unless its
    experimental ``support_rich_types`` is on, and reads "NamedTuple" back as None anyway.
    """
    if isinstance(x, list):
        return "List"
    if isinstance(x, tuple):
        return "None" if hasattr(x, "_fields") else "Tuple"
    return "Dict" if isinstance(x, dict) else "None"


def empty_nodes(tree: Any) -> list[tuple[str, tuple[dict, ...], str]]:
    """``[(dotted_name, key_metadata, value_type)]`` of the tree's empty nodes (None, (), [], {}, an empty
    NamedTuple). They hold no array, but Orbax records each one (``skip_deserialize: true``) so that the
    indices of a sequence stay contiguous: without ``opt_state.1`` its reader cannot rebuild ``opt_state.2``.
    """
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree, is_leaf=_is_empty_node)
    return [
        (keystr(acc), _key_metadata(acc), empty_value_type(x))
        for acc, x in zip(accessors, leaves)
        if len(acc) and _is_empty_node(x)
    ]


def value_type(leaf: Any, name: str) -> str:
    """Orbax's ``value_type``: arrays restore as numpy arrays, Python/numpy scalars as Python scalars."""
    if isinstance(leaf, (torch.Tensor, np.ndarray)):
        return "np.ndarray"
    if isinstance(leaf, (bool, int, float, np.generic)):
        return "scalar"
    raise TypeError(
        f"{name}: a {type(leaf).__name__} leaf cannot be checkpointed; leaves are tensors, DTensors, numpy "
        f"arrays or Python/numpy scalars (pickle is never used)"
    )


def orbax_metadata(
    entries: list[tuple[str, tuple[dict, ...], str]], empty: Sequence[tuple[str, tuple[dict, ...], str]] = ()
) -> dict:
    """The Orbax ``_METADATA`` document for the arrays ``[(name, key_metadata, value_type)]`` and the
    empty nodes ``empty`` (same shape, from ``empty_nodes``), written as Orbax writes them."""
    tree = {}
    for entries_, skip in ((entries, False), (empty, True)):
        for _, keys, vtype in entries_:
            tree[str(tuple(k["key"] for k in keys))] = {
                "key_metadata": list(keys),
                "value_metadata": {"value_type": vtype, "skip_deserialize": skip},
            }
    return {
        "tree_metadata": tree,
        "use_ocdbt": False,
        "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": {"format": FORMAT},
    }


def names_in_metadata(meta: dict) -> dict[str, str]:
    """``{dotted_name: value_type}`` of the arrays an Orbax ``_METADATA`` document (ours or Orbax's) lists.

    Empty nodes (``skip_deserialize: true``: None, (), [], {}) hold no array and are left out; the
    exemplar's structure brings them back.
    """
    out = {}
    for entry in meta.get("tree_metadata", {}).values():
        value = entry.get("value_metadata", {})
        if value.get("skip_deserialize", False):
            continue
        name = ".".join(str(k["key"]) for k in entry["key_metadata"])
        out[name] = value.get("value_type", "np.ndarray")
    return out


# ------------------------------------------------------------------------------------------- shard boxes

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in global coordinates


@dataclass(frozen=True)
class Boxes:
    """Who holds which block of one leaf: per global rank, its (offset, shape), and who writes each block."""

    shape: tuple[int, ...]
    by_rank: dict[int, Box]
    writers: dict[Box, int]  # block -> lowest rank holding it (empty blocks left out)


def dtensor_boxes(x: DTensor, name: str) -> Boxes:
    mesh = x.device_mesh
    for pl in x.placements:
        if not isinstance(pl, (Shard, Replicate)):
            raise ValueError(
                f"{name}: placement {pl} cannot be checkpointed (only Shard and Replicate); "
                f"redistribute the value (e.g. reduce a Partial) before saving"
            )
    ranks, mesh_shape = _mesh_ranks(mesh)
    return _boxes(tuple(x.shape), mesh_shape, ranks, tuple(x.placements))


_MESH_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mesh_ranks(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mesh's global ranks (flattened) and shape, computed once per mesh: ``mesh.mesh`` rebuilds a
    tensor from the mesh's layout on every access (~3 ms under torch 2.13), once per leaf on a restore."""
    try:
        return _MESH_RANKS[mesh]
    except (KeyError, TypeError):
        pass
    out = (tuple(int(r) for r in mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape))
    try:
        _MESH_RANKS[mesh] = out
    except TypeError:  # not weak-referenceable: recompute next time
        pass
    return out


def full_boxes(shape: tuple[int, ...], ranks: tuple[int, ...]) -> Boxes:
    """A plain (replicated) value: every participating rank holds all of it; the lowest writes it."""
    box = ((0,) * len(shape), tuple(shape))
    writers = {box: min(ranks)} if math.prod(shape) > 0 or not shape else {}
    return Boxes(shape=tuple(shape), by_rank={r: box for r in ranks}, writers=writers)


@lru_cache(maxsize=4096)
def _boxes(shape, mesh_shape, ranks, placements) -> Boxes:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    by_rank: dict[int, Box] = {}
    writers: dict[Box, int] = {}
    for i, rank in enumerate(ranks):
        coord = list(np.unravel_index(i, mesh_shape)) if mesh_shape else []
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, [int(c) for c in coord], placements)
        box = (tuple(int(o) for o in offset), tuple(int(s) for s in local))
        by_rank[rank] = box
        if math.prod(box[1]) > 0 or not shape:
            writers[box] = min(writers.get(box, rank), rank)
    return Boxes(shape=tuple(shape), by_rank=by_rank, writers=writers)


def chunk_grid(boxes: Boxes) -> tuple[int, ...]:
    """The coarsest regular grid whose cells never straddle two writers' blocks.

    Along each dim the cell is the gcd of the blocks' inner boundaries (the array's own end does not count,
    since the last cell may be partial): FSDP on 2 ranks over 10 rows -> cells of 5; uneven 9 rows -> 5 and 4.
    """
    grid = []
    for d, extent in enumerate(boxes.shape):
        g = 0
        for off, shp in boxes.writers:
            for edge in (off[d], off[d] + shp[d]):
                if 0 < edge < extent:
                    g = math.gcd(g, edge)
        grid.append(g or max(extent, 1))
    return tuple(grid)


def inner_chunk(cell: tuple[int, ...], itemsize: int, target: int = INNER_CHUNK_BYTES) -> tuple[int, ...] | None:
    """An inner chunk shape dividing ``cell`` of at most ``target`` bytes (None: the cell is small enough).

    The largest dim is split (by its smallest prime factor) until the chunk fits, so chunks stay roughly
    square: a reader taking half the columns of a row-sharded matrix then reads ~1x, not 2x, its bytes.
    """
    if math.prod(cell) * itemsize <= target:
        return None
    out = list(cell)
    while math.prod(out) * itemsize > target:
        order = sorted(range(len(out)), key=lambda d: -out[d])
        for d in order:
            f = _smallest_factor(out[d])
            if f:
                out[d] //= f
                break
        else:  # every dim is 1 or prime-free: nothing left to split
            break
    return tuple(out)


def _smallest_factor(n: int) -> int:
    """The smallest prime factor of ``n`` (0 for n <= 1)."""
    if n <= 1:
        return 0
    for f in range(2, int(math.isqrt(n)) + 1):
        if n % f == 0:
            return f
    return n


def zarr3_metadata(shape: tuple[int, ...], dtype: np.dtype, cell: tuple[int, ...]) -> dict:
    """zarr.json for one leaf: a regular grid of ``cell`` (one file per cell), crc32c per (inner) chunk."""
    inner = inner_chunk(cell, dtype.itemsize)
    leaf_codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    if inner is None:
        codecs = leaf_codecs
    else:
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner),
                    "codecs": leaf_codecs,
                    "index_codecs": leaf_codecs,
                    "index_location": "end",
                },
            }
        ]
    return {
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(cell)}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": _fill(dtype),
        "codecs": codecs,
    }


def _fill(dtype: np.dtype) -> Any:
    if dtype.kind == "b":
        return False
    if dtype.kind == "c":
        return [0.0, 0.0]
    return 0 if dtype.kind in "iu" else 0.0


def array_spec(item_dir: str, name: str, meta: dict, *, metadata: dict | None = None) -> dict:
    """The tensorstore spec of leaf ``name`` under ``item_dir`` (Orbax's zarr2/zarr3, OCDBT or plain files)."""
    driver = "zarr3" if meta.get("use_zarr3", False) else "zarr"
    root = os.path.abspath(item_dir)
    if meta.get("use_ocdbt", False):
        kvstore = {"driver": "ocdbt", "base": f"file://{root}/", "path": f"{name}/"}
    else:
        kvstore = {"driver": "file", "path": f"{root}/{name}/"}
    spec: dict = {"driver": driver, "kvstore": kvstore}
    if metadata is not None:
        spec["metadata"] = metadata
    return spec
