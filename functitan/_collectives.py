"""Differentiable collectives on local tensors: the explicit-communication path (as in FSDP2 and Megatron).

Each op is an autograd.Function whose backward is the dual collective:

- ``all_gather(x, dim)``: forward all-gathers shards along ``dim`` (padding uneven shards the way DTensor's
  ``Shard`` does: torch.chunk sizes); backward reduce-scatters the gradient, averaged over the group.
- ``grad_all_reduce(x)``: forward is the identity; backward all-reduces the gradient, averaged. This is DDP
  (and HSDP's replicate axis) for a replicated parameter.

"Averaged" because every data-parallel rank's loss is the mean over its own batch slice, so the gradient of
the global mean loss is the mean of the per-rank gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather", "grad_all_reduce", "chunk_sizes"]


def chunk_sizes(full: int, n: int) -> list[int]:
    """Sizes of ``torch.chunk(range(full), n)`` padded with zeros to ``n`` entries (DTensor's Shard split)."""
    c = -(-full // n) if full else 0
    return [max(0, min(c, full - i * c)) for i in range(n)]


def _gather(x: Tensor, dim: int, full: int, group: dist.ProcessGroup) -> Tensor:
    n = dist.get_world_size(group)
    c = -(-full // n)
    moved = x.movedim(dim, 0)
    if moved.shape[0] != c:  # uneven: pad to the common chunk size
        pad = moved.new_zeros((c - moved.shape[0], *moved.shape[1:]))
        moved = torch.cat([moved, pad])
    moved = moved.contiguous()
    out = moved.new_empty((c * n, *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    return out[:full].movedim(0, dim)


def _reduce_scatter_mean(g: Tensor, dim: int, full: int, group: dist.ProcessGroup) -> Tensor:
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    c = -(-full // n)
    moved = g.movedim(dim, 0)
    if moved.shape[0] != c * n:
        pad = moved.new_zeros((c * n - moved.shape[0], *moved.shape[1:]))
        moved = torch.cat([moved, pad])
    moved = (moved / n).contiguous()
    out = moved.new_empty((c, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, op=dist.ReduceOp.SUM, group=group)
    mine = chunk_sizes(full, n)[rank]
    return out[:mine].movedim(0, dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, full: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.full, ctx.group = dim, full, group
        return _gather(x, dim, full, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _reduce_scatter_mean(g, ctx.dim, ctx.full, ctx.group), None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g / dist.get_world_size(ctx.group)
        dist.all_reduce(g, group=ctx.group)
        return g, None


def all_gather(x: Tensor, dim: int, full: int, group: dist.ProcessGroup) -> Tensor:
    """Gather ``x``'s shards along ``dim`` into the full size ``full``; backward reduce-scatters (mean)."""
    return _AllGather.apply(x, dim, full, group)


def grad_all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Identity forward; backward all-reduces (mean) the gradient over ``group``."""
    return _GradAllReduce.apply(x, group)
