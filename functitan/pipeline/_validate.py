"""Check that a schedule is complete, ordered, and runs without deadlock.

`validate` raises ValueError naming the rank, the action index and the broken dependency, so a
hand-written (CSV) schedule can be fixed from the message alone. The deadlock check runs
`walk`, the same dependency-driven execution that `simulate` and `with_comms` use.
"""

from __future__ import annotations

from functitan.pipeline._schedule import KINDS, Action, Schedule, dependencies, split_pairs, walk

Where = dict[Action, tuple[int, int]]  # action -> (rank, index in that rank's list)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_header(s: Schedule) -> None:
    for key in ("pp", "stages_per_rank", "microbatches"):
        if not _is_count(getattr(s, key)):
            raise ValueError(f"schedule {s.name!r}: {key} must be a positive int, got {getattr(s, key)!r}")
    if len(s.stage_to_rank) != s.pp * s.stages_per_rank:
        raise ValueError(
            f"schedule {s.name!r}: stage_to_rank has {len(s.stage_to_rank)} entries, expected "
            f"pp * stages_per_rank = {s.pp * s.stages_per_rank}"
        )
    for rank in range(s.pp):
        held = s.stages_of(rank)
        if len(held) != s.stages_per_rank:
            raise ValueError(
                f"schedule {s.name!r}: rank {rank} holds stages {held} in stage_to_rank, expected "
                f"stages_per_rank={s.stages_per_rank} of them"
            )
    if len(s.actions) != s.pp:
        raise ValueError(f"schedule {s.name!r}: actions has {len(s.actions)} rows, expected one per rank (pp={s.pp})")


def _index(s: Schedule) -> Where:
    where: Where = {}
    for rank, row in enumerate(s.actions):
        for i, a in enumerate(row):
            at = f"schedule {s.name!r}: rank {rank}, action {i} ({a!r})"
            if a.kind not in KINDS:
                raise ValueError(f"{at}: kind must be one of {KINDS}")
            if not (isinstance(a.stage, int) and 0 <= a.stage < s.num_stages):
                raise ValueError(f"{at}: stage must be an int in [0, {s.num_stages})")
            if not (isinstance(a.microbatch, int) and 0 <= a.microbatch < s.microbatches):
                raise ValueError(f"{at}: microbatch must be an int in [0, {s.microbatches})")
            if s.stage_to_rank[a.stage] != rank:
                raise ValueError(
                    f"{at}: stage {a.stage} lives on rank {s.stage_to_rank[a.stage]} (stage_to_rank); "
                    f"move the action to that rank's list"
                )
            if a in where:
                raise ValueError(f"{at}: duplicate of action {where[a][1]} on the same rank; remove one")
            where[a] = (rank, i)
    return where


def _check_complete(s: Schedule, where: Where) -> None:
    for stage in range(s.num_stages):
        rank = s.stage_to_rank[stage]
        for mb in range(s.microbatches):
            have = {k for k in KINDS if Action(k, stage, mb) in where}
            head = f"schedule {s.name!r}: rank {rank}"
            if "F" not in have:
                raise ValueError(f"{head}: no F for stage {stage}, microbatch {mb}; add {Action('F', stage, mb)}")
            if "BW" in have and have & {"B", "W"}:
                i = where[Action("BW", stage, mb)][1]
                raise ValueError(
                    f"{head}, action {i} ({Action('BW', stage, mb)}): stage {stage} microbatch {mb} also has a "
                    f"split B/W; use either BW or B then W"
                )
            if "B" in have and "W" not in have:
                i = where[Action("B", stage, mb)][1]
                raise ValueError(
                    f"{head}, action {i} ({Action('B', stage, mb)}): no W for it; add {Action('W', stage, mb)} "
                    f"after index {i}"
                )
            if "W" in have and "B" not in have:
                i = where[Action("W", stage, mb)][1]
                raise ValueError(
                    f"{head}, action {i} ({Action('W', stage, mb)}): no B before it; add {Action('B', stage, mb)}"
                )
            if not have & {"B", "BW"}:
                raise ValueError(
                    f"{head}: no backward for stage {stage}, microbatch {mb}; add {Action('BW', stage, mb)} "
                    f"(or B and W) after {Action('F', stage, mb)}"
                )


def _check_local_order(s: Schedule, where: Where, split: frozenset[tuple[int, int]]) -> None:
    for rank, row in enumerate(s.actions):
        for i, a in enumerate(row):
            for dep in dependencies(a, s.num_stages, split):
                dep_rank, j = where[dep]
                if dep_rank == rank and j > i:
                    raise ValueError(
                        f"schedule {s.name!r}: rank {rank}, action {i} ({a}) needs {dep}, which comes later "
                        f"on the same rank (action {j}); move it after index {j}"
                    )


def _deadlock_message(s: Schedule, where: Where, split: frozenset[tuple[int, int]], pos: list[int]) -> str:
    # Follow "waits for" edges from the first stuck rank until a rank repeats: that is the cycle.
    rank = next(r for r in range(s.pp) if pos[r] < len(s.actions[r]))
    seen: list[int] = []
    parts = []
    while rank not in seen:
        seen.append(rank)
        a = s.actions[rank][pos[rank]]
        dep = next(
            d
            for d in dependencies(a, s.num_stages, split)
            if where[d][1] >= pos[where[d][0]]  # not run yet
        )
        dep_rank, j = where[dep]
        parts.append(f"rank {rank}, action {pos[rank]} ({a}) waits for {dep} (rank {dep_rank}, action {j})")
        rank = dep_rank
    return f"schedule {s.name!r}: deadlock: " + "; ".join(parts) + "; reorder one of these ranks' lists"


def validate(schedule: Schedule) -> Schedule:
    """Check that `schedule` is complete, correctly ordered, and deadlock-free; return it unchanged.

    Checks, in order: the header (counts, stage_to_rank gives each rank `stages_per_rank` stages, one
    action row per rank); every action is well formed, on the rank that holds its stage, and unique;
    every (stage, microbatch) has one F and one backward (BW, or B and W); on one rank a dependency
    comes first (F before its B/BW, B before its W, and the cross-stage ones below when both stages
    share the rank); and across ranks, executing each list in order, where F of stage s waits for F
    of s-1 and the backward of s waits for the backward of s+1, finishes (no deadlock). Sends never
    block in the execution model (see `with_comms`), so this is also the send/recv deadlock check.

    Raises:
        ValueError: naming the rank, the action index and the broken dependency.
    """
    _check_header(schedule)
    where = _index(schedule)
    _check_complete(schedule, where)
    split = split_pairs(schedule)
    _check_local_order(schedule, where, split)
    pos = walk(schedule, lambda *_: None)
    if any(p < len(row) for p, row in zip(pos, schedule.actions)):
        raise ValueError(_deadlock_message(schedule, where, split, pos))
    return schedule
