"""Reading functitan's own zarr3 chunks straight from their files: one ``readinto`` per needed piece.

Tensorstore reads a chunk through its cache and codec chain (about 10x slower than the page cache on a
2-core host, see benchmarks/checkpoint_vs_dcp.py). The layout ``save`` writes is small enough to decode
here: a chunk file is either the cell's bytes (C order, little endian) followed by their crc32c, or a
zarr3 shard: inner chunks (bytes + crc32c each), then an index of ``(offset, nbytes)`` uint64 pairs per
inner chunk and the index's own crc32c. Every byte read is checked against its crc32c, as tensorstore
does. A chunk needed whole whose place in the output is contiguous (a row block) is read straight into
the output; others go through a reused per-thread buffer. A reader that needs most of a file otherwise
reads it whole; else only the index and the inner chunks that intersect its box, so resharded loads
read about what they keep.

``parse`` returns None for anything else (other codecs, OCDBT, big endian, a NaN fill value...), and the
caller falls back to tensorstore.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


def _load_crc32c() -> Callable[..., int] | None:
    try:  # hardware crc32c (SSE4.2 / ARMv8), releases the GIL on large buffers
        from crc32c import crc32c
    except ImportError:  # pragma: no cover - without it, restores go through tensorstore
        return None
    return crc32c


_crc32c = _load_crc32c()

__all__ = ["Spec", "parse", "read_box"]


@functools.cache
def _np_dtypes() -> dict[str, np.dtype]:
    """zarr data_type names numpy spells otherwise (ml_dtypes is imported on first use: it costs about 1 s)."""
    import ml_dtypes

    return {
        "bool": np.dtype(np.bool_),
        "bfloat16": np.dtype(ml_dtypes.bfloat16),
        "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
        "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    }


_LEAF = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_MISSING = 2**64 - 1  # an inner chunk never written: its (offset, nbytes) in the shard index


@dataclass(frozen=True)
class Spec:
    """What ``read_box`` needs of one array's zarr.json."""

    shape: tuple[int, ...]
    dtype: np.dtype
    cell: tuple[int, ...]  # the chunk grid: one file per cell
    inner: tuple[int, ...] | None  # inner chunk shape of a shard file, None for a plain chunk file
    fill: Any


def _leaf_codecs(codecs: Any) -> bool:
    if not isinstance(codecs, list) or len(codecs) != 2 or codecs[1] != {"name": "crc32c"}:
        return False
    first = codecs[0]
    return first.get("name") == "bytes" and first.get("configuration", {}).get("endian", "little") == "little"


def parse(zmeta: dict) -> Spec | None:
    """The spec of a zarr.json that ``read_box`` can read, or None (read it with tensorstore)."""
    if (
        _crc32c is None
        or sys.byteorder != "little"
        or zmeta.get("zarr_format") != 3
        or zmeta.get("node_type", "array") != "array"
    ):
        return None
    grid, keys = zmeta.get("chunk_grid", {}), zmeta.get("chunk_key_encoding", {})
    if grid.get("name") != "regular" or keys.get("name") != "default":
        return None
    if keys.get("configuration", {}).get("separator", "/") != "/":
        return None
    try:
        dtype = _np_dtypes().get(zmeta["data_type"]) or np.dtype(zmeta["data_type"])
    except TypeError:
        return None
    fill = zmeta.get("fill_value", 0)
    if dtype.kind == "c" or not isinstance(fill, (bool, int, float)):
        return None
    codecs, inner = zmeta.get("codecs"), None
    if isinstance(codecs, list) and len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
        conf = codecs[0].get("configuration", {})
        if not (_leaf_codecs(conf.get("codecs")) and _leaf_codecs(conf.get("index_codecs"))):
            return None
        if conf.get("index_location", "end") != "end":
            return None
        inner = tuple(int(s) for s in conf["chunk_shape"])
    elif not _leaf_codecs(codecs):
        return None
    shape = tuple(int(s) for s in zmeta["shape"])
    cell = tuple(int(s) for s in grid["configuration"]["chunk_shape"])
    if len(cell) != len(shape) or (inner is not None and any(c % i for c, i in zip(cell, inner))):
        return None
    return Spec(shape=shape, dtype=dtype, cell=cell, inner=inner, fill=fill)


