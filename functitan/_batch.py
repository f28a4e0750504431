"""The global batch stays constant when the world size changes: the per-rank batch and microbatches follow."""

from __future__ import annotations

from .errors import UserError

__all__ = ["BatchSplitError", "split_batch", "world_sizes_for"]


class BatchSplitError(UserError):
    """The global batch cannot be split evenly over this many data-parallel ranks; lists the sizes that can."""


def _fits(per_rank: int, microbatches: int, microbatch_size: int) -> bool:
    return per_rank % (microbatch_size or microbatches) == 0


def world_sizes_for(global_batch: int, *, microbatches: int = 1, microbatch_size: int = 0, fixed: int = 1) -> list[int]:
    """The world sizes that keep ``global_batch``: ``dp * fixed`` for every data-parallel size ``dp`` that splits it.

    >>> world_sizes_for(8, microbatch_size=2, fixed=1)
    [1, 2, 4]
    """
    return [
        dp * fixed
        for dp in range(1, global_batch + 1)
        if global_batch % dp == 0 and _fits(global_batch // dp, microbatches, microbatch_size)
    ]


def split_batch(
    global_batch: int, dp_size: int, *, microbatches: int = 1, microbatch_size: int = 0, fixed: int = 1
) -> tuple[int, int]:
    """``(per-rank batch, microbatches)`` that keep ``global_batch`` sequences per step over ``dp_size`` ranks.

    Args:
        global_batch: ``training.batch_size``, sequences per step over all data-parallel ranks.
        dp_size: data-parallel ranks (the world size over ``fixed``).
        microbatches: ``training.microbatches``, used when ``microbatch_size`` is 0.
        microbatch_size: ``elastic.microbatch_size``: sequences per microbatch; the count follows the per-rank batch.
        fixed: the product of the fixed degrees (tp x pp), to name world sizes in the error.

    >>> split_batch(12, 3, microbatch_size=2)
    (4, 2)
    """
    per_rank, rest = divmod(global_batch, dp_size)
    if rest == 0 and _fits(per_rank, microbatches, microbatch_size):
        return per_rank, (per_rank // microbatch_size if microbatch_size else microbatches)
    unit = f"elastic.microbatch_size={microbatch_size}" if microbatch_size else f"training.microbatches={microbatches}"
    ok = world_sizes_for(global_batch, microbatches=microbatches, microbatch_size=microbatch_size, fixed=fixed)
    raise BatchSplitError(
        f"training.batch_size={global_batch} must split evenly over {dp_size} data-parallel ranks x {unit} "
        f"(world size {dp_size * fixed}); "
        + (
            f"world sizes that keep it: {', '.join(map(str, ok))}; or use a "
            if ok
            else f"no world size keeps it with {unit}; use a "
        )
        + f"batch_size that is a multiple of {dp_size * (microbatch_size or microbatches)}"
    )
