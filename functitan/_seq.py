"""The sequence split: into how many pieces the residual stream is cut along the sequence, and which is this rank's.

Sequence parallelism cuts it over tp today (``TPContext``); context parallelism will cut it over cp. Everything
that indexes by position (learned position tables, the loss's token sums, RoPE) asks this object, never a
parallelism, so a new way of splitting the sequence is a new ``SequenceSplit``, not an edit of every caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SequenceSplit", "WHOLE"]


@dataclass(frozen=True)
class SequenceSplit:
    """``shards`` contiguous pieces, this rank holding piece ``index``. ``by``: the parallelism that splits
    (``"sequence parallelism over tp=2"``) and ``fix``: what a sequence length that does not divide should change
    (its config keys), for the one-line error."""

    shards: int = 1
    index: int = 0
    by: str = ""
    fix: str = ""

    def range(self, seq_len: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's positions in a sequence of ``seq_len``."""
        if self.shards == 1:
            return 0, seq_len
        if seq_len % self.shards:
            raise ValueError(
                f"{self.by} needs the sequence length divisible by {self.shards}, got {seq_len}; {self.fix}"
            )
        n = seq_len // self.shards
        return self.index * n, (self.index + 1) * n

    def positions(self, seq_len: int, device: torch.device | str = "cpu") -> Tensor:
        """This rank's position ids ``(local_seq,)``."""
        return torch.arange(*self.range(seq_len), device=device)


WHOLE = SequenceSplit()  # every rank holds the whole sequence
