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
  attention does) while K/V and their gradient travel the ring again. Each step computes one block per pair
  of chunks (a query chunk over a key chunk); under causal attention half of the pairs are hidden whole and
  skipped, and only a chunk over itself is masked. Memory: two chunks of K/V in flight and one chunk x chunk
  block of scores at a time.
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
import torch.distributed._functional_collectives as funcol
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
        self._masks_mode: Any = None  # the FakeTensorMode the cached masks belong to (None: real tensors)

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
        if torch.compiler.is_compiling():  # a traced graph makes its own constant
            return _causal_mask(self.split.positions(seq, device), seq, dtype)
        # a fake mask is valid only in its own FakeTensorMode (a fake trace of a step runs in a fresh one): the
        # cache is dropped when the mode changes, so the layers of one traced step share a mask as a real step does
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if mode is not self._masks_mode:
            self._masks, self._masks_mode = {}, mode
        key = (seq, device, dtype)
        if key not in self._masks:
            self._masks[key] = _causal_mask(self.split.positions(seq, device), seq, dtype)
        return self._masks[key]

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
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        tiles = [_tiles(s.ranges(seq)) for s in self._splits]
        return _Ring.apply(q, k, v, _RingPlan(self.group, self.rank, self.size, tiles, causal, scale))


Tile = tuple[int, int, int]  # (local start, length, global start): one chunk of a rank's sequence


def _tiles(ranges: list[tuple[int, int]]) -> list[Tile]:
    out, at = [], 0
    for a, b in ranges:
        out.append((at, b - a, a))
        at += b - a
    return out


class _RingPlan:
    """What ``_Ring`` needs besides q, k, v: the ring and each rank's chunks (for the causal blocks)."""

    def __init__(self, group: Any, rank: int, n: int, tiles: list[list[Tile]], causal: bool, scale: float):
        self.group, self.rank, self.n = group, rank, n
        self.tiles, self.causal, self.scale = tiles, causal, scale

    def blocks(self, src: int) -> list[tuple[Tile, Tile, bool]]:
        """``(query chunk, key chunk, masked)`` of this rank's queries over rank ``src``'s keys, one per pair of
        chunks that any query sees: under causal attention with the balanced split, half of the pairs are
        hidden whole (an early chunk's queries never see a late chunk's keys) and are never computed, and only
        a chunk over itself needs a mask. Blocks of one chunk each bound the fp32 scores to ``chunk^2``."""
        out = []
        for qt in self.tiles[self.rank]:
            for kt in self.tiles[src]:
                q0, q1, k0, k1 = qt[2], qt[2] + qt[1] - 1, kt[2], kt[2] + kt[1] - 1
                if self.causal and k0 > q1:
                    continue  # every key after every query
                out.append((qt, kt, self.causal and k1 > q0))
        return out

    def scores(self, q: Tensor, k: Tensor, qt: Tile, kt: Tile, masked: bool) -> Tensor:
        """``(batch, heads, q chunk, k chunk)`` fp32 scores of one block, -inf where causality hides a key."""
        s = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        if masked:
            qpos = torch.arange(qt[2], qt[2] + qt[1], device=q.device)
            kpos = torch.arange(kt[2], kt[2] + kt[1], device=q.device)
            s = s.masked_fill(~(qpos[:, None] >= kpos[None, :]), float("-inf"))
        return s


def _expand(x: Tensor, rep: int) -> Tensor:
    return x.repeat_interleave(rep, 1) if rep > 1 else x


def _fold(g: Tensor, rep: int) -> Tensor:
    """The gradient of ``_expand``: each kv head's query heads summed."""
    return g.unflatten(1, (-1, rep)).sum(2) if rep > 1 else g


def _rows(x: Tensor, t: Tile) -> Tensor:
    return x.narrow(-2, t[0], t[1])


