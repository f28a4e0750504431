"""Generators for the standard pipeline schedules.

Each returns a `Schedule` for p ranks and m microbatches. The orders follow the papers and agree with
`torch.distributed.pipelining` (tests compare them action by action):

- GPipe (arXiv 1811.06965): all forwards, then all backwards. Bubble (p-1)/(m+p-1), m activations.
- 1F1B (PipeDream-Flush, arXiv 2006.09503): p-1-r warm-up forwards on rank r, then one forward, one
  backward; same bubble as GPipe, at most p-r activations in flight.
- Interleaved 1F1B (Megatron, arXiv 2104.04473): v stages per rank in loop placement; bubble (p-1)/(v m)
  relative to compute, v times the P2P traffic.
- ZB-H1 (Zero Bubble, arXiv 2401.10241): 1F1B with the backward split into B (input gradient) and W
  (weight gradient) and W deferred into the cool-down bubble; 1F1B memory, bubble about a third.
- ZB-V (same paper, section 6): two stages per rank in a V, near-zero bubble at 1F1B memory when
  f = b = w.
"""

from __future__ import annotations

from typing import Literal, get_args

from functitan.pipeline._schedule import Action, Schedule, loop_placement, v_placement


def _check_counts(name: str, **counts: int) -> None:
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {key} must be a positive int, got {value!r}")


def _frozen(rows: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(row) for row in rows)


def _single_stage(name: str, pp: int, m: int, rows: list[list[Action]]) -> Schedule:
    return Schedule(
        name=name, pp=pp, stages_per_rank=1, microbatches=m, stage_to_rank=loop_placement(pp, 1), actions=_frozen(rows)
    )


