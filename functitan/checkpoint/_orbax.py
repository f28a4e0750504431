"""The Orbax format on the commit protocol: one zarr3 array per leaf plus Orbax's ``_METADATA`` (see _layout).

``orbax.checkpoint.PyTreeCheckpointer().restore(path)`` reads what this writes, and ``_restore`` reads what
Orbax writes. The protocol (staging, the private commit group, ``_COMMIT``, the rename) is ``_save``'s; this
module only decides each leaf's zarr.json and writes a rank's chunk files and the leader's ``_METADATA``.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import _fastwrite
from . import _layout as L
from ._files import fsync, lower_priority, write_json
from ._format import Leaf

__all__ = ["OrbaxFormat"]

_WRITE_THREADS = min(8, 2 * (os.cpu_count() or 1))


@dataclass(frozen=True)
class ZarrLeaf:
    meta: dict  # the leaf's zarr.json (a chunk grid cut where the writers' shards meet)
    fast: Any  # the _fastread.Spec when _fastwrite writes the chunk files (else tensorstore does)


def _chunk_keys(box: L.Box, grid: tuple[int, ...]) -> list[str]:
    if not box[1]:
        return ["c"]
    ranges = [range(o // g, -(-(o + s) // g)) for o, s, g in zip(box[0], box[1], grid)]
    keys: list[list[int]] = [[]]
    for r in ranges:
        keys = [k + [i] for k in keys for i in r]
    return ["c/" + "/".join(map(str, k)) for k in keys]


def _as_sequences(entries: list[list]) -> list[list]:
    """Mark dict levels keyed exactly "0".."n-1" over the union of all ranks' trees as sequences.

    A pipeline rank holds ``layers`` as a dict of its blocks' global indices, where the unpipelined model
    has a list; in the merged tree the keys are 0..n-1 again, and writing them as sequence indices (Orbax
    key_type 1) makes the checkpoint the same as one written without pipelining.
    """
    children: dict[tuple, set] = {}
    for _, keys, _, _ in entries:
        for i, k in enumerate(keys):
            children.setdefault(tuple(x["key"] for x in keys[:i]), set()).add((k["key"], k["key_type"]))
    seqs = {
        prefix
        for prefix, ks in children.items()
        if all(t == 2 and k.isdigit() for k, t in ks) and sorted(int(k) for k, _ in ks) == list(range(len(ks)))
    }
    out = []
    for name, keys, vtype, shape in entries:
        keys = [
            {"key": k["key"], "key_type": 1} if tuple(x["key"] for x in keys[:i]) in seqs else k
            for i, k in enumerate(keys)
        ]
        out.append([name, keys, vtype, shape])
    return out


class OrbaxFormat:
    """zarr3 arrays and Orbax's ``_METADATA``: what ``save`` writes unless told another format."""

    name = L.FORMAT

    def layout(self, boxes: L.Boxes, dtype: np.dtype) -> ZarrLeaf:
        meta = L.zarr3_metadata(boxes.shape, dtype, L.chunk_grid(boxes))
        return ZarrLeaf(meta=meta, fast=_fastwrite.writable(meta))

    def write(self, item: str, plan: list[Leaf], rank: int, *, background: bool = False) -> tuple[dict, list]:
        """Write this rank's pieces (and the zarr.json of the leaves it writes metadata for); return
        ``({file: size}, its leaves as _METADATA entries)``.

        Chunk files of the layout ``layout`` chooses are written by ``_fastwrite`` from the values' memory in
        ``_WRITE_THREADS`` threads; tensorstore writes each zarr.json (one rank per leaf) and any leaf
        ``_fastwrite`` cannot (a partial edge cell, complex values).
        """
        import tensorstore as ts  # here, not at import: it pulls in ml_dtypes (~1 s per process)

        ctx = ts.Context({"file_io_sync": False})
        opens: list[Any] = []
        writes: list[Any] = []  # tensorstore's write futures and the pool's
        written: list[str] = []
        synced: set[str] = set()  # chunk files their writer flushed already (see _fastwrite.write_block)
        # an asynchronous save's writers yield the CPU to the training loop (see lower_priority)
        initializer = lower_priority if background else None
        with ThreadPoolExecutor(_WRITE_THREADS, thread_name_prefix="functitan-save", initializer=initializer) as pool:
            scratch = threading.local()  # each writer thread's reused gather buffer
            for leaf in plan:
                zleaf: ZarrLeaf = leaf.layout
                spec = L.array_spec(item, leaf.name, {"use_zarr3": True}, metadata=zleaf.meta)
                spec["store_data_equal_to_fill_value"] = True  # every chunk is a file: sizes verify completeness
                leader = leaf.writes_metadata
                if not leaf.pieces and not leader:
                    continue
                grid = tuple(zleaf.meta["chunk_grid"]["configuration"]["chunk_shape"])
                if leader:
                    written.append(f"{leaf.name}/zarr.json")
                for p in leaf.pieces:
                    written += [f"{leaf.name}/{k}" for k in _chunk_keys(p.box, grid)]
                if zleaf.fast is not None:
                    # one rank creates zarr.json (in the background); the chunk files need no metadata I/O
                    if leader:
                        opens.append(ts.open(spec, create=True, context=ctx))
                    for p in leaf.pieces:
                        src = L.as_numpy(p.source) if isinstance(p.source, torch.Tensor) else p.source
                        args = (os.path.join(item, leaf.name), zleaf.fast, p.box[0], src, scratch)
                        writes.append(pool.submit(_fastwrite.write_block, *args, fsync=True))
                        synced.update(f"{leaf.name}/{k}" for k in _chunk_keys(p.box, grid))
                    continue
                # one rank creates zarr.json; the others assume it (no metadata I/O, no race)
                opened = (
                    ts.open(spec, create=True, context=ctx)
                    if leader
                    else ts.open(spec, open=True, assume_metadata=True, context=ctx)
                )
                arr = opened.result()
                for p in leaf.pieces:
                    src = L.as_numpy(p.source) if isinstance(p.source, torch.Tensor) else p.source
                    index = tuple(slice(o, o + s) for o, s in zip(*p.box))
                    writes.append(arr[index].write(src) if index else arr.write(src))
            for f in opens + writes:
                f.result()
        # the rest (zarr.json, tensorstore's chunks): concurrent fsyncs share journal commits, ~2x faster than
        # one after another on ext4
        paths = [os.path.join(item, rel) for rel in written]
        with ThreadPoolExecutor(16, initializer=initializer) as pool:
            list(pool.map(fsync, [p for rel, p in zip(written, paths) if rel not in synced]))
        sizes = {rel: os.path.getsize(full) for rel, full in zip(written, paths)}
        return sizes, [[leaf.name, list(leaf.keys), leaf.vtype, list(leaf.shape)] for leaf in plan]

    def finish(self, item: str, plan: list[Leaf], empty: list, parts: list[list]) -> tuple[dict, dict]:
        """On the leader: ``_METADATA`` over every rank's leaves (pipeline ranks hold different ones, first seen
        wins); returns ``({file: size}, {array: shape})``."""
        entries: dict[str, list] = {}
        for part in parts:
            for entry in part:
                entries.setdefault(entry[0], entry)
        merged = list(entries.values())
        empties = [[name, list(keys), vtype, None] for name, keys, vtype in empty]
        if len(merged) != len(plan):  # trees differ across ranks: write the whole tree's metadata
            both = _as_sequences(merged + empties)
            merged, empties = both[: len(merged)], both[len(merged) :]
        meta = L.orbax_metadata(
            [(n, tuple(k), v) for n, k, v, _ in merged], [(n, tuple(k), v) for n, k, v, _ in empties]
        )
        size = write_json(os.path.join(item, L.METADATA), meta)
        return {L.METADATA: size}, {name: shape for name, _, _, shape in merged}

    def checksummed(self, rel: str) -> bool:
        """crc32 of ``_METADATA`` and every ``zarr.json`` go in the marker: the chunks carry their own crc32c,
        and a same-size edit of a metadata file (a shape, a dtype) would otherwise pass the size check and be
        blamed on the model config."""
        return rel == L.METADATA or rel.endswith("/zarr.json") or rel == "zarr.json"
