"""Pictures of a simulated schedule: an ASCII timeline and a matplotlib PNG."""

from __future__ import annotations

import math
import os

from functitan.pipeline._schedule import Action, Schedule
from functitan.pipeline._simulate import Simulation

# PNG colours per kind; the second stage a rank holds (v > 1) gets a lighter shade.
_COLORS = {"F": "#4C72B0", "B": "#DD8452", "BW": "#C44E52", "W": "#55A868"}


def _label(schedule: Schedule, a: Action) -> str:
    # With one stage per rank the stage is the rank; otherwise say which of its stages: F3 vs F3'.
    if schedule.stages_per_rank == 1:
        return f"{a.kind}{a.microbatch}"
    chunk = schedule.stages_of(schedule.stage_to_rank[a.stage]).index(a.stage)
    return f"{a.kind}{a.microbatch}" + "'" * chunk


def _check(schedule: Schedule, sim: Simulation) -> None:
    if [len(r) for r in sim.spans] != [len(r) for r in schedule.actions]:
        raise ValueError(
            f"render: the simulation has {[len(r) for r in sim.spans]} actions per rank, schedule "
            f"{schedule.name!r} has {[len(r) for r in schedule.actions]}; pass simulate(schedule, costs)"
        )


def render_text(schedule: Schedule, sim: Simulation, *, scale: float | None = None) -> str:
    """An ASCII timeline: one row per rank, time to the right, '.' where the rank idles.

    Each action is a block `[F3  ]` whose width is proportional to its duration; `F3` is forward of
    microbatch 3, `B`/`W` the split backward, `BW` the full backward, and a trailing `'` marks a rank's
    second stage (`''` its third). `scale` is characters per time unit; by default the shortest
    action is just wide enough for its label.

    For 1F1B, p=2, m=2, f=b=w=1 (so 5 characters per time unit)::

        rank 0 |[F0 ][F1 ]..........[BW0     ].....[BW1     ]
        rank 1 |.....[F0 ][BW0     ][F1 ][BW1     ]..........
    """
    _check(schedule, sim)
    durations = [e - s for row in sim.spans for s, e in row if e > s]
    labels = [_label(schedule, a) for row in schedule.actions for a in row]
    if scale is None:
        shortest = min(durations, default=1)
        scale = (max(map(len, labels), default=1) + 2) / shortest
    width = math.ceil(sim.makespan * scale)
    lines = []
    for rank, (row, spans) in enumerate(zip(schedule.actions, sim.spans)):
        cells = ["."] * width
        for a, (start, end) in zip(row, spans):
            lo, hi = round(start * scale), round(end * scale)
            text = _label(schedule, a)
            block = f"[{text.ljust(hi - lo - 2)}]" if hi - lo >= len(text) + 2 else text.ljust(hi - lo)[: hi - lo]
            cells[lo:hi] = block
        lines.append(f"rank {rank:<{len(str(schedule.pp - 1))}} |" + "".join(cells))
    return "\n".join(lines)


def summary(schedule: Schedule, sim: Simulation) -> str:
    """One line: schedule name, sizes, makespan and bubble fraction."""
    return (
        f"{schedule.name}: pp={schedule.pp} stages_per_rank={schedule.stages_per_rank} "
        f"microbatches={schedule.microbatches} makespan={float(sim.makespan):g} "
        f"bubble={float(sim.bubble_fraction):.4f}"
    )


def render_png(schedule: Schedule, sim: Simulation, path: str | os.PathLike) -> None:
    """Draw the timeline with matplotlib and write it to `path` (PNG).

    Needs the optional extra `functitan[plot]` (matplotlib). Uses the Agg canvas directly, so no
    display and no global pyplot state is touched.

    Raises:
        ImportError: if matplotlib is not installed, saying how to install it.
    """
    _check(schedule, sim)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import to_rgb
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "render_png needs matplotlib, which is not installed; run `pip install 'functitan[plot]'` "
            "(or `pip install matplotlib`), or use render_text"
        ) from e

    makespan = float(sim.makespan) or 1.0
    fig = Figure(figsize=(max(6.0, min(24.0, 0.25 * len(max(schedule.actions, key=len)))), 0.5 * schedule.pp + 1.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for rank, (row, spans) in enumerate(zip(schedule.actions, sim.spans)):
        for a, (start, end) in zip(row, spans):
            chunk = schedule.stages_of(rank).index(a.stage)
            base = to_rgb(_COLORS[a.kind])
            color = tuple(c + (1 - c) * 0.45 * chunk / max(1, schedule.stages_per_rank - 1) for c in base)
            bar = [(float(start), float(end - start))]
            ax.broken_barh(bar, (rank - 0.4, 0.8), facecolors=color, edgecolors="white")
            if (end - start) / makespan > 0.012:  # label the microbatch where it fits
                mid = float(start + end) / 2
                ax.text(mid, rank, str(a.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time" + (" (lighter: a rank's later stage)" if schedule.stages_per_rank > 1 else ""))
    ax.set_title(summary(schedule, sim), fontsize=9)
    kinds = sorted({a.kind for row in schedule.actions for a in row}, key=list(_COLORS).index)
    handles = [Patch(color=_COLORS[k], label=k) for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=120)