def gpipe(pp: int, m: int) -> Schedule:
    """GPipe: every rank runs F0..F(m-1), then BW0..BW(m-1)."""
    _check_counts("gpipe", pp=pp, microbatches=m)
    rows = [[Action("F", r, i) for i in range(m)] + [Action("BW", r, i) for i in range(m)] for r in range(pp)]
    return _single_stage("gpipe", pp, m, rows)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B: rank r runs min(p-1-r, m) warm-up forwards, then alternates F and BW, then drains BW."""
    _check_counts("1f1b", pp=pp, microbatches=m)
    rows = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        row = [Action("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [Action("F", r, warmup + i), Action("BW", r, i)]
        row += [Action("BW", r, i) for i in range(m - warmup, m)]
        rows.append(row)
    return _single_stage("1f1b", pp, m, rows)


def interleaved_1f1b(pp: int, v: int, m: int) -> Schedule:
    """Interleaved 1F1B in Megatron's order (the one torch's ScheduleInterleaved1F1B uses).

    Microbatches go in rounds of `per_round` (p when p divides m): rank r runs the k-th forward on its
    local chunk (k // per_round) % v for microbatch (k // (per_round v)) per_round + k % per_round, and
    the k-th backward on chunk v - 1 - (k // per_round) % v for the same microbatch formula. Warm-up is
    (v-1) per_round + 2 (p-1-r) forwards. Like torch, m need not be a multiple of p: rounds =
    max(1, m // p) and m must be a multiple of rounds.
    """
    _check_counts("interleaved_1f1b", pp=pp, stages_per_rank=v, microbatches=m)
    rounds = max(1, m // pp)
    if m % rounds:
        raise ValueError(
            f"interleaved_1f1b: microbatches={m} must be a multiple of the number of rounds "
            f"max(1, m // pp)={rounds}; use m <= pp or a multiple of pp={pp}"
        )
    per_round = m // rounds
    total = m * v

    def mb(k: int) -> int:
        return (k // (per_round * v)) * per_round + k % per_round

    rows = []
    for r in range(pp):
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - r), total)

        def fwd(k: int) -> Action:
            return Action("F", ((k // per_round) % v) * pp + r, mb(k))

        def bwd(k: int) -> Action:
            return Action("BW", (v - 1 - (k // per_round) % v) * pp + r, mb(k))

        row = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            row += [fwd(warmup + k), bwd(k)]
        row += [bwd(k) for k in range(total - warmup, total)]
        rows.append(row)
    return Schedule(
        name="interleaved_1f1b",
        pp=pp,
        stages_per_rank=v,
        microbatches=m,
        stage_to_rank=loop_placement(pp, v),
        actions=_frozen(rows),
    )


def zb_h1(pp: int, m: int) -> Schedule:
    """ZB-H1: 1F1B order with B/W split; rank r defers its W's by r steps into the cool-down.

    Rank r warms up with min(p-1-r, m) forwards like 1F1B (so the same activation memory), then runs
    F, B per step; from its (r+1)-th backward on, each step also runs the oldest pending W. The W's it
    skipped at first fill the cool-down, where 1F1B would wait. With f = b = w the idle time per rank is
    p - 1 instead of 1F1B's 3 (p - 1).
    """
    _check_counts("zb_h1", pp=pp, microbatches=m)
    rows = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        row = [Action("F", r, i) for i in range(warmup)]
        next_w = 0
        for i in range(m):  # the i-th backward, with a forward before it while any are left
            if warmup + i < m:
                row.append(Action("F", r, warmup + i))
            row.append(Action("B", r, i))
            if i >= r:
                row.append(Action("W", r, next_w))
                next_w += 1
        row += [Action("W", r, i) for i in range(next_w, m)]
        rows.append(row)
    return _single_stage("zb_h1", pp, m, rows)


def zb_v(pp: int, m: int) -> Schedule:
    """ZB-V: rank r holds stages r and 2p-1-r; the handcrafted order of arXiv 2401.10241 section 6.

    Phases on rank r (chunk 0 = stage r, chunk 1 = stage 2p-1-r): 2(p-r)-1 forwards of chunk 0;
    r pairs (F chunk 1, F chunk 0); p-r triples (F chunk 1, B chunk 1, W chunk 1); a steady state of
    (F0, B0, W0, F1, B1, W1); a cool-down of r pairs (B0, B1), then p-r pairs (B0, W0); then the
    remaining W's. It is laid out for at least 2p-1 microbatches; for fewer, like torch, the actions
    of the missing microbatches are dropped.
    """
    _check_counts("zb_v", pp=pp, microbatches=m)
    n = max(2 * pp - 1, m)
    rows = []
    for r in range(pp):
        s0, s1 = r, 2 * pp - 1 - r
        count = {k: 0 for k in ("F0", "F1", "B0", "B1", "W0", "W1")}
        row: list[Action] = []

        def emit(*keys: str) -> None:
            for key in keys:
                kind, chunk = key[0], key[1]
                row.append(Action(kind, s0 if chunk == "0" else s1, count[key]))
                count[key] += 1

        for _ in range(2 * (pp - r) - 1):
            emit("F0")
        for _ in range(r):
            emit("F1", "F0")
        for _ in range(pp - r):
            emit("F1", "B1", "W1")
        while count["F1"] < count["F0"] or count["F0"] < n:
            if count["F0"] < n:
                emit("F0")
            emit("B0", "W0", "F1", "B1", "W1")
        for _ in range(r):
            emit("B0", "B1")
        for _ in range(pp - r):
            emit("B0", "W0")
        while count["W1"] < count["B1"]:
            emit("W1")
        while count["W0"] < count["B0"]:
            emit("W0")
        rows.append([a for a in row if a.microbatch < m])
    return Schedule(
        name="zb_v", pp=pp, stages_per_rank=2, microbatches=m, stage_to_rank=v_placement(pp), actions=_frozen(rows)
    )


ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"]
SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)  # one spelling for the config, the CLI and the code


def make_schedule(name: str, pp: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """The built-in schedule ``name`` (one of ``SCHEDULE_NAMES``); ``stages_per_rank`` is interleaved_1f1b's v
    (default 2; the other schedules fix it)."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"pipeline schedule {name!r} is unknown; choose one of {list(SCHEDULE_NAMES)}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, 2 if stages_per_rank is None else stages_per_rank, microbatches)
    if stages_per_rank is not None:
        raise ValueError(f"stages_per_rank applies to interleaved_1f1b only; {name} fixes it")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zb_v": zb_v}[name](pp, microbatches)
