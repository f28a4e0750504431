"""Differentiable collectives on local tensors: the explicit-communication path (as in FSDP2 and Megatron).

Each op is an autograd.Function whose backward is the dual collective. Two reductions occur:

- ``"mean"`` over data-parallel ranks: each rank's loss is the mean over its own batch slice, so the gradient
  of the global mean loss is the mean of the per-rank gradients (FSDP's reduce-scatter, DDP's all-reduce).
- ``"sum"`` over tensor-parallel ranks: they share one batch and one loss, and each holds a part of a sum
  (Megatron's f/g operators, sequence parallel's all-gather/reduce-scatter pairs).

| op                | forward                          | backward                          |
|-------------------|----------------------------------|-----------------------------------|
| all_gather        | all-gather along ``dim``         | reduce-scatter (mean or sum)      |
| reduce_scatter    | reduce-scatter (sum) along dim   | all-gather                        |
| all_reduce        | all-reduce (sum)                 | identity                          |
| grad_all_reduce   | identity                         | all-reduce (mean or sum)          |

Uneven shards follow DTensor's ``Shard`` split (torch.chunk sizes), padded for the collective.
"""

from __future__ import annotations

import contextvars
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

# True while a parameter all-gather runs. Selective remat's policy (functitan._remat) recomputes
# these ops in backward instead of saving the gathered params, so a checkpointed block also reshards after
# forward. (Without remat, reshard-after-forward uses saved-tensor hooks instead: _fsdp._Regather.)
GATHERING: contextvars.ContextVar[bool] = contextvars.ContextVar("functitan_gathering", default=False)
# The backend whose buffers a traced step allocates (functitan.plan on the fake process group): "gloo" makes the
# reduce-scatter take its point-to-point path's memory (the receive buffer) without sending anything; None: the
# group's own backend.
TRACED_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("functitan_traced_backend", default=None)

__all__ = [
    "all_gather",
    "bucket_all_gather",
    "start_bucket_gather",
    "PendingGather",
    "PendingReduce",
    "reduce_scatter_now",
    "all_gather_now",
    "await_reduce",
    "reduce_scatter",
    "all_reduce",
    "grad_all_reduce",
    "chunk",
    "chunk_sizes",
]


def _gathering() -> contextvars.Token[bool] | None:
    # dynamo cannot trace a ContextVar; a compiled step has no remat policy to tell
    return None if torch.compiler.is_compiling() else GATHERING.set(True)


def chunk_sizes(full: int, n: int) -> list[int]:
    """Sizes of ``torch.chunk(range(full), n)`` padded with zeros to ``n`` entries (DTensor's Shard split)."""
    return [chunk(full, n, i)[1] for i in range(n)]


