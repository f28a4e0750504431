"""Context parallelism on local tensors: the sequence split over ``cp`` and the attention that spans it.

Each cp rank holds two chunks of the sequence (``SequenceSplit(balanced=True)``: rank i holds chunks i and
2*cp-1-i of 2*cp), so under causal attention every rank's queries see as many keys. Everything but attention is
per token and runs on the local chunks unchanged; attention needs every earlier key, which three algorithms
bring (``parallelism.cp_attention``):

- ``allgather``: all-gather K and V over cp (backward: reduce-scatter of their gradients), put them in sequence
  order and attend with this rank's queries at their positions. What Llama 3 and torchtitan use; the only one
  that takes document masks (``segment_ids``) as they are. Memory: the whole sequence's K/V per layer.
- ``ring``: K and V travel around the ring, one chunk pair per step, and the partial results merge by their
  log-sum-exp (online softmax); the next step's send and receive are in flight while this step computes. Only
  q, k, v, the output and its log-sum-exp are kept for backward, which recomputes each block (as flash
  attention does) while K/V and their gradient travel the ring again. Memory: two chunks of K/V in flight and
  one block of scores at a time.
- ``ulysses``: an all-to-all turns sequence shards into head shards (every rank attends the whole sequence for
  ``heads / cp`` of its heads) and a second turns them back. Needs the local head counts divisible by cp.

Each is exact: the same softmax over the same keys as one device, up to the order of the sums.
Losses: a per-token sum over the local chunks is summed over cp (``whole``, whose backward all-reduces the
gradient), so every cp rank holds the whole sequence's loss and the cp-mean of the parameter gradients (the
data-parallel reduction, which cp joins) is the gradient of that loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from . import _collectives
from ._choices import CP_ATTENTIONS
from ._seq import SequenceSplit

__all__ = ["ALGORITHMS", "CPContext"]

ALGORITHMS = CP_ATTENTIONS  # spelled once, in functitan._choices (the config checks against it without torch)


class CPContext:
    """The context-parallel part of a Layout: the cp group, this rank's balanced split and the attention."""

    def __init__(self, mesh: DeviceMesh, algorithm: str = "allgather", axis: str = "cp") -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"parallelism.cp_attention={algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        self.group = mesh.get_group(axis)
        self.size = mesh[axis].size()
        self.rank = mesh[axis].get_local_rank()
        self.algorithm = algorithm
        fix = "change training.seq_len or parallelism.cp"
        self.split = SequenceSplit(self.size, self.rank, f"context parallelism over cp={self.size}", fix, True)
        self._splits = [SequenceSplit(self.size, r, self.split.by, fix, True) for r in range(self.size)]
        self._masks: dict[tuple, Tensor] = {}  # (seq, device, dtype) -> the causal mask: a constant per shape

    def whole(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over cp (each rank's part of a per-token sum); backward all-reduces the gradient."""
        return _SumOverRanks.apply(x, self.group)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, segment_ids: Tensor | None, scale: float | None
    ) -> Tensor:
        """``q (batch, heads, local_seq, head_dim)``, ``k``/``v (batch, kv_heads, local_seq, head_dim)`` of this
        rank's chunks -> ``(batch, heads, local_seq, head_dim)``. ``segment_ids (batch, seq)``: the whole
        sequence's document ids, as the batch holds them."""
        seq = q.shape[2] * self.size
        if segment_ids is not None and segment_ids.shape[1] != seq:
            raise ValueError(
                f"segment_ids cover {segment_ids.shape[1]} positions, the sequence under cp={self.size} has {seq}; "
                f"pass the batch's whole-sequence segment_ids"
            )
        if self.algorithm == "ulysses":
            return self._ulysses(q, k, v, causal, segment_ids, scale)
        if self.algorithm == "ring":
            if segment_ids is not None:
                raise ValueError(
                    "parallelism.cp_attention=ring does not take packed documents (segment_ids); set "
                    "parallelism.cp_attention=allgather"
                )
            return self._ring(q, k, v, causal, scale)
        return self._allgather(q, k, v, causal, segment_ids, scale)

    # -- the order of the gathered chunks
    def _gathered_order(self, seq: int, device: torch.device) -> Tensor:
        """Sequence order of an all-gather's rows: ``gathered.index_select(dim, order)`` is the sequence."""
        held = torch.cat([s.positions(seq, device) for s in self._splits])  # position of each gathered row
        return torch.argsort(held)

    def _mask(
        self, seq: int, causal: bool, segment_ids: Tensor | None, device: torch.device, dtype: torch.dtype
    ) -> Tensor | None:
        """``(batch or 1, 1, local_seq, seq)`` additive mask (0 or -inf, in ``dtype``): which keys (in sequence
        order) each local query sees. SDPA keeps its mask for backward, so a causal mask without documents is made
        once per shape and shared by every layer (``_causal``) instead of once per layer: at cp 2 a bool mask
        cost 8 MiB a layer at seq 2048 (benchmarks/context_parallel.py)."""
        if segment_ids is None:
            return self._causal(seq, device, dtype) if causal else None
        qpos = self.split.positions(seq, device)
        seen = (segment_ids[:, qpos][:, :, None] == segment_ids[:, None, :])[:, None]
        if causal:
            seen = seen & (qpos[:, None] >= torch.arange(seq, device=device)[None, :])[None, None]
        return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))

    def _causal(self, seq: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        key = (seq, device, dtype)
        mask = self._masks.get(key)
        if mask is None:
            qpos = self.split.positions(seq, device)
            seen = qpos[:, None] >= torch.arange(seq, device=device)[None, :]
            mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))[None, None]
            if _memoizable():  # a fake or compiled tensor is not kept for later steps
                self._masks[key] = mask
        return mask

    def _allgather(self, q, k, v, causal, segment_ids, scale) -> Tensor:
        seq = q.shape[2] * self.size
        order = self._gathered_order(seq, q.device)
        k, v = (
            _collectives.all_gather(t, 2, seq, self.group, reduce="sum").index_select(2, order) for t in (k, v)
        )  # (batch, kv_heads, seq, head_dim), sequence order
        mask = self._mask(seq, causal, segment_ids, q.device, q.dtype)
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)

    def _ulysses(self, q, k, v, causal, segment_ids, scale) -> Tensor:
        n = self.size
        if q.shape[1] % n or k.shape[1] % n:
            raise ValueError(
                f"parallelism.cp_attention=ulysses needs the local heads ({q.shape[1]}) and kv heads ({k.shape[1]}) "
                f"divisible by cp={n}; set parallelism.cp_attention=allgather or ring"
            )
        seq = q.shape[2] * n
        order = self._gathered_order(seq, q.device)
        back = torch.argsort(order)
        # (batch, heads, local_seq, d) -> (batch, heads / cp, seq, d): this rank's heads over the whole sequence
        q, k, v = (_AllToAll.apply(t, self.group, 1, 2).index_select(2, order) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if segment_ids is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        else:
            same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
            if causal:
                same = same & torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=same, scale=scale, enable_gqa=gqa)
        return _AllToAll.apply(o.index_select(2, back), self.group, 2, 1)

    def _ring(self, q, k, v, causal, scale) -> Tensor:
        seq = q.shape[2] * self.size
        qpos = self.split.positions(seq, q.device)
        kpos = [s.positions(seq, q.device) for s in self._splits]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return _Ring.apply(q, k, v, _RingPlan(self.group, self.rank, self.size, qpos, kpos, causal, scale))


