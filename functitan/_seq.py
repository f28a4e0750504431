"""The sequence split: into how many pieces the residual stream is cut along the sequence, and which is this rank's.

Sequence parallelism cuts it over tp (``TPContext``); context parallelism cuts it over cp, with head-tail load
balancing for causal attention (``balanced``: rank i holds chunks i and 2*cp-1-i of 2*cp, so every rank's queries
see as many keys). The two compose: ``outer`` is the split applied first (cp), this one splits what it leaves.
Everything that indexes by position (learned position tables, RoPE rows, the loss's token sums) asks this object,
never a parallelism, so a new way of splitting the sequence is a new ``SequenceSplit``, not an edit of every caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SequenceSplit", "WHOLE"]


@dataclass(frozen=True)
class SequenceSplit:
    """``shards`` pieces, this rank holding piece ``index``. ``by``: the parallelism that splits
    (``"sequence parallelism over tp=2"``) and ``fix``: what a sequence length that does not divide should change
    (its config keys), for the one-line error. ``balanced``: each piece is two chunks of ``2 * shards``, the
    ``index``-th and the ``(2 * shards - 1 - index)``-th (context parallelism's causal balance). ``outer``: a split
    applied before this one (this one cuts the outer's local sequence)."""

    shards: int = 1
    index: int = 0
    by: str = ""
    fix: str = ""
    balanced: bool = False
    outer: SequenceSplit | None = None

    @property
    def total(self) -> int:
        """Pieces over all splits: a sequence of ``n`` tokens leaves ``n // total`` on each rank."""
        return self.shards * (self.outer.total if self.outer is not None else 1)

    @property
    def contiguous(self) -> bool:
        """True when this rank's positions are one range (no balanced split anywhere)."""
        return not self.balanced and (self.outer is None or self.outer.contiguous)

    def _own(self, seq_len: int) -> list[tuple[int, int]]:
        """This split's ranges of a sequence of ``seq_len`` (outer not applied), in local order."""
        if self.shards == 1:
            return [(0, seq_len)]
        parts = 2 * self.shards if self.balanced else self.shards
        if seq_len % parts:
            raise ValueError(f"{self.by} needs the sequence length divisible by {parts}, got {seq_len}; {self.fix}")
        n = seq_len // parts
        if self.balanced:
            return [(self.index * n, (self.index + 1) * n), ((parts - 1 - self.index) * n, (parts - self.index) * n)]
        return [(self.index * n, (self.index + 1) * n)]

    def ranges(self, seq_len: int) -> list[tuple[int, int]]:
        """This rank's positions in a sequence of ``seq_len`` as ``[(start, stop), ...]``, in the order the rank
        holds them."""
        if self.outer is None:
            return self._own(seq_len)
        held = self.outer.ranges(seq_len)
        local = sum(b - a for a, b in held)
        out: list[tuple[int, int]] = []
        for lo, hi in self._own(local):  # positions lo..hi of the outer's local sequence
            at = 0
            for a, b in held:
                s, e = max(lo, at), min(hi, at + b - a)
                if s < e:
                    out.append((a + s - at, a + e - at))
                at += b - a
        return out

    def range(self, seq_len: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's positions in a sequence of ``seq_len``; only for a contiguous split
        (``positions`` and ``cut`` serve every split)."""
        ranges = self.ranges(seq_len)
        if len(ranges) != 1:
            raise ValueError(
                f"{self.by}: this rank's positions are not one range ({ranges}); index with layout.positions(seq_len) "
                f"or cut a whole-sequence tensor with layout.seq.cut(x) instead of layout.seq_range"
            )
        return ranges[0]

    def positions(self, seq_len: int, device: torch.device | str = "cpu") -> Tensor:
        """This rank's position ids ``(local_seq,)``."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.ranges(seq_len)])

    def cut(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's piece of ``x``, whose ``dim`` is the whole sequence (tokens, targets, a mask)."""
        ranges = self.ranges(x.shape[dim])
        if len(ranges) == 1:
            return x.narrow(dim, ranges[0][0], ranges[0][1] - ranges[0][0])
        return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim)


WHOLE = SequenceSplit()  # every rank holds the whole sequence
