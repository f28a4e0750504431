"""Saving: stage into reused host buffers, return, write shards in a background thread, commit atomically.

The caller is blocked only while this rank's shards are copied into staging buffers (pinned on CUDA,
allocated on the first save and reused by every later one). The background write reads only the staging
buffers, never the live tensors: mutating a parameter right after ``save`` returns cannot reach the file.
With ``defer_staging`` even that copy runs in the background thread, and the caller fences its in-place
updates on ``staged()``: the trainer's donated step waits there just before its optimizer update, so the
copy overlaps the step's forward and backward.

This module is the format-free part: which rank writes which block of each leaf, staging, the private
commit group, the marker and the rename. What the files look like is a ``Format``'s: ``OrbaxFormat``
(_orbax.py, the default: zarr3 arrays and Orbax's ``_METADATA``) or ``DcpFormat`` (_dcp.py: torch DCP's
``.metadata`` and ``__<rank>_0.distcp``, what torchtitan writes). A format is a class of four methods; a new
one is a module beside these two.

Commit protocol (a crash at any moment leaves the old set of checkpoints or the new one, never a mix):

1. every rank writes its shards under ``<dir>.tmp-<uuid>`` (``Format.write``: Orbax also writes the
   ``zarr.json`` of each leaf whose lowest holder it is), fsyncs its files and writes their sizes and what the
   format's index needs (its leaves, its chunks' offsets) to ``_sizes.<rank>``;
2. barrier; rank 0 writes the format's index (``Format.finish``: ``_METADATA`` or ``.metadata``, over every
   rank's leaves: pipeline ranks hold different ones) and ``_COMMIT`` (all files with their sizes), fsyncs, renames ``<dir>.tmp-<uuid>`` to ``<dir>`` and fsyncs
   the parent directory (re-saving a damaged step: the damaged ``<dir>`` is first renamed to
   ``<dir>.tmp-deleting-<uuid>``, removed after the commit);
3. barrier, so that ``wait()`` returns on every rank only once the checkpoint is visible.

A rank that dies mid-save fails the commit collectives on the others: their ``wait()`` returns if the commit
marker is visible (the step was committed before it died), else raises one ``CheckpointError`` line.

The barriers run on a private gloo group, so they never interleave with the training's collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import math
import os
import shutil
import threading
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from functitan import _dtensor as _dt

from . import _layout as L
from ._files import fsync, write_json
from ._format import Format, Leaf, Piece
from ._orbax import OrbaxFormat
from ._restore import CheckpointError

__all__ = ["SaveHandle", "Checkpointer", "Format", "save", "save_sync"]


class SaveHandle:
    """A save in flight. ``staged()`` blocks until the live values may change; ``wait()`` until the checkpoint
    is committed on every rank."""

    def __init__(self, path: str, thread: threading.Thread | None, on_done=None) -> None:
        self.path = path
        self._thread = thread
        self._error: BaseException | None = None
        self._on_done = on_done
        self._staged = threading.Event()  # set once the staging buffers hold every value (or staging failed)
        self._staged.set()  # staged before ``save`` returns, unless it defers staging
        self._stage_error: BaseException | None = None
        self._events: list = []  # a deferred CUDA staging's completion event
        self.nbytes = 0  # what this rank writes (its shards' bytes): the space a disk-full error asks for
        self.marker = os.path.join(path, L.COMMIT)  # the commit marker (under the item, when the save has one)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def staged(self) -> None:
        """Block until this rank's values are copied into the staging buffers (the fence before the saved
        tensors may change in place); re-raise a staging failure. Immediate unless the save deferred staging."""
        self._staged.wait()
        if self._stage_error is not None:
            raise RuntimeError(f"staging checkpoint {self.path} failed: {self._stage_error}") from self._stage_error
        for ev in self._events:  # CUDA: the caller's later kernels wait for the copies (no host sync)
            ev.wait()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed; re-raise a background failure; return the checkpoint directory."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint {self.path} not committed after {timeout}s")
        if self._on_done is not None:
            cb, self._on_done = self._on_done, None
            cb()
        if self._error is not None:
            if isinstance(self._error, _PeerLost):
                if os.path.isfile(self.marker):  # committed before the peer left: the save is done
                    return self.path
                raise CheckpointError(
                    f"saving checkpoint {self.path} did not complete: {self._error}; the committed checkpoints "
                    f"are untouched: run the same command to resume from the newest (an elastic run restarts "
                    f"from it by itself)"
                ) from None
            if _disk_full(self._error):  # the bytes of every rank's shards when the ranks agreed on the failure
                raise _no_space(self.path, getattr(self._error, "need", self.nbytes)) from None
            raise RuntimeError(f"saving checkpoint {self.path} failed: {self._error}") from self._error
        return self.path


class _PeerLost(RuntimeError):
    """A commit barrier failed: a rank of the save died, or missed the commit timeout."""


@contextlib.contextmanager
def _among_peers() -> Iterator[None]:
    """Around a commit collective (the shared token, the barriers): a failure there means a peer is gone."""
    try:
        yield
    except RuntimeError as exc:  # gloo: "Connection closed by peer ...", a reset, or the timeout
        raise _PeerLost(f"a rank left during the save (gloo: {str(exc).split('. ')[0]})") from exc


def _disk_full(exc: BaseException) -> bool:
    """A write that failed for want of space (ENOSPC / EDQUOT), whether an OSError or tensorstore's message."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc)