class _RingPlan:
    """What ``_Ring`` needs besides q, k, v: the ring and each rank's positions (for the causal mask)."""

    def __init__(self, group: Any, rank: int, n: int, qpos: Tensor, kpos: list[Tensor], causal: bool, scale: float):
        self.group, self.rank, self.n = group, rank, n
        self.qpos, self.kpos, self.causal, self.scale = qpos, kpos, causal, scale

    def scores(self, q: Tensor, k: Tensor, src: int) -> Tensor:
        """``(batch, heads, local_seq, local_seq)`` fp32 scores of this rank's queries over rank ``src``'s keys
        (``k`` with the query's head count), -inf where causality hides a key."""
        s = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        if self.causal:
            s = s.masked_fill(~(self.qpos[:, None] >= self.kpos[src][None, :]), float("-inf"))
        return s


def _expand(x: Tensor, rep: int) -> Tensor:
    return x.repeat_interleave(rep, 1) if rep > 1 else x


def _fold(g: Tensor, rep: int) -> Tensor:
    """The gradient of ``_expand``: each kv head's query heads summed."""
    return g.unflatten(1, (-1, rep)).sum(2) if rep > 1 else g


class _Ring(torch.autograd.Function):
    """Ring attention, forward and backward, keeping only q, k, v, the output and its log-sum-exp.

    Forward: step j attends this rank's queries over the chunks of rank ``rank - j`` while the next K/V pair is
    in flight; partial outputs merge by their log-sum-exp. Backward recomputes each block's probabilities from
    the saved log-sum-exp (as flash attention does) and passes K/V around the ring again together with their
    gradient accumulator, which each rank adds its part to; one last send returns each accumulator to its owner.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: _RingPlan) -> Tensor:  # type: ignore[override]
        n, rep = plan.n, q.shape[1] // k.shape[1]
        kv = torch.stack([k, v])  # (2, batch, kv_heads, local_seq, d): one message per step
        out = lse = None
        for step in range(n):
            box, nxt = _Shift(plan.group, plan.rank, n), None
            if step + 1 < n:
                nxt = torch.empty_like(kv)
                box.works = box.exchange(kv, nxt, forward=True)  # in flight during this block
            s = plan.scores(q, _expand(kv[0], rep), (plan.rank - step) % n)
            b_lse = torch.logsumexp(s, -1, keepdim=True)  # -inf where a query sees no key of the block
            p = torch.exp(s - torch.where(torch.isinf(b_lse), torch.zeros_like(b_lse), b_lse))
            o = torch.matmul(p, _expand(kv[1], rep).float())
            if out is None or lse is None:  # step 0: this rank's own chunks, every query sees itself
                out, lse = o, b_lse
            else:  # the online softmax: both parts rescaled to the merged normaliser
                new = torch.logaddexp(lse, b_lse)
                out, lse = out * torch.exp(lse - new) + o * torch.exp(b_lse - new), new
            if nxt is not None:
                box.wait()
                kv = nxt
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)  # type: ignore[union-attr]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        plan: _RingPlan = ctx.plan
        n, rep = plan.n, q.shape[1] // k.shape[1]
        g = g.float()
        delta = (g * out).sum(-1, keepdim=True)  # (batch, heads, local_seq, 1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # travels with kv: the gradient of the chunks it holds
        for step in range(n):
            box, nxt = _Shift(plan.group, plan.rank, n), None
            if step + 1 < n:
                nxt = torch.empty_like(kv)
                box.works = box.exchange(kv, nxt, forward=True)  # the next K/V in flight during this block
            kk, vv = _expand(kv[0], rep).float(), _expand(kv[1], rep).float()
            p = torch.exp(plan.scores(q, kk, (plan.rank - step) % n) - lse)  # the block's probabilities
            dp = torch.matmul(g, vv.transpose(-1, -2))
            ds = p * (dp - delta) * plan.scale
            dq += torch.matmul(ds, kk)
            dkv[0] += _fold(torch.matmul(ds.transpose(-1, -2), q.float()), rep)
            dkv[1] += _fold(torch.matmul(p.transpose(-1, -2), g), rep)
            if nxt is not None:
                box.wait()
            moved = torch.empty_like(dkv)  # the accumulator follows its chunks (the last send: home)
            back = _Shift(plan.group, plan.rank, n)
            back.works = back.exchange(dkv, moved, forward=True)
            back.wait()
            dkv = moved
            if nxt is not None:
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _memoizable() -> bool:
    """False while compiling or under a FakeTensorMode (the planner's traces), whose tensors must not be kept."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward and backward: every rank's loss depends on every rank's part."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``split_dim`` into cp pieces, send piece j to rank j, concatenate what arrives along
    ``cat_dim`` (rank order); backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, split_dim: int, cat_dim: int) -> Tensor:
        ctx.group, ctx.split_dim, ctx.cat_dim = group, split_dim, cat_dim
        return _all_to_all(x, group, split_dim, cat_dim)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_to_all(g, ctx.group, ctx.cat_dim, ctx.split_dim), None, None, None


def _all_to_all(x: Tensor, group: Any, split_dim: int, cat_dim: int) -> Tensor:
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, split_dim)).contiguous()  # (n, ...piece)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), cat_dim)


class _Shift:
    """One ring exchange in flight: ``exchange`` starts it, ``wait`` finishes it."""

    def __init__(self, group: Any, rank: int, n: int) -> None:
        self.group, self.rank, self.n = group, rank, n
        self.works: list[Any] = []
        self.sent: Tensor | None = None

    def exchange(self, send: Tensor, recv: Tensor, *, forward: bool) -> list[Any]:
        """Send ``send`` on (to the next rank forward, the previous one backward) and receive into ``recv``."""
        ahead, behind = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        to, frm = (ahead, behind) if forward else (behind, ahead)
        self.sent = send.contiguous()  # alive until the send completes
        ops = [
            dist.P2POp(dist.isend, self.sent, group=self.group, group_peer=to),
            dist.P2POp(dist.irecv, recv, group=self.group, group_peer=frm),
        ]
        return dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], None