def chunk(full: int, n: int, i: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``i`` of ``chunk_sizes(full, n)``, in O(1) (FSDP 8192 asks per leaf)."""
    c = -(-full // n) if full else 0
    start = min(i * c, full)
    return start, max(0, min(c, full - start))


def _pad_to(x: Tensor, size: int) -> Tensor:
    if x.shape[0] == size:
        return x
    return torch.cat([x, x.new_zeros((size - x.shape[0], *x.shape[1:]))])


def all_gather_now(out: Tensor, x: Tensor, group: dist.ProcessGroup) -> None:
    """``dist.all_gather_single(out, x, group)`` (``out`` contiguous: every rank's ``x`` in rank order).

    On gloo by point-to-point, as ``PendingReduce`` reduce-scatters, so that ``x`` is freed when the caller
    drops it. Gloo runs a collective on a worker thread that releases its tensors only after ``wait()`` has
    returned: a temporary handed to it (a contiguous copy of an SP shard) then lived on for a few ops or not,
    and a real step's per-rank peak moved by 16-48 KiB between runs of the same code (tests/test_plan.py, TP +
    SP layouts: up to 1.55% of a small model's peak). Under ``torch.compile`` the collective dynamo traces."""
    if dist.get_backend(group) != "gloo" or torch.compiler.is_compiling():
        dist.all_gather_single(out, x, group=group)
        return
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks, flat = out.view(n, -1), x.reshape(-1)
    chunks[me].copy_(flat)
    peers = [p for p in range(n) if p != me]
    ops = [dist.P2POp(dist.isend, flat, group=group, group_peer=p) for p in peers]
    ops += [dist.P2POp(dist.irecv, chunks[p], group=group, group_peer=p) for p in peers]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _moved(x: Tensor, src: int, dst: int) -> Tensor:
    """``x.movedim(src, dst)``, without an op when they are equal. The gathers skip every no-op they can: each op
    is host time in a real step, and ~0.2 ms of fake dispatch in each of the planner's traces (a quarter of an
    FSDP trace's ops were such no-ops and pads of nothing)."""
    return x.movedim(src, dst) if src != dst else x


def _rows(x: Tensor, n: int) -> Tensor:
    """``x[:n]``, without an op when ``x`` has ``n`` rows."""
    return x[:n] if n < x.shape[0] else x


def _gather(x: Tensor, dim: int, full: int, group: dist.ProcessGroup) -> Tensor:
    n = dist.get_world_size(group)
    c = -(-full // n)
    moved = _pad_to(_moved(x, dim, 0), c).contiguous()
    out = moved.new_empty((c * n, *moved.shape[1:]))
    all_gather_now(out, moved, group)
    return _moved(_rows(out, full), 0, dim)


def _scatter(g: Tensor, dim: int, group: dist.ProcessGroup, scale: float) -> Tensor:
    n = dist.get_world_size(group)
    full = g.shape[dim]
    c = -(-full // n)
    moved = _pad_to(_moved(g, dim, 0), c * n)
    moved = (moved * scale if scale != 1.0 else moved).contiguous()
    out = moved.new_empty((c, *moved.shape[1:]))
    reduce_scatter_now(out, moved, group)
    mine = _rows(out, chunk(full, n, dist.get_rank(group))[1])
    return _moved(mine, 0, dim)


def _scale(reduce: str, group: dist.ProcessGroup) -> float:
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce={reduce!r}: choose 'mean' or 'sum'")
    return 1.0 / dist.get_world_size(group) if reduce == "mean" else 1.0


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, full, group, reduce, compute_dtype, reduce_dtype):
        ctx.dim, ctx.group, ctx.scale, ctx.reduce_dtype = dim, group, _scale(reduce, group), reduce_dtype
        token = _gathering()
        try:
            if compute_dtype is not None:  # mixed precision: cast the shard, then gather (half the bytes)
                x = x.to(compute_dtype)
            return _gather(x, dim, full, group)
        finally:
            if token is not None:
                GATHERING.reset(token)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_dtype is not None:
            g = g.to(ctx.reduce_dtype)
        return _scatter(g, ctx.dim, ctx.group, ctx.scale), None, None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.full = dim, group, x.shape[dim]
        return _scatter(x, dim, group, 1.0)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.full, ctx.group), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce, reduce_dtype):
        ctx.group, ctx.scale, ctx.reduce_dtype = group, _scale(reduce, group), reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.to(ctx.reduce_dtype) if ctx.reduce_dtype is not None else g.clone()
        if ctx.scale != 1.0:
            g = g * ctx.scale
        dist.all_reduce(g, group=ctx.group)
        return g, None, None, None


def all_gather(
    x: Tensor,
    dim: int,
    full: int,
    group: dist.ProcessGroup,
    *,
    reduce: str = "mean",
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> Tensor:
    """Gather shards along ``dim`` into size ``full``; backward reduce-scatters (``reduce``: mean or sum).

    With ``compute_dtype`` the shard is cast before the gather; with ``reduce_dtype`` the gradient is
    reduced in that dtype (fp32 gradients for bf16 params) and returned in it.
    """
    return _AllGather.apply(x, dim, full, group, reduce, compute_dtype, reduce_dtype)


def reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Sum partial values over ``group`` and keep this rank's chunk along ``dim``; backward all-gathers."""
    return _ReduceScatter.apply(x, dim, group)


def all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum partial values over ``group`` (Megatron's g); backward is the identity."""
    return _AllReduce.apply(x, group)


def grad_all_reduce(
    x: Tensor, group: dist.ProcessGroup, *, reduce: str = "mean", reduce_dtype: torch.dtype | None = None
) -> Tensor:
    """Identity forward; backward all-reduces the gradient (DDP for ``mean``, Megatron's f for ``sum``)."""
    return _GradAllReduce.apply(x, group, reduce, reduce_dtype)


class PendingGather(NamedTuple):
    """A bucketed all-gather started ahead of use (FSDP prefetch): wait on ``work`` before reading ``out``."""

    out: Tensor  # (world * numel,) the gathered buckets
    flat: Tensor  # this rank's packed bucket (kept alive until the collective finished)
    layout: list  # per shard: (chunk rows, trailing shape)
    work: Any  # the async collective's handle


def _pack(shards, dims, fulls, n: int, compute_dtype) -> tuple[Tensor, list]:
    """This rank's shards in one flat buffer, each padded to ``c = ceil(full / n)`` rows along its ``dim``
    (moved first), written in one pass: one ``_foreach_copy_`` folds the casts and moves of every shard, and only
    a padded shard zeroes its tail."""
    moved = [_moved(x, dim, 0) for x, dim in zip(shards, dims)]
    layout = [(-(-full // n), tuple(m.shape[1:])) for m, full in zip(moved, fulls)]
    dtype = compute_dtype or _common_dtype(shards)
    sizes = [c * math.prod(rest) for c, rest in layout]
    flat = torch.empty(sum(sizes), dtype=dtype, device=shards[0].device)
    dsts = []
    for piece, m, (c, rest) in zip(flat.split(sizes), moved, layout):
        dst = piece.view(c, *rest)
        if m.shape[0] < c:
            dst[m.shape[0] :].zero_()
            dst = dst[: m.shape[0]]
        dsts.append(dst)
    torch._foreach_copy_(dsts, moved)
    return flat, layout


def _common_dtype(tensors) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def start_bucket_gather(shards, dims, fulls, group: dist.ProcessGroup, *, compute_dtype=None) -> PendingGather:
    """Start ``bucket_all_gather``'s collective now, asynchronously; pass the result as ``pending`` later."""
    with torch.no_grad():
        flat, layout = _pack(shards, dims, fulls, dist.get_world_size(group), compute_dtype)
        out = flat.new_empty(dist.get_world_size(group) * flat.numel())
        work = dist.all_gather_single(out, flat, group=group, async_op=True)
    return PendingGather(out, flat, layout, work)


class PendingReduce:
    """A bucket's backward reduce-scatter in flight (FSDP2's async reduce-scatter, depth one).

    ``_BucketGather``'s backward starts the collective and returns views of its output without waiting;
    ``await_reduce``'s node, which sits between the shards and the bucket, waits before any op reads them.
    Made one block earlier (``FSDP.prefetch``), that node comes after the previous block's backward in
    autograd's order (later-made nodes run first), so the reduce-scatter overlaps that block's backward and at
    most one is in flight: it is waited on before the next bucket's starts."""

    __slots__ = ("work", "flat", "out", "recv", "mine", "behind")

    def __init__(self) -> None:
        self.work: Any = None
        self.flat: Tensor | None = None  # the collective's input, alive until it finished
        self.out: Tensor | None = None
        self.recv: Tensor | None = None  # gloo: (world - 1, chunk) the other ranks' copies of this rank's chunk
        self.mine: Tensor | None = None  # gloo: this rank's own copy of its chunk
        self.behind: PendingReduce | None = None  # waited on before this one starts (the bucket in flight)

    def start(self, out: Tensor, flat: Tensor, group: dist.ProcessGroup, *, async_op: bool = True) -> None:
        """``out`` (contiguous) = this rank's chunk of ``flat`` (split along dim 0) summed over ``group``.

        On gloo by point-to-point: each rank sends every other rank that rank's chunk and, when waited on, adds
        the chunks it received to its own. Gloo's own reduce-scatter is an all-reduce of a clone of its input
        followed by a copy of the rank's chunk (``reduce_scatter_tensor_coalesced``): each rank sent and
        received all of ``flat`` ((world - 1) / world of it twice, over TCP), where this moves a
        reduce-scatter's bytes, (world - 1) / world of it once, into (world - 1) / world of a bucket of memory."""
        if self.behind is not None:
            self.behind.wait()
            self.behind = None
        self.flat, self.out = flat, out
        backend = dist.get_backend(group)
        if backend == "gloo" or TRACED_BACKEND.get() == "gloo":
            n, me = dist.get_world_size(group), dist.get_rank(group)
            chunks = flat.view(n, -1)
            self.mine = chunks[me]
            self.recv = flat.new_empty((n - 1, chunks.shape[1]))
            peers = [p for p in range(n) if p != me]
            ops = [dist.P2POp(dist.isend, chunks[p], group=group, group_peer=p) for p in peers]
            ops += [dist.P2POp(dist.irecv, r, group=group, group_peer=p) for p, r in zip(peers, self.recv)]
            self.work = dist.batch_isend_irecv(ops) if backend == "gloo" else []  # traced: the buffers, no messages
        else:
            self.work = [dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)]
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.work is not None:
            for work in self.work:
                work.wait()
            if self.recv is not None and self.out is not None and self.mine is not None:
                out = self.out.view(-1)
                if len(self.recv) == 1:
                    torch.add(self.mine, self.recv[0], out=out)
                else:
                    torch.sum(self.recv, dim=0, out=out)
                    out.add_(self.mine)
        self.work = self.flat = self.out = self.recv = self.mine = None


def reduce_scatter_now(out: Tensor, flat: Tensor, group: dist.ProcessGroup) -> None:
    """``PendingReduce.start`` waited on at once; under ``torch.compile`` the functional collective that dynamo
    traces (an async handle or point-to-point ops would break the graph)."""
    if torch.compiler.is_compiling():
        dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group)
    else:
        PendingReduce().start(out, flat, group, async_op=False)


class _AwaitReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, box, *xs):
        ctx.box = box
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.box.wait()
        return (None, *grads)


def await_reduce(box: PendingReduce, xs: list[Tensor]) -> list[Tensor]:
    """``xs`` unchanged; in backward, wait for ``box``'s reduce-scatter before passing their gradients on."""
    return list(_AwaitReduce.apply(box, *xs))


class _BucketGather(torch.autograd.Function):
    """All-gather many shards in ONE collective (FSDP's per-block bucket); backward: one reduce-scatter."""

    @staticmethod
    def forward(ctx, group, dims, fulls, compute_dtype, reduce_dtype, scale, pending, reduce_box, *shards):
        token = _gathering()
        try:
            n = dist.get_world_size(group)
            ctx.group, ctx.dims, ctx.fulls, ctx.reduce_dtype, ctx.scale = group, dims, fulls, reduce_dtype, scale
            ctx.reduce_box = reduce_box
            ctx.in_dtypes = [s.dtype for s in shards]
            if pending is None:
                flat, ctx.layout = _pack(shards, dims, fulls, n, compute_dtype)
                out = flat.new_empty(n * flat.numel())
                all_gather_now(out, flat, group)
            else:
                pending.work.wait()
                out, ctx.layout = pending.out, pending.layout
            sizes = [c * math.prod(rest) for c, rest in ctx.layout]
            results = []
            for piece, (c, rest), dim, full in zip(out.view(n, -1).split(sizes, dim=1), ctx.layout, dims, fulls):
                t = _rows(piece.reshape(n * c, *rest), full)  # every rank's chunk, the padding cut off
                results.append(_moved(t, 0, dim))
            return tuple(results)
        finally:
            if token is not None:
                GATHERING.reset(token)

    @staticmethod
    def backward(ctx, *grads):
        n = dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        pieces = []
        for g, (c, _rest), dim in zip(grads, ctx.layout, ctx.dims):
            if ctx.reduce_dtype is not None:
                g = g.to(ctx.reduce_dtype)
            moved = _pad_to(_moved(g, dim, 0), n * c)
            pieces.append(moved.reshape(n, -1))
        # the per-piece pack, scaled before the sum: the planner's extrapolated peak stays within 5% of the
        # measured one with it (a one-pass pack, or the mean scaled after the sum, missed by 6-10%)
        flat = torch.cat(pieces, dim=1)
        if ctx.scale != 1.0:
            flat = flat * ctx.scale
        flat = flat.contiguous().view(-1)
        out = flat.new_empty(flat.numel() // n)
        box = ctx.reduce_box
        # async only when autograd passes the views on untouched up to the await node: it casts a gradient whose
        # dtype differs from its input's, which would read it before the collective finished
        if box is not None and all(dtype == out.dtype for dtype in ctx.in_dtypes):
            box.start(out, flat, ctx.group)
        else:
            reduce_scatter_now(out, flat, ctx.group)
        results = []
        sizes = [c * math.prod(rest) for c, rest in ctx.layout]
        for piece, (c, rest), dim, full, dtype in zip(out.split(sizes), ctx.layout, ctx.dims, ctx.fulls, ctx.in_dtypes):
            mine = chunk(full, n, rank)[1]
            t = _moved(_rows(piece.view(c, *rest), mine), 0, dim)
            results.append(t if ctx.reduce_dtype is not None else t.to(dtype))
        return (None, None, None, None, None, None, None, None, *results)


def bucket_all_gather(
    shards: list[Tensor],
    dims: list[int],
    fulls: list[int],
    group: dist.ProcessGroup,
    *,
    reduce: str = "mean",
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    pending: PendingGather | None = None,
    reduce_box: PendingReduce | None = None,
) -> tuple[Tensor, ...]:
    """``all_gather`` for a list of shards in one collective (and one reduce-scatter in backward).

    ``pending`` is the same gather started earlier by ``start_bucket_gather`` (prefetch): only waited on here.
    ``reduce_box``: backward starts the reduce-scatter into it and returns without waiting; the shards must
    have come through ``await_reduce(reduce_box, ...)``, which waits.
    """
    return _BucketGather.apply(
        group,
        tuple(dims),
        tuple(fulls),
        compute_dtype,
        reduce_dtype,
        _scale(reduce, group),
        pending,
        reduce_box,
        *shards,
    )
