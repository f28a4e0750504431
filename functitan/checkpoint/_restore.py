"""Restoring into an exemplar: each rank reads only its slice, so any writer mesh -> any reader mesh.

The exemplar is a tree of the checkpoint's structure whose leaves say what to build:

=====================  ======================================================================
exemplar leaf          restored as
=====================  ======================================================================
DTensor                a DTensor on the same mesh and placements; this rank reads its block only
torch.Tensor           the full value on the exemplar's device (a meta tensor: on the CPU)
numpy array            the full value as a numpy array
int / float / bool     a Python scalar of that type (numpy scalar: of that numpy type)
=====================  ======================================================================

Reads checkpoints written by ``save`` and by ``orbax.checkpoint`` (zarr2 or zarr3, with or without OCDBT).
"""

from __future__ import annotations

import json
import math
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _dtensor as _dt
from ..errors import UserError
from . import _fastread
from . import _layout as L

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["restore", "verify", "CheckpointError"]


class CheckpointError(UserError):
    """A checkpoint directory is incomplete, truncated or corrupted."""


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {os.path.dirname(path)} is not a complete checkpoint") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the checkpoint is corrupted") from None


def verify(path: str | os.PathLike) -> None:
    """Check that every file the commit marker lists exists with its recorded size.

    Truncation and missing files are caught here (a stat per file), and any change to ``_METADATA`` or a
    ``zarr.json`` by its crc32 in the marker; flipped bits in a chunk are caught on read by the crc32c each
    chunk carries. A checkpoint written by functitan without its ``_COMMIT`` is
    incomplete (an error); one written by Orbax has no ``_COMMIT`` (Orbax commits by its own rename) and
    passes with only its chunk checksums to protect it.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint directory")
    commit_path = os.path.join(path, L.COMMIT)
    meta_path = os.path.join(path, L.METADATA)
    if not os.path.exists(commit_path):
        if not os.path.exists(meta_path):
            raise CheckpointError(f"{path} has neither {L.COMMIT} nor {L.METADATA}: not a complete checkpoint")
        if (_read_json(meta_path).get("custom_metadata") or {}).get("format") == L.FORMAT:
            raise CheckpointError(
                f"{commit_path} is missing: {path} was written by functitan but never committed (or the marker "
                f"was lost in a copy), so its files cannot be checked; restore an older checkpoint"
            )
        return
    commit = _read_json(commit_path)
    for rel, size in commit.get("files", {}).items():
        full = os.path.join(path, rel)
        try:
            found = os.path.getsize(full)
        except FileNotFoundError:
            raise CheckpointError(
                f"{full} is missing (listed in {commit_path}): the checkpoint is incomplete"
            ) from None
        if found != size:
            raise CheckpointError(
                f"{full} has {found} bytes, the commit marker {commit_path} recorded {size}: the file is truncated "
                f"or corrupted; restore an older checkpoint"
            )
    for rel, crc in commit.get("checksums", {}).items():  # the metadata files (chunks check their own crc32c)
        full = os.path.join(path, rel)
        with open(full, "rb") as f:
            if zlib.crc32(f.read()) != crc:
                raise CheckpointError(
                    f"{full} does not match its checksum in {commit_path}: the file is corrupted; restore an "
                    "older checkpoint"
                )


def _with_prefix(exemplar: Any, only: str | None) -> list[tuple[str, Any]]:
    named, _ = L.named_leaves(exemplar)
    return [((f"{only}.{n}" if n else only) if only else n, x) for n, _, x in named]


def restore(
    path: str | os.PathLike,
    exemplar: Any,
    *,
    only: str | None = None,
    check: bool = True,
    in_place: bool = False,
    partial: bool = False,
) -> Any:
    """Read the checkpoint at ``path`` into a tree shaped like ``exemplar`` (see the module docstring).

    Args:
        path: an item directory written by ``save`` or by Orbax.
        exemplar: the target tree; its tensor leaves give shape, dtype, device, mesh and placements.
        only: restore just the subtree at this key path (e.g. ``"params"``); ``exemplar`` is that subtree.
        check: verify the files' sizes against the commit marker first.
        in_place: write the values into the exemplar's own CPU tensors (and return them) instead of new
            ones, as ``torch.distributed.checkpoint.load`` does: no allocation, no page faults (for a
            trainer restoring into the state it just built, whose memory is then reused). Leaves that
            cannot take it (meta, CUDA, non-contiguous; Orbax/OCDBT files) are built new as usual.
        partial: the exemplar may hold only some of the checkpoint's leaves (a pipeline rank's stages);
            the caller checks that the ranks together restore all of them (``CheckpointManager`` does).

    Raises:
        ValueError: a key missing from the checkpoint, one the exemplar lacks, a shape or dtype mismatch;
            the message names the key path and the file.
        CheckpointError: (a ValueError) the checkpoint is incomplete, truncated or corrupted.
    """
    path = os.path.abspath(os.fspath(path))
    if check:
        verify(path)
    meta_file = os.path.join(path, L.METADATA)
    meta = _read_json(meta_file)
    stored = L.names_in_metadata(meta)
    named = _with_prefix(exemplar, only)
    _check_keys(named, stored, meta_file, only, partial)
    with _ReaderPool(_read_threads()) as pool:
        out = _read_leaves(path, meta, named, pool, in_place)
    return optree.tree_unflatten(optree.tree_structure(exemplar), out)


class _ReaderPool(ThreadPoolExecutor):
    """The reader threads, and ``scratch``: each one's reused file buffer, freed with the pool."""

    def __init__(self, max_workers: int):
        super().__init__(max_workers=max_workers, thread_name_prefix="functitan-restore")
        self.scratch = threading.local()