def _no_space(path: str, nbytes: int) -> CheckpointError:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = f"{shutil.disk_usage(folder).free / 1e6:.0f} MB free"
    except OSError:
        free = "free space unknown"
    return CheckpointError(
        f"saving checkpoint {path}: no space left on the device of {folder} ({free}; this save writes about "
        f"{nbytes / 1e6:.0f} MB); the committed steps are untouched: free space (or lower "
        f"checkpoint.keep_last, or point checkpoint.folder at a larger disk) and run the same command to resume"
    )


class _PeerFailed(OSError):
    """Raised on every rank of a save when one rank's part failed: a full disk (``errno`` ENOSPC, ``need``: the
    bytes of the whole save) or another rank's error, so no rank waits out the commit barrier's timeout."""

    def __init__(self, code: int, message: str, need: int = 0) -> None:
        super().__init__(code, message)
        self.need = need


def _nbytes(plan: list[Leaf]) -> int:
    """What this rank's shards of ``plan`` take on disk, about (no compression)."""
    return sum(math.prod(p.box[1]) * leaf.dtype.itemsize for leaf in plan for p in leaf.pieces)


# ----------------------------------------------------------------------------------------------- plan


def _signature(named: list, treedef: Any) -> tuple:
    sig: list[tuple] = []
    for name, _, x in named:
        if isinstance(x, DTensor):
            sig.append((name, "dt", tuple(x.shape), x.dtype, tuple(x.placements), id(x.device_mesh), x.device.type))
        elif isinstance(x, torch.Tensor):
            sig.append((name, "t", tuple(x.shape), x.dtype, x.device.type))
        elif isinstance(x, np.ndarray):
            sig.append((name, "np", x.shape, x.dtype))
        else:
            sig.append((name, "s", type(x), np.asarray(x).dtype if isinstance(x, np.generic) else None))
    return (treedef, tuple(sig))


def _scalar_array(x: Any, name: str) -> np.ndarray:
    if isinstance(x, bool):
        return np.asarray(x, np.bool_)
    if isinstance(x, int):
        if not -(2**63) <= x < 2**63:
            raise ValueError(f"{name}: the int {x} does not fit in int64; split it into smaller ints before saving")
        return np.asarray(x, np.int64)
    if isinstance(x, float):
        return np.asarray(x, np.float64)
    return np.asarray(x)