def crc32c(data: Any, value: int = 0) -> int:
    """The crc32c of ``data`` (continuing from ``value``). Reached only through a `Spec`, which `parse` gives only
    when the crc32c package is installed."""
    if _crc32c is None:
        raise RuntimeError("checkpoint fast path used without the crc32c package (parse should have returned None)")
    return _crc32c(data, value)


def _check(data: memoryview, where: str) -> memoryview:
    """``data`` without its trailing crc32c, after checking it."""
    if len(data) < 4:
        raise ValueError(f"Digest mismatch: {where} holds {len(data)} bytes, too few for a crc32c (truncated)")
    body, stored = data[:-4], int.from_bytes(data[-4:], "little")
    if crc32c(body) != stored:
        raise ValueError(f"Digest mismatch: the crc32c of {where} does not match its content")
    return body


def _overlap(a_off, a_shp, b_off, b_shp):
    """The intersection of two boxes as (offset, shape), or None."""
    lo = [max(a, b) for a, b in zip(a_off, b_off)]
    hi = [min(a + s, b + t) for a, s, b, t in zip(a_off, a_shp, b_off, b_shp)]
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - low for low, h in zip(lo, hi))


def _put(out, out_off, src_off, block: np.ndarray, ov) -> None:
    """Copy the part ``ov`` (global box) of ``block`` (at global ``src_off``) into ``out`` (at ``out_off``)."""
    o, s = ov
    dst = tuple(slice(a - b, a - b + n) for a, b, n in zip(o, out_off, s))
    src = tuple(slice(a - b, a - b + n) for a, b, n in zip(o, src_off, s))
    out[dst] = block[src]


def _buffer(scratch: Any, n: int) -> memoryview:
    """``n`` bytes of this thread's reused buffer (page-faulting fresh memory costs more than the read)."""
    if scratch is None:
        return np.empty(n, np.uint8).data  # not bytearray(n): that zero-fills first
    buf = getattr(scratch, "buf", None)
    if buf is None or len(buf) < n:
        buf = scratch.buf = np.empty(max(n, 2 * len(buf) if buf is not None else n), np.uint8)
    return buf.data[:n]


def _pread(fd: int, offset: int, n: int, where: str, scratch: Any = None) -> memoryview:
    view = _buffer(scratch, n)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k == 0:
            raise ValueError(f"Digest mismatch: {where} ends after {got} of {n} bytes (truncated)")
        got += k
    return view


def _dest(out: np.ndarray, out_off, c_off, shape, part) -> np.ndarray | None:
    """The view of ``out`` a whole chunk (at global ``c_off``, of ``shape``) lands in, when the chunk is
    needed whole and that view is contiguous: then the file is read straight into it, with no copy."""
    if part[0] != tuple(c_off) or part[1] != tuple(shape):
        return None
    view = out[tuple(slice(a - b, a - b + n) for a, b, n in zip(c_off, out_off, shape))]
    return view if view.flags.c_contiguous and view.flags.writeable else None


_PIECE = 1 << 20  # read and checksum a chunk 1 MiB at a time: the crc32c then reads from cache, not memory


def _pread_into(fd: int, offset: int, dst: np.ndarray, where: str) -> None:
    """Read a chunk (``dst.nbytes`` bytes and their crc32c) at ``offset`` straight into ``dst``; check it.

    Piece by piece, each checksummed right after it lands: on an 84 MB chunk in the page cache 17.6 ms
    against 20.0 ms for one read and one checksum over the whole (which reads the chunk from memory twice)."""
    view, crc = dst.reshape(-1).view(np.uint8).data, bytearray(4)
    n, got, digest = len(view), 0, 0
    while got < n + 4:
        piece = view[got : got + _PIECE] if got < n else memoryview(crc)[got - n :]
        k = os.preadv(fd, [piece], offset + got)
        if k == 0:
            raise ValueError(f"Digest mismatch: {where} ends after {got} of {n + 4} bytes (truncated)")
        if got < n:
            digest = crc32c(piece[:k], digest)
        got += k
    if digest != int.from_bytes(crc, "little"):
        raise ValueError(f"Digest mismatch: the crc32c of {where} does not match its content")


