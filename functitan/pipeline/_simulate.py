"""Time a schedule with per-action costs: makespan, per-rank busy/idle time and the bubble fraction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from numbers import Real
from typing import NamedTuple

from functitan.pipeline._schedule import Action, Schedule, walk
from functitan.pipeline._validate import validate

# ints, Fractions and floats for the type checker (an int is a float to it; `numbers.Real` has no arithmetic it
# can follow). At run time any `numbers.Real` is accepted: the checks below test isinstance(v, Real).
Number = float | Fraction
Cost = Number | Sequence[Number]  # one value for every stage, or one per stage


class Costs(NamedTuple):
    """Durations of one action on one microbatch, in any time unit.

    `f`, `b`, `w` may be one number or one per stage (first and last stages often cost more:
    embedding and head). A full backward "BW" costs b + w. `p2p` is added when a dependency crosses
    ranks (the latency from the producer's end to the consumer holding the tensor). `overhead` is the host
    time a rank spends before each action (posting its sends and receives, the executor's bookkeeping):
    the rank is not computing then, so it counts as idle. Ints and `fractions.Fraction`s keep the
    simulation exact. `fit_costs` measures all five from an executor's timeline.
    """

    f: Cost = 1
    b: Cost = 1
    w: Cost = 1
    p2p: Number = 0
    overhead: Number = 0


class Simulation(NamedTuple):
    """The timed run of a schedule.

    Attributes:
        makespan: time from the step's start (the first action starts after one `Costs.overhead`) to the
            last action's end.
        busy: per-rank time spent computing.
        idle: per-rank makespan - busy (warm-up, bubbles and cool-down together).
        bubble_fraction: sum(idle) / (pp * makespan).
        spans: ``spans[rank][i] = (start, end)`` of that rank's i-th action.
        peak_activations: per rank, the most (stage, microbatch) pairs whose F ran and whose B/BW has
            not, a proxy for activation memory (W keeps only what the weight gradient needs).
    """

    makespan: Number
    busy: tuple[Number, ...]
    idle: tuple[Number, ...]
    bubble_fraction: Number
    spans: tuple[tuple[tuple[Number, Number], ...], ...]
    peak_activations: tuple[int, ...]


def _per_stage(name: str, value: Cost, num_stages: int) -> tuple[Number, ...]:
    values = tuple(value) if isinstance(value, Sequence) else (value,) * num_stages
    if len(values) != num_stages:
        raise ValueError(f"Costs.{name}: got {len(values)} per-stage values, the schedule has {num_stages} stages")
    for v in values:
        if not isinstance(v, Real) or v < 0:
            raise ValueError(f"Costs.{name}: costs must be non-negative numbers, got {v!r}")
    return values


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most microbatches whose activations are held at once (F adds one, B or BW frees it)."""
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            live += {"F": 1, "B": -1, "BW": -1}.get(a.kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def simulate(
    schedule: Schedule,
    costs: Costs = Costs(),
    *,
    durations: Mapping[Action, Number] | None = None,
    validated: bool = False,
) -> Simulation:
    """Run `schedule` on an idealized machine and time it.

    Each rank runs its list in order; an action starts when its rank is free (plus `costs.overhead`) and
    its dependencies (see `dependencies`) have finished, plus `costs.p2p` for a dependency on another
    rank. Sends never block. This is the event-driven timing of the schedule, computed as a longest path.

    With f = b = w = 1 (so BW = 2) and p2p = 0, 1F1B gives a bubble of exactly (p-1)/(m+p-1) and
    ZB-H1 an idle time per rank a third of 1F1B's.

    ``durations`` gives single actions their own duration (over `costs`): a measured step replayed action by
    action, so its idle time can be compared with the run's without the spread of durations averaged away.

    ``validated=True`` skips `validate` for a schedule that already passed it (the planner times hundreds of
    built-in schedules of up to 64 ranks, and validating one costs more than timing it).

    Raises:
        ValueError: if the schedule is invalid (see `validate`) or a cost is negative.
    """
    if not validated:
        validate(schedule)
    n = schedule.num_stages
    for name in ("p2p", "overhead"):
        value = getattr(costs, name)
        if not isinstance(value, Real) or value < 0:
            raise ValueError(f"Costs.{name}: must be a non-negative number, got {value!r}")
    f, b, w = (_per_stage(k, getattr(costs, k), n) for k in ("f", "b", "w"))
    duration = {"F": f, "B": b, "W": w, "BW": tuple(x + y for x, y in zip(b, w))}
    end: dict[Action, Number] = {}
    free: list[Number] = [0] * schedule.pp
    spans: list[list[tuple[Number, Number]]] = [[] for _ in range(schedule.pp)]

    given = durations or {}
    for action, value in given.items():
        if not isinstance(value, Real) or value < 0:
            raise ValueError(f"durations[{action}]: must be a non-negative number, got {value!r}")

    def run(rank: int, action: Action, deps: tuple[Action, ...]) -> None:
        ready = [end[d] + (costs.p2p if schedule.stage_to_rank[d.stage] != rank else 0) for d in deps]
        start = max([free[rank] + costs.overhead, *ready])
        took = given[action] if action in given else duration[action.kind][action.stage]
        free[rank] = end[action] = start + took
        spans[rank].append((start, end[action]))

    walk(schedule, run)
    makespan = max(free)  # from 0: the first action starts after one overhead (it has no dependencies)
    busy = tuple(sum(e - s for s, e in row) for row in spans)
    idle = tuple(makespan - x for x in busy)
    bubble = sum(idle) / (schedule.pp * makespan) if makespan else 0
    return Simulation(
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        spans=tuple(tuple(row) for row in spans),
        peak_activations=peak_activations(schedule),
    )