def _plan(named: list, rank: int, ranks: tuple[int, ...], fmt: Format) -> list[Leaf]:
    leaves = []
    for name, keys, x in named:
        vtype = L.value_type(x, name)
        if isinstance(x, DTensor):
            dtype = L.np_dtype(x.dtype, name)
            boxes = L.dtensor_boxes(x, name)
            mine = boxes.by_rank.get(rank)
            my_off = mine[0] if mine else ()  # holding nothing, this rank writes no piece of it
        elif isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                raise ValueError(f"{name}: a meta tensor has no values to save; materialise it first")
            dtype = L.np_dtype(x.dtype, name)
            boxes = L.full_boxes(tuple(x.shape), ranks)
            my_off = (0,) * x.ndim
        else:
            a = x if isinstance(x, np.ndarray) else _scalar_array(x, name)
            dtype = a.dtype
            if dtype not in L.np_to_torch():
                raise TypeError(
                    f"{name}: numpy dtype {dtype} cannot be checkpointed; supported: {sorted(map(str, L.np_to_torch()))}"
                )
            boxes = L.full_boxes(tuple(a.shape), ranks)
            my_off = (0,) * a.ndim
        item = Leaf(
            name=name,
            keys=keys,
            vtype=vtype,
            shape=boxes.shape,
            dtype=dtype,
            layout=fmt.layout(boxes, dtype),
            writes_metadata=rank == min(boxes.by_rank, default=rank),
        )
        for box, writer in boxes.writers.items():
            if writer == rank:
                local = tuple(slice(o - m, o - m + s) for o, m, s in zip(box[0], my_off, box[1]))
                item.pieces.append(Piece(box=box, local=local))
        leaves.append(item)
    return leaves


# ----------------------------------------------------------------------------------------------- staging


def _local_tensor(x: Any) -> Any:
    return _dt.local(x) if isinstance(x, torch.Tensor) else x  # no DTensor dispatch while staging


@torch.no_grad()
def _stage(plan: list[Leaf], named: list, *, copy: bool = True) -> list[torch.cuda.Event]:
    """Copy this rank's pieces into the staging buffers (allocating them on first use).

    ``copy=False`` (a synchronous save) points the pieces at the live CPU values instead: the caller
    blocks until the write is done, so nothing can change them meanwhile.
    """
    events = []
    cuda_seen = False
    for leaf, (_, _, x) in zip(plan, named):
        src = _local_tensor(x)
        for p in leaf.pieces:
            if (
                not copy
                and isinstance(src, (torch.Tensor, np.ndarray))
                and not (isinstance(src, torch.Tensor) and src.is_cuda)
            ):
                p.source = (
                    src[p.local].contiguous() if isinstance(src, torch.Tensor) else np.ascontiguousarray(src[p.local])
                )
            elif isinstance(src, torch.Tensor):
                if p.staging is None:
                    p.staging = torch.empty(p.box[1], dtype=src.dtype, pin_memory=src.is_cuda)
                p.staging.copy_(src[p.local], non_blocking=src.is_cuda)
                p.source = p.staging
                cuda_seen |= src.is_cuda
            elif isinstance(src, np.ndarray):
                if p.staging is None:
                    p.staging = np.empty(p.box[1], src.dtype)
                np.copyto(p.staging, src[p.local])
                p.source = p.staging
            else:
                p.source = _scalar_array(src, leaf.name)
    if cuda_seen:
        ev = torch.cuda.Event()
        ev.record()
        events.append(ev)
    return events


def _side_stream(named: list) -> tuple[torch.cuda.Stream, torch.cuda.Event] | None:
    """For a tree with CUDA tensors: a side stream for the deferred staging copies, and an event on the
    caller's stream that they wait for (the kernels that computed the values). The copies then overlap the
    caller's next kernels; ``SaveHandle.staged`` makes the caller's stream wait for them (a GPU-side fence)."""
    for _, _, x in named:
        if isinstance(x, torch.Tensor) and x.is_cuda:
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(x.device))
            return torch.cuda.Stream(x.device), start
    return None


