"""Expert parallelism: each ep rank holds ``experts / ep`` routed experts and receives their tokens.

The assignments, sorted by expert (so by the rank that holds it: experts are contiguous per rank), go to their
ranks with one all-to-all of uneven splits (the counts per expert travel first, in a small all-to-all of their
own); each rank regroups what arrived (by source rank, then expert) by expert, runs its experts' grouped GEMMs,
puts the rows back in arrival order and returns them with the inverse all-to-all. Both all-to-alls are
differentiable: backward sends the gradients the other way. No token is dropped and no capacity is padded.
"""

from __future__ import annotations

import contextvars
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._collectives import _gather, chunk
from .._valueless import valueless

__all__ = ["ExpertParallel", "all_to_all", "TRACED_LOAD"]

# The rows a traced step (functitan.plan: tensors without values to route by) sends to the traced rank's
# experts, as a multiple of the balanced share. Real routing is uneven and the planner traces the worst rank: at
# 1.0 a real step's busiest ep rank peaked up to 1.5% above the trace (Qwen3-MoE debug, ep 4).
TRACED_LOAD: contextvars.ContextVar[float] = contextvars.ContextVar("functitan_traced_moe_load", default=1.0)


@dataclass(frozen=True)
class ExpertParallel:
    """The routed experts' group (``functitan.mesh.expert_axis``): its process group, size and this rank's index.
    ``replicas``: tp's group where it is in the experts' group and its ranks hold the same tokens (no sequence
    parallelism): each routes its share of them (``share``) and the results are gathered (``whole``)."""

    group: Any
    size: int
    rank: int
    replicas: Any = None

    @classmethod
    def of(cls, mesh: Any, axis: str = "ep", replicas: Any = None) -> ExpertParallel:
        if axis in (mesh.mesh_dim_names or ()):
            group = mesh.get_group(axis)
        else:  # a flattened axis (``ep_cp_tp``) is sliced from the root mesh
            with warnings.catch_warnings():  # "slicing a flattened dim from root mesh will be deprecated"
                warnings.simplefilter("ignore", UserWarning)
                group = mesh._get_root_mesh()[axis].get_group()
        return cls(group, dist.get_world_size(group), dist.get_rank(group), replicas)

    def share(self, x: Tensor) -> Tensor:
        """This tp rank's chunk of ``x``'s rows (tokens every tp rank holds alike); backward gathers the chunks'
        gradients, so each rank again holds the whole gradient of what it holds whole."""
        return x if self.replicas is None else _Share.apply(x, self.replicas)

    def whole(self, x: Tensor, rows: int) -> Tensor:
        """Every tp rank's ``share`` of ``rows`` rows put together (backward: this rank's rows of the gradient,
        which every rank holds whole)."""
        return x if self.replicas is None else _Whole.apply(x, rows, self.replicas)

    def routed(self, x: Tensor, token: Tensor, counts: Tensor, compute: Any) -> Tensor:
        """Rows ``x[token]`` (sorted by expert; ``counts (experts,)`` rows per expert, all of them) through the
        experts wherever they live: ``compute(rows, local_counts)`` runs this rank's experts on rows grouped by
        its local expert. Returns the result rows in the order of ``token``."""
        n = counts.shape[0] // self.size  # experts per rank
        with torch.no_grad():
            if valueless(counts):  # the planner's traced step: no values to route by (``_balanced``)
                send_splits, recv_splits, order, local_counts = self._balanced(token.shape[0], n, counts)
            else:
                recv = torch.empty_like(counts)
                dist.all_to_all_single(recv, counts, group=self.group)  # (ep * n): per source rank, per local expert
                by_src = recv.view(self.size, n)
                send_splits = counts.view(self.size, n).sum(1).tolist()
                recv_splits = by_src.sum(1).tolist()
                # the arrived rows, ordered (source, expert), regrouped as (expert, source)
                start = (by_src.flatten().cumsum(0) - by_src.flatten()).view(self.size, n)
                lengths = by_src.t().flatten()
                first = start.t().flatten()
                before = lengths.cumsum(0) - lengths
                order = torch.repeat_interleave(first - before, lengths) + torch.arange(int(lengths.sum()))
                local_counts = by_src.sum(0)
        rows = all_to_all(x[token], send_splits, recv_splits, self.group)
        out = compute(rows[order], local_counts)
        back = torch.empty_like(out).index_copy(0, order, out)  # arrival order again
        return all_to_all(back, recv_splits, send_splits, self.group)

    def _balanced(self, rows: int, n: int, counts: Tensor) -> tuple[list[int], list[int], Tensor, Tensor]:
        """``routed``'s splits, order and local counts on tensors without values (``valueless``): every rank sends
        each rank an equal share of its ``rows``, and this rank receives ``TRACED_LOAD`` times its share (the
        busiest rank: the planner bounds the worst rank's memory), its ``n`` experts taking equal groups; the same
        exchanges and copies as a real step."""
        send = _even(rows, self.size)
        load = min(TRACED_LOAD.get(), self.size)  # at most every rank's rows
        recv = [math.ceil(r * load) for r in send]
        exchanged = torch.empty_like(counts)
        dist.all_to_all_single(exchanged, counts, group=self.group)  # the count exchange a real step makes
        total = sum(recv)
        order = torch.arange(total, device=counts.device)
        return send, recv, order, counts.new_empty(n)  # the local counts: no values to hold, a real step's bytes


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        out = g.new_empty((sum(ctx.send), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class _Share(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        return x.narrow(0, *chunk(x.shape[0], dist.get_world_size(group), dist.get_rank(group)))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return _gather(g.contiguous(), 0, ctx.rows, ctx.group), None


class _Whole(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, rows: int, group: Any) -> Tensor:
        ctx.group = group
        return _gather(x.contiguous(), 0, rows, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.narrow(0, *chunk(g.shape[0], n, r)), None, None


def _even(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` sizes as equal as integers allow (the first ones one larger), as ``tensor_split``."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def all_to_all(x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    """Rows of ``x`` (dim 0) in ``send[r]``-row pieces to rank ``r`` of ``group``; ``recv[r]`` rows come from
    each. Differentiable (backward: the same exchange the other way)."""
    return _AllToAll.apply(x, send, recv, group)