def _read_leaves(path: str, meta: dict, named: list[tuple[str, Any]], pool: _ReaderPool, in_place: bool) -> list[Any]:
    """Every leaf's value: functitan's own chunk files read directly (in ``pool``), others by tensorstore."""
    import tensorstore as ts  # here, not at import: it pulls in ml_dtypes (~1 s per process)

    ctx = ts.Context()
    direct = meta.get("use_zarr3", False) and not meta.get("use_ocdbt", False)
    fast = [_fast_array(path, name, pool) if direct else None for name, _ in named]
    opened = [
        f or ts.open(L.array_spec(path, name, meta), open=True, read=True, context=ctx)
        for (name, _), f in zip(named, fast)
    ]
    futures = []
    for (name, x), fut in zip(named, opened):
        try:
            arr = fut if isinstance(fut, _FastArray) else fut.result()
        except ValueError as exc:  # unreadable or unknown metadata (e.g. a dtype tensorstore does not know)
            raise CheckpointError(f"{name}: cannot open the array {where_of(path, name)}: {_short(exc)}") from None
        futures.append(_start_read(name, x, arr, where_of(path, name), in_place))
    out = []
    for (name, _x), (fut, finish) in zip(named, futures):
        try:
            value = fut.result() if fut is not None else None
        except ValueError as exc:
            raise CheckpointError(
                f"{name}: reading {where_of(path, name)} failed: {_short(exc)}; the checkpoint is corrupted, "
                f"restore an older one"
            ) from None
        out.append(finish(value))
    return out