class _Group:
    """The processes taking part in a save, with a private gloo group for the commit barriers."""

    def __init__(self, mesh: DeviceMesh | None, timeout_s: float) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.ranks: tuple[int, ...] = (0,)
        self.pg: Any = None
        if not self.distributed:
            self.rank = 0
            return
        self.rank = dist.get_rank()
        if mesh is None:
            self.ranks = tuple(range(dist.get_world_size()))
        else:
            self.ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
        # every process calls new_group (a collective over the world), members or not
        self.pg = dist.new_group(list(self.ranks), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def leader(self) -> bool:
        return self.rank == self.ranks[0]

    def barrier(self) -> None:
        if self.pg is not None:
            dist.barrier(group=self.pg)

    def agree(self, error: BaseException | None, nbytes: int) -> int:
        """The barrier that also tells every rank how each one's part went: the sum of the ranks' ``nbytes``
        when none failed; else raises on every rank, the same disk-full error when any rank's disk was full (a
        peer of a full rank used to wait at the barrier, then fail naming no path)."""
        if self.pg is None:
            if error is not None:
                raise error
            return nbytes
        mine = None if error is None else (_disk_full(error), f"{type(error).__name__}: {error}")
        outcomes: list[Any] = [None] * len(self.ranks)
        with _among_peers():
            dist.all_gather_object(outcomes, (mine, nbytes), group=self.pg)
        total = sum(n for _, n in outcomes)
        failed = [(rank, out) for rank, (out, _) in zip(self.ranks, outcomes) if out is not None]
        if not failed:
            return total
        full = [rank for rank, (disk_full, _) in failed if disk_full]
        if full:
            raise _PeerFailed(errno.ENOSPC, f"No space left on device (rank {full[0]})", total) from error
        if error is not None:
            raise error
        rank, (_, message) = failed[0]
        raise _PeerFailed(errno.EIO, f"rank {rank}: {message}") from None

    def shared_token(self) -> str:
        """A fresh uuid, the same on every rank (rank 0's, broadcast as 16 bytes)."""
        token = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8).clone()
        if self.pg is not None:
            with _among_peers():
                dist.broadcast(token, src=self.ranks[0], group=self.pg)
        return bytes(token.tolist()).hex()[:12]


def _move_aside(path: str) -> str:
    """Rename ``path`` to a ``.tmp-deleting-`` name (a crash then never leaves it half deleted under its own
    name; the manager removes such leftovers when it starts) and return the new name."""
    doomed = f"{path}{L.TMP_MARK}deleting-{uuid.uuid4().hex[:8]}"
    os.rename(path, doomed)
    return doomed


def _commit(
    final: str,
    item_rel: str,
    plan: list[Leaf],
    empty: list,
    group: _Group,
    fmt: Format,
    events: list,
    after_commit=None,
    replace: bool = False,
    *,
    background: bool = False,
) -> None:
    for ev in events:
        ev.synchronize()
    tmp = f"{final}{L.TMP_MARK}{group.shared_token()}"
    item = os.path.join(tmp, item_rel) if item_rel else tmp
    error: BaseException | None = None
    try:
        os.makedirs(item, exist_ok=True)
        sizes, part = fmt.write(item, plan, group.rank, background=background)
        write_json(os.path.join(item, f"_sizes.{group.rank}"), {"files": sizes, "part": part})
    except Exception as exc:  # noqa: BLE001 - every rank learns of it at the barrier
        error = exc
    need = group.agree(error, _nbytes(plan))
    try:
        if group.leader:
            _commit_as_leader(final, item, tmp, plan, empty, group, fmt, after_commit, replace)
    except Exception as exc:  # noqa: BLE001 - as above
        error = exc
    group.agree(error, need if group.leader else 0)
    for leaf in plan:  # drop references to live values (synchronous saves) until the next save
        for p in leaf.pieces:
            p.source = None


