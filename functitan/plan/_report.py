"""The plan on the console, as a runnable TOML config, and as a PNG of the top candidates' breakdowns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import to_toml
from ..job_config import JobConfig

__all__ = ["table", "write_toml", "render_png"]

_GIB = float(1 << 30)


def table(plan: Any, usable: float | None = None) -> str:
    """The traced rows, best first: peak, formula, headroom (usable memory left free), fit, step time."""
    usable = usable or plan.usable
    w = max([44, *(len(r.cand.label()) for r in plan.rows)])
    head = (
        f"{'#':>2}  {'layout':<{w}} {'peak GiB':>9} {'formula':>8} {'headroom':>14} {'fits':>5} {'step s':>9} "
        f"{'tok/s':>10} {'MFU':>5} {'bubble':>6} {'comm':>5}"
    )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(plan.rows, 1):
        a = r.analytic["total"]
        flag = "!" if abs(a - r.peak) > 0.1 * r.peak else " "
        free = usable - r.peak
        fit = "yes" if r.fits else ("tight" if free >= 0 else "NO")
        lines.append(
            f"{i:>2}  {r.cand.label():<{w}} {r.peak / _GIB:>9.2f} {a / _GIB:>7.2f}{flag} "
            f"{free / _GIB:>7.2f} {100 * free / usable:>5.1f}% {fit:>5} {r.time.total:>9.4g} "
            f"{r.time.tokens_per_s:>10.4g} {100 * r.time.mfu:>4.1f}% {100 * r.time.bubble:>5.1f}% "
            f"{100 * r.time.comm_exposed / r.time.total:>4.0f}%"
        )
    lines.append(
        f"peak: traced per-rank peak (worst rank); formula: the analytic estimate, '!' where it differs by "
        f"> 10%; headroom: GiB and % of the {usable / _GIB:.1f} GiB usable left free; fits: headroom >= the "
        f"{100 * plan.margin:g}% margin (tight: under it, never recommended); step times within "
        f"{100 * plan.tolerance:g}% are a tie, broken toward headroom"
    )
    best = plan.rows[0]
    lines.append(
        "recommended: "
        + best.cand.label()
        + "  (parts, GiB: "
        + ", ".join(f"{k} {v / _GIB:.2f}" for k, v in best.parts.items())
        + ")"
    )
    return "\n".join(lines)


def write_toml(cfg: JobConfig, path: str | Path) -> None:
    """Every [model], [training] and [parallelism] key, and the other keys that differ from the defaults, as
    ``functitan train --config`` reads them."""
    Path(path).write_text("# written by `functitan plan`\n" + to_toml(cfg, every_key_of=("training", "parallelism")))


def render_png(plan: Any, path: str | Path, top: int = 6) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan.rows[:top]
    labels = [r.cand.label() for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.6 * len(rows) + 2))
    left = [0.0] * len(rows)
    for part in ("params", "grads", "opt_state", "buffers", "activations"):
        vals = [r.parts[part] / _GIB for r in rows]
        ax1.barh(labels, vals, left=left, label=part)
        left = [a + b for a, b in zip(left, vals)]
    ax1.set_xlabel("GiB per rank (worst rank)")
    ax1.legend(fontsize=7)
    ax1.invert_yaxis()
    left = [0.0] * len(rows)
    for name, get in (
        ("compute", lambda r: r.time.compute),
        ("host (not overlapped)", lambda r: r.time.work - r.time.compute),
        ("bubble", lambda r: r.time.busy - r.time.work),
        ("exposed comm", lambda r: r.time.comm_exposed),
    ):
        vals = [get(r) for r in rows]
        ax2.barh(labels, vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    ax2.set_xlabel("seconds per step")
    ax2.set_yticklabels([])
    ax2.legend(fontsize=7)
    ax2.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