def _read_threads() -> int:
    """Reader threads for this process: its share of the cores, at most 16.

    A read from the page cache is a memory copy plus a crc32c, bound by cores and memory bandwidth, not by
    the disk: with 2 cores, one process restored 126 MB in 22 ms with 2 threads and 25 ms with 4; two ranks
    sharing those cores, 250 MB each, took 72-85 ms with one thread each and 80-95 ms with 4.
    ``LOCAL_WORLD_SIZE`` (set by torchrun) is how many ranks share this host.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(16, cores // local))


class _FastArray:
    """The part of a ``ts.TensorStore``'s API that ``_start_read`` uses, over ``_fastread.read_box``."""

    def __init__(
        self,
        path: str,
        spec: _fastread.Spec,
        pool: _ReaderPool,
        box: tuple[tuple[int, ...], tuple[int, ...]] | None = None,  # (offset, shape)
    ):
        self._path, self._spec, self._pool = path, spec, pool
        self.shape = spec.shape
        self.dtype = SimpleNamespace(numpy_dtype=spec.dtype)
        self._box = box or ((0,) * len(spec.shape), spec.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> _FastArray:
        box = (tuple(s.start for s in index), tuple(s.stop - s.start for s in index))
        return _FastArray(self._path, self._spec, self._pool, box)

    def read(self, out: np.ndarray | None = None):
        return self._pool.submit(_fastread.read_box, self._path, self._spec, *self._box, self._pool.scratch, out)


def _fast_array(path: str, name: str, pool: _ReaderPool) -> _FastArray | None:
    """A direct reader of leaf ``name`` when its zarr.json is one ``_fastread`` decodes, else None."""
    try:
        with open(os.path.join(path, name, "zarr.json")) as f:
            spec = _fastread.parse(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # tensorstore reports it
    return _FastArray(os.path.join(path, name), spec, pool) if spec is not None else None


def where_of(path: str, name: str) -> str:
    return f"{path}/{name}"


def _short(exc: BaseException, limit: int = 400) -> str:
    s = str(exc)
    return s if len(s) <= limit else s[:limit] + "..."


def _check_keys(
    named: list[tuple[str, Any]], stored: dict[str, str], meta_file: str, only: str | None, partial: bool = False
) -> None:
    wanted = [n for n, _ in named]
    missing = [n for n in wanted if n not in stored]
    if missing:
        raise ValueError(
            f"{missing[0]}: not in the checkpoint ({meta_file}); missing keys: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}. Fix: restore into an exemplar of the saved structure "
            f"(or pass only=<subtree>)"
        )
    scope = [n for n in stored if only is None or n == only or n.startswith(only + ".")]
    extra = sorted(set(scope) - set(wanted))
    if extra and not partial:
        raise ValueError(
            f"{extra[0]}: in the checkpoint ({meta_file}) but not in the exemplar; extra keys: {extra[:8]}"
            f"{' ...' if len(extra) > 8 else ''}. Fix: add them to the exemplar, or restore a subtree with only=..."
        )


def _start_read(name: str, x: Any, arr: ts.TensorStore | _FastArray, where: str, in_place: bool = False):
    """Start reading what this rank needs of one leaf; return (future, finish(np_value) -> leaf)."""
    shape = tuple(int(s) for s in arr.shape)
    np_dt = np.dtype(arr.dtype.numpy_dtype)
    if isinstance(x, torch.Tensor):
        if tuple(x.shape) != shape:
            raise ValueError(
                f"{name}: the checkpoint holds shape {shape} ({where}), the exemplar {tuple(x.shape)}; "
                f"fix the exemplar's shape (or the model config)"
            )
        dt = L.torch_dtype(np_dt, name, where)
        if dt != x.dtype:
            raise ValueError(
                f"{name}: the checkpoint holds {dt} ({where}), the exemplar {x.dtype}; make the exemplar's "
                f"dtype {dt} and cast after restoring"
            )
    if isinstance(x, DTensor):
        return _start_dtensor(x, arr, in_place)
    if isinstance(x, torch.Tensor):
        if in_place and isinstance(arr, _FastArray) and _writable(x, shape):
            return arr.read(out=L.as_numpy(x.detach())), lambda _: x
        device = torch.device("cpu") if x.device.type == "meta" else x.device
        grad = x.requires_grad
        read = arr.read(out=_fresh_out(shape, np_dt)) if isinstance(arr, _FastArray) else arr.read()
        return read, lambda a: L.from_numpy(a).to(device).requires_grad_(grad)
    if isinstance(x, np.ndarray):
        if x.shape != shape:
            raise ValueError(f"{name}: the checkpoint holds shape {shape} ({where}), the exemplar {x.shape}")
        return arr.read(), lambda a: np.asarray(a, dtype=x.dtype) if x.dtype != a.dtype else a
    if isinstance(x, (bool, int, float, np.generic)):
        if shape != ():
            raise ValueError(f"{name}: the exemplar is a scalar but the checkpoint holds shape {shape} ({where})")
        kind = type(x)
        return arr.read(), lambda a: kind(a.item()) if not isinstance(x, np.generic) else a[()].astype(x.dtype)
    raise TypeError(f"{name}: cannot restore into a {type(x).__name__} exemplar leaf")


def _writable(local: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether a direct read (a `_FastArray`'s) can fill ``local`` (the whole of a block of ``shape``) in place."""
    return (
        local.device.type == "cpu"
        and local.is_contiguous()
        and tuple(local.shape) == tuple(shape)
        and math.prod(shape) > 0
    )


def _start_dtensor(x: DTensor, arr: ts.TensorStore | _FastArray, in_place: bool = False):
    mesh = x.device_mesh
    boxes = L.dtensor_boxes(x, "exemplar")
    rank = dist.get_rank() if dist.is_initialized() else 0
    off, shp = boxes.by_rank.get(rank, ((0,) * x.ndim, (0,) * x.ndim))
    device = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )
    index = tuple(slice(o, o + s) for o, s in zip(off, shp))

    def finish(a: np.ndarray) -> torch.Tensor:  # a DTensor
        # the exemplar's spec (mesh, placements, global shape, stride, dtype) around the new shard
        local = L.from_numpy(a).to(device)
        grad = x.requires_grad and x.is_floating_point()
        if _dt.spec(x) is None:  # a DTensor subclass: the public constructor
            out = DTensor.from_local(local, mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
            return out.requires_grad_(grad)
        return _dt.wrap(local, _dt.spec(x), grad)

    if math.prod(shp) == 0:
        empty = np.empty(shp, dtype=np.dtype(arr.dtype.numpy_dtype))
        return None, lambda _: finish(empty)
    if in_place:
        local = x._local_tensor  # the same storage as x.to_local(), without autograd in between
        if isinstance(arr, _FastArray) and _writable(local, shp):
            return arr[index].read(out=L.as_numpy(local.detach())), lambda _: x
    if isinstance(arr, _FastArray):
        return arr[index].read(out=_fresh_out(shp, arr.dtype.numpy_dtype)), finish
    return (arr[index].read() if index else arr.read()), finish


def _fresh_out(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new array for a direct read to fill, allocated here (the caller's thread) by torch.

    Not ``np.empty`` in a reader thread: numpy asks for transparent huge pages (which can stall in memory
    compaction) and each reader thread's malloc arena keeps its own free memory, so a second restore
    page-faulted all of its memory again; torch's allocator in one thread behaves as a trainer's does.
    """
    return L.as_numpy(torch.empty(shape, dtype=L.np_to_torch()[np.dtype(dtype)]))