class _Ring(torch.autograd.Function):
    """Ring attention, forward and backward, keeping only q, k, v, the output and its log-sum-exp.

    Forward: step j attends this rank's queries over the chunks of rank ``rank - j`` while the next K/V pair is
    in flight, one block per pair of chunks that causality does not hide (``_RingPlan.blocks``); partial outputs
    merge by their log-sum-exp. Backward recomputes each block's probabilities from the saved log-sum-exp (as
    flash attention does) and passes K/V around the ring again together with their gradient accumulator, which
    each rank adds its part to; one last send returns each accumulator to its owner.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: _RingPlan) -> Tensor:  # type: ignore[override]
        n, rep = plan.n, q.shape[1] // k.shape[1]
        kv = torch.stack([k, v])  # (2, batch, kv_heads, local_seq, d): one message per step
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)
        for step in range(n):
            box = _Shift(plan.group, plan.rank, n)
            nxt = box.start(kv) if step + 1 < n else None  # in flight during this step's blocks
            for qt, kt, masked in plan.blocks((plan.rank - step) % n):
                s = plan.scores(_rows(q, qt), _expand(_rows(kv[0], kt), rep), qt, kt, masked)
                b_lse = torch.logsumexp(s, -1, keepdim=True)  # -inf where a query sees no key of the block
                p = torch.exp(s - torch.where(torch.isinf(b_lse), torch.zeros_like(b_lse), b_lse))
                o = torch.matmul(p, _expand(_rows(kv[1], kt), rep).float())
                o_t, l_t = _rows(out, qt), _rows(lse, qt)  # the online softmax: both parts to the merged normaliser
                new = torch.logaddexp(l_t, b_lse)
                keep = torch.where(torch.isinf(l_t), torch.zeros_like(l_t), torch.exp(l_t - new))
                o_t.copy_(o_t * keep + o * torch.exp(b_lse - new).nan_to_num(0.0))
                l_t.copy_(new)
            if nxt is not None:
                box.wait()
                kv = nxt
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

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
            box = _Shift(plan.group, plan.rank, n)
            nxt = box.start(kv) if step + 1 < n else None  # the next K/V in flight during this step
            for qt, kt, masked in plan.blocks((plan.rank - step) % n):
                qq, gg = _rows(q, qt).float(), _rows(g, qt)
                kk, vv = _expand(_rows(kv[0], kt), rep).float(), _expand(_rows(kv[1], kt), rep).float()
                p = torch.exp(plan.scores(qq, kk, qt, kt, masked) - _rows(lse, qt))  # the block's probabilities
                ds = p * (torch.matmul(gg, vv.transpose(-1, -2)) - _rows(delta, qt)) * plan.scale
                _rows(dq, qt).add_(torch.matmul(ds, kk))
                _rows(dkv[0], kt).add_(_fold(torch.matmul(ds.transpose(-1, -2), qq), rep))
                _rows(dkv[1], kt).add_(_fold(torch.matmul(p.transpose(-1, -2), gg), rep))
            if nxt is not None:
                box.wait()
            back = _Shift(plan.group, plan.rank, n)  # the accumulator follows its chunks (the last send: home)
            moved = back.start(dkv)
            back.wait()
            dkv = moved
            if nxt is not None:
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _causal_mask(qpos: Tensor, seq: int, dtype: torch.dtype) -> Tensor:
    """``(1, 1, local_seq, seq)`` additive causal mask of the queries at ``qpos`` over the whole sequence."""
    seen = qpos[:, None] >= torch.arange(seq, device=qpos.device)[None, :]
    return torch.zeros(seen.shape, dtype=dtype, device=qpos.device).masked_fill_(~seen, float("-inf"))[None, None]


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
    """One ring exchange in flight: ``start`` sends a tensor to the next rank and returns what the previous one
    sends, ``wait`` finishes it."""

    def __init__(self, group: Any, rank: int, n: int) -> None:
        self.group, self.rank, self.n = group, rank, n
        self.works: list[Any] = []
        self.sent: Tensor | None = None

    def start(self, send: Tensor) -> Tensor:
        """The tensor that receives the previous rank's ``send`` (``wait`` before reading it), while ``send`` goes
        to the next. Compiled, one functional all-to-all instead: a graph traces no p2p work handle (dynamo
        breaks the graph there), so a compiled step's ring exchanges are not overlapped with its blocks."""
        ahead, behind = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        if torch.compiler.is_compiling():
            n = send.numel()
            flat = funcol.all_to_all_single(
                send.contiguous().flatten(),
                [n if r == behind else 0 for r in range(self.n)],
                [n if r == ahead else 0 for r in range(self.n)],
                self.group,
            )
            return funcol.wait_tensor(flat).view_as(send)
        recv = torch.empty_like(send)
        self.sent = send.contiguous()  # alive until the send completes
        ops = [
            dist.P2POp(dist.isend, self.sent, group=self.group, group_peer=ahead),
            dist.P2POp(dist.irecv, recv, group=self.group, group_peer=behind),
        ]
        self.works = dist.batch_isend_irecv(ops)
        return recv

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], None
