"""Tensor and sequence parallelism on local tensors: the collectives a named contraction needs.

Megatron's scheme (arXiv 1909.08053, 2205.05198), derived from logical names instead of hand-placed ops. The
``tp`` axis shards one dim of a weight (its spec's name mapped to ``tp`` by the rules). An einsum
``x, w -> out`` then falls in one of three cases:

- column parallel (``w`` is sharded on a dim that the output keeps, e.g. ``heads`` of ``wq``): ``x`` must be
  whole on every tp rank. Under sequence parallelism the residual ``x`` is sharded along ``seq``, so it is
  all-gathered (backward: reduce-scatter); otherwise ``x`` is replicated and its gradient is a partial sum,
  so the backward all-reduces it (Megatron's f). The output is sharded like ``w``.
- row parallel (``w`` is sharded on a contracted dim, e.g. ``heads`` of ``wo``): the local product is a
  partial sum, reduced into the residual layout: reduce-scatter along ``seq`` under sequence parallelism,
  else all-reduce (Megatron's g).
- ``w`` replicated on tp (norm weights): when ``x`` is sharded along ``seq``, each rank sees other tokens, so
  ``w``'s gradient is partial: its backward all-reduces over tp.

Convention for models: activations between contractions are either the residual stream
``(batch, seq, embed)`` or the direct output of a column-parallel contraction (heads, mlp, vocab shards).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import Shard

from . import _collectives as C
from . import _loss
from ._rules import Rules, logical_to_mesh_axes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TPContext", "parse_einsum"]

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


_PARSED: dict[tuple[str, int], tuple] = {}  # a plain dict, not lru_cache: torch.compile traces dict lookups


def parse_einsum(
    pattern: str, n_operands: int
) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...], Callable[..., Tensor]]:
    """``(input names, output names, local op)`` of a named einsum; the op is F.linear, a multiply, or torch.einsum."""
    hit = _PARSED.get((pattern, n_operands))
    if hit is None:
        hit = _PARSED[(pattern, n_operands)] = _parse(pattern, n_operands)
    return hit


def _parse(pattern: str, n_operands: int) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...], Callable[..., Tensor]]:
    if "->" not in pattern:
        raise ValueError(
            f"einsum pattern {pattern!r} needs '->' (e.g. 'batch seq embed, heads embed -> batch seq heads')"
        )
    lhs, out = pattern.split("->")
    inputs = tuple(tuple(s.split()) for s in lhs.split(","))
    output = tuple(out.split())
    if len(inputs) != n_operands:
        raise ValueError(f"einsum pattern {pattern!r} names {len(inputs)} operands but {n_operands} were given")
    if n_operands == 2:
        x, w = inputs
        if len(w) == 2 and x and x[-1] == w[1] and output == (*x[:-1], w[0]) and w[0] not in x:
            return inputs, output, F.linear  # a projection: x (..., in) with w (out, in)
        if output == x and len(w) <= len(x) and x[len(x) - len(w) :] == w:
            return inputs, output, torch.mul  # a scale along x's trailing dims
    letters: dict[str, str] = {}
    for name in (n for names in (*inputs, output) for n in names):
        if name not in letters:
            if len(letters) == len(_LETTERS):
                raise ValueError(f"einsum pattern {pattern!r} uses more than {len(_LETTERS)} axis names")
            letters[name] = _LETTERS[len(letters)]
    eq = ",".join("".join(letters[n] for n in i) for i in inputs) + "->" + "".join(letters[n] for n in output)
    return inputs, output, functools.partial(torch.einsum, eq)


_AXIS_OF: dict[tuple[tuple[str, ...], Rules, str], str | None] = {}  # a plain dict for torch.compile, as _PARSED


def _axis_of(names: tuple[str, ...], rules: Rules, axis: str) -> str | None:
    """The logical name of the dim that ``rules`` shard over mesh ``axis`` (None if no dim is)."""
    k = (names, rules, axis)
    if k not in _AXIS_OF:
        _AXIS_OF[k] = next((n for n, axes in zip(names, logical_to_mesh_axes(names, rules)) if axis in axes), None)
    return _AXIS_OF[k]


def _unsequenced(pattern: str) -> ValueError:
    """Under sequence parallelism a column-parallel input must name its token dim ``seq``: it is the dim the
    contraction gathers. Without it each tp rank would contract its own tokens and the row-parallel reduction
    after it would add products of different tokens (a GShard-style dispatch ``experts capacity embed`` built
    from this rank's sequence piece)."""
    return ValueError(
        f"under sequence parallelism the column-parallel contraction {pattern!r} takes an input without a 'seq' "
        f"dim, so its tokens (this rank's piece of the sequence) would not be gathered; keep the token dim named "
        f"'seq' in the input (e.g. dispatch after the contraction), or set parallelism.sequence_parallel=false"
    )


class TPContext:
    """The tensor-parallel axis of a mesh and the rules: plans and runs the collectives of each op."""

    def __init__(self, mesh: DeviceMesh, rules: Rules, axis: str = "tp"):
        self.rules = rules
        self.axis = axis
        self.group = mesh.get_group(axis)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.sequence_parallel = _axis_of(("seq",), rules, axis) == "seq"

    def grad_sum(self, local: Tensor, p: Any, reduce_dtype: torch.dtype | None = None) -> Tensor:
        """Under sequence parallelism, the gradient of a parameter replicated over tp summed over tp (identity
        forward): every activation is split over tp then, so each rank holds a part of its gradient."""
        names = p.device_mesh.mesh_dim_names or ()
        if self.axis not in names or isinstance(p.placements[names.index(self.axis)], Shard):
            return local
        return C.grad_all_reduce(local, self.group, reduce="sum", reduce_dtype=reduce_dtype)

    # -- contractions
    def einsum(self, pattern: str, x: Tensor, w: Tensor) -> Tensor:
        (xn, wn), out, op = parse_einsum(pattern, 2)
        sharded = _axis_of(wn, self.rules, self.axis)
        x_seq = self.sequence_parallel and "seq" in xn and not (sharded in xn and sharded not in out)
        if sharded is not None and sharded in out and sharded not in xn:  # column parallel
            if self.sequence_parallel and "seq" not in xn:
                raise _unsequenced(pattern)
            x = self.gather_seq(x, xn.index("seq")) if x_seq else C.grad_all_reduce(x, self.group, reduce="sum")
            return op(x, w)
        if sharded is not None and sharded in xn and sharded not in out:  # row parallel
            return self.reduce(op(x, w), out)
        # w replicated over tp. Under sequence parallelism Layout.param already sums its gradient over tp (every
        # activation is split then). Without it only activations split by feature (heads, mlp) give a partial
        # gradient, e.g. per-head q/k norm weights: sum it here.
        if sharded is None and not self.sequence_parallel and _axis_of(xn, self.rules, self.axis) is not None:
            w = C.grad_all_reduce(w, self.group, reduce="sum")
        return op(x, w)

    def einsums(self, x: Tensor, pairs: list[tuple[str, Tensor]]) -> list[Tensor]:
        """Several contractions of one input (q, k, v; gate, up) with one input collective for all of them.

        When every contraction is column parallel on the same input names, ``x`` is all-gathered along ``seq``
        once under sequence parallelism (backward: the gradients of all contractions are summed by autograd,
        then ONE reduce-scatter), or its gradient all-reduced once without (Megatron's f once, as torch's
        ``PrepareModuleInput`` does). Otherwise each contraction is planned alone (``einsum``).
        """
        plans = [(parse_einsum(pattern, 2), w) for pattern, w in pairs]
        xn = plans[0][0][0][0]
        shared = all(
            names[0] == xn
            and (sh := _axis_of(names[1], self.rules, self.axis)) is not None
            and sh in out
            and sh not in xn
            for (names, out, _), _ in plans
        )
        if not shared:
            return [self.einsum(pattern, x, w) for pattern, w in pairs]
        if self.sequence_parallel and "seq" not in xn:
            raise _unsequenced(pairs[0][0])
        if self.sequence_parallel and "seq" in xn:
            x = self.gather_seq(x, xn.index("seq"))
        else:
            x = C.grad_all_reduce(x, self.group, reduce="sum")
        return [op(x, w) for (_, _, op), w in plans]

    def whole(self, x: Tensor, names: tuple[str, ...]) -> Tensor:
        """``x`` as a column-parallel contraction takes its input, for a value every tp rank's heads use whole
        outside such a contraction: gathered along ``seq`` under sequence parallelism (backward: the ranks'
        partial gradients reduce-scattered), else identity with its gradient summed over tp (Megatron's f)."""
        if not self.sequence_parallel:
            return C.grad_all_reduce(x, self.group, reduce="sum")
        if "seq" not in names:
            raise ValueError(
                f"layout.whole_over_tp: names {' '.join(names)!r} have no 'seq' dim, which sequence parallelism "
                f"splits; name x's sequence dim 'seq'"
            )
        return self.gather_seq(x, names.index("seq"))

    def gather_seq(self, x: Tensor, dim: int) -> Tensor:
        return C.all_gather(x, dim, x.shape[dim] * self.size, self.group, reduce="sum")

    def reduce(self, partial: Tensor, names: tuple[str, ...]) -> Tensor:
        """Sum a tp-partial value into the residual layout (sequence shards under sequence parallelism)."""
        if self.sequence_parallel and "seq" in names:
            dim = names.index("seq")
            if partial.shape[dim] % self.size:
                raise ValueError(
                    f"sequence parallelism over tp={self.size} needs the sequence length divisible by {self.size}, "
                    f"got {partial.shape[dim]}; change training.seq_len or set parallelism.sequence_parallel=false"
                )
            return C.reduce_scatter(partial, dim, self.group)
        return C.all_reduce(partial, self.group)

    # -- embedding and loss
    def _vocab_range(self, vocab_local: int, vocab: int) -> tuple[int, int]:
        sizes = C.chunk_sizes(vocab, self.size)
        lo = sum(sizes[: self.rank])
        return lo, lo + vocab_local

    def embed(self, tokens: Tensor, table: Tensor, rows: int) -> Tensor:
        """Row lookup; vocab-parallel when this rank holds fewer than ``rows`` rows of the table."""
        if table.shape[0] < rows:
            lo, hi = self._vocab_range(table.shape[0], rows)
            outside = (tokens < lo) | (tokens >= hi)
            local = F.embedding((tokens - lo).masked_fill(outside, 0), table).masked_fill(outside.unsqueeze(-1), 0.0)
            return self.reduce(local, ("batch", "seq", "embed"))
        if self.sequence_parallel:  # a replicated table: look up this rank's sequence piece only
            seq = tokens.shape[1] // self.size
            tokens = tokens[:, self.rank * seq : (self.rank + 1) * seq]
        return F.embedding(tokens, table)

    def cross_entropy(
        self,
        logits: Tensor,  # (batch, seq or this rank's seq piece, vocab or this rank's vocab shard)
        targets: Tensor,  # (batch, seq): the whole sequence, the same on every tp rank
        vocab: int,
        *,
        ignore_index: int,
        label_smoothing: float,
        z_loss: float,
    ) -> tuple[Tensor, Tensor]:
        """``(sum of per-token losses, count of valid tokens)`` over this rank's batch, the same on every tp rank.

        Vocab-sharded logits are never gathered (loss parallel): one all-reduce carries the softmax denominator,
        the target logit (and, with label smoothing, the logit sum) of every token; its backward is the
        identity, so each rank's vocabulary shard gets its own gradient. Logits of this rank's sequence piece (a
        replicated head under sequence parallelism) sum this piece's tokens, all-reduced over tp (the gradient
        reaches each token once); the count is that of the whole sequence's valid targets.
        """
        opts: dict[str, Any] = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss)
        if logits.shape[-1] == vocab:
            if logits.shape[1] == targets.shape[1]:
                return _loss.dense_cross_entropy(logits, targets, **opts)
            lo = self.rank * logits.shape[1]  # logits of this rank's sequence piece
            total, _ = _loss.dense_cross_entropy(logits, targets[:, lo : lo + logits.shape[1]], **opts)
            return C.all_reduce(total, self.group), (targets != ignore_index).sum().float()
        z = logits.flatten(0, 1).float()  # (tokens, local_vocab)
        t = targets.flatten()
        valid = t != ignore_index
        with torch.no_grad():
            m = z.max(dim=-1, keepdim=True).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
        z = z - m
        lo, hi = self._vocab_range(z.shape[1], vocab)
        inside = (t >= lo) & (t < hi)
        picked = z.gather(1, (t - lo).clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1) * inside
        parts = [z.exp().sum(-1), picked] + ([z.sum(-1)] if label_smoothing else [])
        summed = C.all_reduce(torch.stack(parts), self.group)  # one collective for every per-token sum
        lse = summed[0].log()  # of z - m
        per_token = lse - summed[1]
        if label_smoothing:  # F.cross_entropy's: (1 - eps) * nll + eps * mean over the vocabulary of -log p
            per_token = (1.0 - label_smoothing) * per_token + label_smoothing * (lse - summed[2] / vocab)
        if z_loss:
            per_token = per_token + z_loss * (lse + m.squeeze(-1)).square()
        return torch.where(valid, per_token, 0.0).sum(), valid.sum().float()