def _commit_as_leader(
    final: str,
    item: str,
    tmp: str,
    plan: list[Leaf],
    empty: list,
    group: _Group,
    fmt: Format,
    after_commit,
    replace: bool,
) -> None:
    """Merge every rank's sizes, let the format write its index (``_METADATA``), write ``_COMMIT``, then rename
    ``tmp`` to ``final``."""
    files: dict[str, int] = {}
    parts = []
    for r in group.ranks:
        part = os.path.join(item, f"_sizes.{r}")
        with open(part) as f:
            doc = json.load(f)
        files.update(doc["files"])
        parts.append(doc["part"])
        os.remove(part)
    index, arrays = fmt.finish(item, plan, empty, parts)
    files.update(index)
    commit = {"format": fmt.name, "files": files, "arrays": arrays}
    commit["checksums"] = _checksums(item, [rel for rel in files if fmt.checksummed(rel)])
    write_json(os.path.join(item, L.COMMIT), commit)
    fsync(item, directory=True)
    if item != tmp:
        fsync(tmp, directory=True)
    doomed = _move_aside(final) if replace and os.path.exists(final) else None
    os.rename(tmp, final)
    fsync(os.path.dirname(os.path.abspath(final)), directory=True)
    if doomed is not None:
        shutil.rmtree(doomed, ignore_errors=True)
    if after_commit is not None:
        after_commit()


def _checksums(item: str, files: list[str]) -> dict[str, int]:
    """crc32 of the files the format asks to protect (its metadata: a same-size edit passes the size check)."""
    out = {}
    for rel in files:
        with open(os.path.join(item, rel), "rb") as f:
            out[rel] = zlib.crc32(f.read())
    return out


# ----------------------------------------------------------------------------------------------- API