def read_box(
    path: str,
    spec: Spec,
    off: tuple[int, ...],
    shp: tuple[int, ...],
    scratch: Any = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The block ``[off, off + shp)`` of the array stored under the directory ``path``.

    ``scratch``: a ``threading.local()`` whose per-thread buffer is reused for file contents (None: a
    fresh buffer per file). ``out``: an array of shape ``shp`` to fill (default: a new one).

    Raises:
        ValueError: a crc32c mismatch or a truncated file (the message says which file).
    """
    out = np.empty(shp, spec.dtype) if out is None else out
    if math.prod(shp) == 0:
        return out
    ranges = [range(o // c, -(-(o + s) // c)) for o, s, c in zip(off, shp, spec.cell)]
    for cidx in itertools.product(*ranges):
        c_off = tuple(i * c for i, c in zip(cidx, spec.cell))
        ov = _overlap(off, shp, c_off, spec.cell)
        file = os.path.join(path, "c", *map(str, cidx)) if cidx else os.path.join(path, "c")
        try:
            fd = os.open(file, os.O_RDONLY)
        except FileNotFoundError:  # never written: the fill value
            _put(out, off, c_off, np.full(spec.cell, spec.fill, spec.dtype), ov)
            continue
        try:
            if spec.inner is None:
                dst = _dest(out, off, c_off, spec.cell, ov)
                if dst is not None:
                    _pread_into(fd, 0, dst, file)
                    continue
                size = math.prod(spec.cell) * spec.dtype.itemsize + 4
                body = _check(_pread(fd, 0, size, file, scratch), file)
                _put(out, off, c_off, np.frombuffer(body, spec.dtype).reshape(spec.cell), ov)
            else:
                _read_shard(fd, file, spec, spec.inner, c_off, ov, out, off, scratch)
        finally:
            os.close(fd)
    return out


def _read_shard(
    fd: int, file: str, spec: Spec, inner: tuple[int, ...], c_off, ov, out: np.ndarray, off, scratch: Any
) -> None:
    """Read the part ``ov`` of the shard file ``fd`` (at global ``c_off``; ``inner`` is ``spec.inner``) into ``out``."""
    counts = tuple(c // i for c, i in zip(spec.cell, inner))
    n_inner = math.prod(counts)
    size = os.fstat(fd).st_size
    index_bytes = 16 * n_inner + 4
    if size < index_bytes:
        raise ValueError(f"Digest mismatch: {file} has {size} bytes, fewer than its shard index (truncated)")
    # the inner chunks this box needs
    lo = [(a - c) // i for a, c, i in zip(ov[0], c_off, inner)]
    hi = [-(-(a + s - c) // i) for a, s, c, i in zip(ov[0], ov[1], c_off, inner)]
    wanted = list(itertools.product(*(range(a, b) for a, b in zip(lo, hi))))
    i_offs = [tuple(c + k * i for c, k, i in zip(c_off, j, inner)) for j in wanted]
    parts = [_overlap(ov[0], ov[1], i_off, inner) for i_off in i_offs]
    dests = [_dest(out, off, i_off, inner, part) for i_off, part in zip(i_offs, parts)]
    # most of the file, not all of it readable in place: one read into the buffer
    whole = 4 * len(wanted) >= 3 * n_inner and any(d is None for d in dests)
    data = _pread(fd, 0, size, file, scratch) if whole else None
    index_view = data[size - index_bytes :] if data is not None else _pread(fd, size - index_bytes, index_bytes, file)
    index = np.frombuffer(_check(index_view, f"{file} (shard index)"), "<u8").reshape(*counts, 2)
    chunk_bytes = math.prod(inner) * spec.dtype.itemsize
    for j, i_off, part, dst in zip(wanted, i_offs, parts, dests):
        start, n = (int(v) for v in index[j])
        if start == _MISSING and n == _MISSING:
            _put(out, off, i_off, np.full(inner, spec.fill, spec.dtype), part)
            continue
        if n != chunk_bytes + 4 or start + n > size - index_bytes:
            raise ValueError(f"Digest mismatch: {file} inner chunk {j} has a bad index entry ({start}, {n})")
        if dst is not None and not whole:
            _pread_into(fd, start, dst, f"{file} inner chunk {j}")
            continue
        raw = data[start : start + n] if data is not None else _pread(fd, start, n, file, scratch)
        body = _check(raw, f"{file} inner chunk {j}")
        _put(out, off, i_off, np.frombuffer(body, spec.dtype).reshape(inner), part)
