"""Simulator costs measured from the executor's timelines: what a schedule costs on this machine.

Why: a simulation with compute durations only (``p2p = 0``) leaves out what the executor pays between them,
the latency of each point-to-point transfer and the host time spent posting it, so its bubble fraction
undershoots the measured idle time, the more so the more often a schedule crosses ranks (ZB-V, interleaved).
`fit_costs` reads those two from the spans themselves, so a replay of a schedule in `simulate` includes them
with no per-schedule factor.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from functitan.pipeline._executor import StepTimeline
from functitan.pipeline._schedule import Schedule, dependencies, split_pairs
from functitan.pipeline._simulate import Costs

__all__ = ["fit_costs"]

_WAITED = 1e-5  # a consumer that waited longer than this (seconds) started when its tensor arrived


def fit_costs(schedule: Schedule, timelines: Sequence[Sequence[StepTimeline]]) -> Costs:
    """`Costs` of ``schedule`` from measured steps: ``timelines[rank][step]`` (`pipeline_grad_fn(timeline=)`).

    - ``f``, ``b``, ``w``: per stage, the median wall time of its F, B (or BW, as b with w = 0) and W actions.
    - ``p2p``: the median latency of a cross-rank dependency, from the producer's end to the consumer's start,
      over the consumers that were already waiting for the tensor when the producer ended (they started when
      it arrived). The span clocks (``time.perf_counter``) must be comparable across ranks: one host.
    - ``overhead``: the mean host time before an action that is neither compute nor waiting for a receive
      (from the step's start, or the previous action's end, to the start of the wait).

    Raises:
        ValueError: if the timelines do not hold one list per rank of ``schedule``, or hold no spans.
    """
    if len(timelines) != schedule.pp:
        raise ValueError(f"fit_costs: got timelines of {len(timelines)} ranks, the schedule has pp={schedule.pp}")
    durations: dict[tuple[str, int], list[float]] = {}
    gaps: list[float] = []
    for steps in timelines:
        for step in steps:
            prev = step.start
            for sp in step.spans:
                durations.setdefault((sp.action.kind, sp.action.stage), []).append(sp.end - sp.start)
                gaps.append(max(0.0, sp.start - sp.wait - prev))
                prev = sp.end
    if not gaps:
        raise ValueError("fit_costs: the timelines hold no spans; run pipeline_grad_fn(stages, timeline=...) first")
    med = {k: statistics.median(v) for k, v in durations.items()}
    n = schedule.num_stages
    return Costs(
        f=[med.get(("F", s), 0.0) for s in range(n)],
        b=[med.get(("B", s), med.get(("BW", s), 0.0)) for s in range(n)],
        w=[med.get(("W", s), 0.0) for s in range(n)],
        p2p=_p2p_latency(schedule, timelines),
        overhead=statistics.fmean(gaps),
    )


def _p2p_latency(schedule: Schedule, timelines: Sequence[Sequence[StepTimeline]]) -> float:
    split, rank_of = split_pairs(schedule), schedule.stage_to_rank
    samples = []
    for i in range(min(len(t) for t in timelines)):
        spans = {sp.action: sp for steps in timelines for sp in steps[i].spans}
        for action, sp in spans.items():
            if sp.wait <= _WAITED:
                continue
            for dep in dependencies(action, schedule.num_stages, split):
                if dep not in spans:
                    continue
                # only a consumer already waiting when the producer ended times the link alone (one that got to
                # its receive later also timed its own lateness: gloo moves the data once both sides posted)
                if rank_of[dep.stage] != rank_of[action.stage] and sp.start - sp.wait <= spans[dep].end:
                    samples.append(sp.start - spans[dep].end)
    return statistics.median(samples) if samples else 0.0