class Checkpointer:
    """Asynchronous, sharded saves that reuse their staging buffers; at most one save in flight.

    Args:
        mesh: the mesh whose ranks take part (default: every rank of the default process group). Plain
            tensors and scalars are taken as identical on those ranks and written by the lowest one.
        timeout_s: how long the commit barrier waits for a slow or dead rank.
        format: what the files look like (default ``OrbaxFormat()``; ``DcpFormat()`` writes torch DCP).

    Every rank must call ``save`` with the same path and a tree of the same structure. Call ``close()``
    (or ``wait()``) before destroying the process group.
    """

    def __init__(
        self,
        *,
        mesh: DeviceMesh | None = None,
        timeout_s: float = 1800.0,
        group: _Group | None = None,
        format: Format | None = None,
    ) -> None:
        self._mesh = mesh
        self._format: Format = format or OrbaxFormat()
        self._timeout_s = timeout_s
        self._group = group
        self._owns_group = group is None
        self._plan: list[Leaf] | None = None
        self._empty: list = []  # the tree's empty nodes (Orbax records them in _METADATA)
        self._plan_sig: tuple | None = None
        self._pending: SaveHandle | None = None

    def save(
        self,
        path: str | os.PathLike,
        tree: Any,
        *,
        _item: str = "",
        after_commit=None,
        defer_staging: bool = False,
        _stage_copy: bool = True,
        _replace: bool = False,
    ) -> SaveHandle:
        """Stage ``tree`` and start writing it to ``path``; returns once the live values may change.

        ``defer_staging``: return at once and copy into the staging buffers in the background thread too;
        the caller then calls ``handle.staged()`` (or ``self.staged()``) before it changes any saved tensor in
        place: a training step that donates its state passes it as ``before_update``, so the copy overlaps
        the step's forward and backward. Reading the values meanwhile is fine; replacing them with new
        tensors (a functional step) needs no fence. ``after_commit()`` runs in the background thread on the
        leader once the checkpoint is visible (the manager's retention); the other ranks' ``wait()`` returns
        after it. ``_replace``: ``path`` may exist (the manager re-saving a damaged step) and is replaced at
        commit.
        """
        self.wait()
        path = os.fspath(path)
        if os.path.exists(path) and not _replace:
            raise ValueError(f"checkpoint directory {path} already exists; choose a new path or delete it first")
        if self._group is None:
            self._group = _Group(self._mesh, self._timeout_s)
        named, treedef = L.named_leaves(tree)
        sig = _signature(named, treedef)
        plan = self._plan if sig == self._plan_sig else None
        if plan is None:  # a tree of another signature (or the first save): plan its writes once
            plan = self._plan = _plan(named, self._group.rank, self._group.ranks, self._format)
            self._empty = L.empty_nodes(tree)
            self._plan_sig = sig
        empty, group, fmt = self._empty, self._group, self._format
        defer = defer_staging and _stage_copy  # a synchronous save copies nothing
        events = [] if defer else _stage(plan, named, copy=_stage_copy)
        side = _side_stream(named) if defer else None
        handle = SaveHandle(path, None)
        handle.marker = os.path.join(path, _item, L.COMMIT)
        handle.nbytes = _nbytes(plan)
        if defer:
            handle._staged.clear()
            handle._events = events

        def run() -> None:
            if defer:
                try:
                    if side is None:
                        events.extend(_stage(plan, named))
                    else:
                        with torch.cuda.stream(side[0]):
                            side[0].wait_event(side[1])
                            events.extend(_stage(plan, named))  # recorded on the side stream
                except BaseException as exc:  # noqa: BLE001 - re-raised by staged() and wait()
                    handle._stage_error = handle._error = exc
                    return
                finally:
                    handle._staged.set()
            try:
                _commit(path, _item, plan, empty, group, fmt, events, after_commit, _replace, background=_stage_copy)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                handle._error = exc

        # not a daemon: an interpreter exiting mid-save finishes the write first
        handle._thread = threading.Thread(target=run, name=f"functitan-checkpoint:{os.path.basename(path)}")
        handle._thread.start()
        self._pending = handle
        return handle

    def save_sync(self, path: str | os.PathLike, tree: Any) -> str:
        """Save and block until committed, writing the live values directly (no staging copy)."""
        return self.save(path, tree, _stage_copy=False).wait()

    def busy(self) -> bool:
        """Whether a save is still in flight (not yet committed)."""
        return self._pending is not None and not self._pending.done()

    def staged(self) -> None:
        """Block until the save in flight (if any) has staged its values: the fence before they change in place."""
        if self._pending is not None:
            self._pending.staged()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def close(self) -> None:
        """Wait for the save in flight, free the staging buffers and the commit group."""
        try:
            self.wait()
        finally:
            self._plan = None
            self._plan_sig = None
            group = self._group
            if self._owns_group:
                self._group = None
            if self._owns_group and group is not None and group.pg is not None and group.rank in group.ranks:
                dist.destroy_process_group(group.pg)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def save(path: str | os.PathLike, tree: Any, *, mesh: DeviceMesh | None = None) -> SaveHandle:
    """Save ``tree`` to the directory ``path`` asynchronously; ``handle.wait()`` blocks until committed.

    A one-off save: its staging buffers are freed once committed. A training loop should keep one
    ``Checkpointer`` (or a ``CheckpointManager``), whose buffers are reused by every save.

    Args:
        path: the checkpoint directory to create (it must not exist). It is an Orbax item directory:
            ``orbax.checkpoint.PyTreeCheckpointer().restore(path)`` reads it in a JAX process.
        tree: any pytree of tensors, DTensors, numpy arrays and Python/numpy scalars.
        mesh: the mesh whose ranks take part (default: all ranks).
    """
    ck = Checkpointer(mesh=mesh)
    handle = ck.save(path, tree)
    handle._on_done = ck.close
    return handle


def save_sync(path: str | os.PathLike, tree: Any, *, mesh: DeviceMesh | None = None) -> str:
    """Save and block until committed (no staging copy: the live values are written directly).

    A one-off, like ``save``: it sets up (and tears down) a commit group; ``Checkpointer.save_sync`` reuses one.
    """
    ck = Checkpointer(mesh=mesh)
    try:
        return ck.save(path, tree, _stage_copy=False).wait()
    finally:
        ck.close()
