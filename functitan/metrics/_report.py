"""A picture of one or more runs: ``functitan report RUN_DIR ...`` -> a PNG and a self-contained HTML page.

Reads each run's ``metrics.jsonl`` (one record per log step, written by `JsonlSink`), draws eight panels
(loss raw and smoothed, and the eval loss of runs with [eval], lr, grad norm, tokens/s, TFLOP/s, MFU, peak memory, data time per step) with every
run overlaid, and a summary table (steps, final loss, final eval loss, median tokens/s, median MFU, peak memory). The HTML
page holds the same image inline (base64) plus the table and the config keys in which the runs differ: one
file, no network, opens anywhere.

    >>> runs = [load_run("runs/a"), load_run("runs/b")]    # doctest: +SKIP
    >>> write_report(runs, "runs/report")                    # runs/report.png, runs/report.html  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import UserError

__all__ = ["Run", "ReportError", "load_run", "summarize", "smooth", "render_png", "render_html", "write_report"]

FIGSIZE = (14.0, 17.0)  # inches; at DPI this is the PNG's size in pixels
DPI = 100
MEMORY_KEYS = ("mem_max_reserved_gib", "mem_max_rss_gib", "mem_max_rss_since_start_gib")  # first present wins
# (title, y label, metric key); the loss panel is drawn separately (raw + smoothed)
PANELS = (
    ("learning rate", "lr", "lr"),
    ("gradient norm", "global L2 norm", "grad_norm"),
    ("throughput", "tokens/s (global)", "tokens_per_s"),
    ("achieved TFLOP/s", "TFLOP/s per device", "tflops"),
    ("MFU", "% of peak", "mfu"),
    ("peak memory", "GiB", None),  # None: the memory key of the run (MEMORY_KEYS)
    ("data time", "s per step", "data_time_s"),
)


class ReportError(UserError):
    """A run directory that cannot be reported (missing, no metrics, unreadable line)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's metrics: ``records`` are the JSONL objects in step order; ``config`` its config.json or {}."""

    name: str
    path: str
    records: tuple[dict[str, Any], ...]
    config: dict[str, Any]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the records that have a number for it."""
        pts = [(r["step"], float(r[key])) for r in self.records if isinstance(r.get(key), (int, float))]
        return [s for s, _ in pts], [v for _, v in pts]

    @property
    def memory_key(self) -> str | None:
        return next((k for k in MEMORY_KEYS if any(k in r for r in self.records)), None)


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read ``RUN_DIR/metrics.jsonl`` (and ``config.json`` when present).

    Raises:
        ReportError: the folder does not exist, holds no metrics.jsonl, or it has no record or a bad line.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"{path}: no such run directory; pass a folder under runs/ (e.g. runs/llama-20260101-120000)")
    file = path / "metrics.jsonl"
    if not file.is_file():
        raise ReportError(f"{file}: not found; a run directory holds the metrics.jsonl that `functitan train` writes")
    records: dict[int, dict[str, Any]] = {}
    with open(file, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError) as e:
                raise ReportError(
                    f"{file}:{i}: not a metrics record ({e}); expected a JSON object with a 'step'"
                ) from None
            records[step] = record  # a resumed run appends: the last record of a step wins
    if not records:
        raise ReportError(f"{file}: no metrics yet; the first record is written at the first log step")
    config: dict[str, Any] = {}
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except ValueError:
            config = {}
    name = path.resolve().name
    return Run(name=name, path=str(path), records=tuple(records[s] for s in sorted(records)), config=config)


def smooth(values: Sequence[float], weight: float = 0.8) -> list[float]:
    """TensorBoard's debiased exponential moving average; ``weight`` 0 returns the values unchanged."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must lie in [0, 1), got {weight}")
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        avg = weight * avg + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(avg / norm)
    return out


def _median(run: Run, key: str) -> float | None:
    _, values = run.series(key)
    return statistics.median(values) if values else None


def summarize(run: Run) -> dict[str, Any]:
    """The summary row of a run: steps, final loss, median tokens/s, median MFU, peak memory (GiB)."""
    _, losses = run.series("loss")
    mem_key = run.memory_key
    _, mem = run.series(mem_key) if mem_key else ([], [])
    return {
        "run": run.name,
        "steps": run.records[-1]["step"],
        "final loss": losses[-1] if losses else None,
        "final eval loss": evals[-1] if (evals := run.series("eval/loss")[1]) else None,
        "median tokens/s": _median(run, "tokens_per_s"),
        "median MFU %": _median(run, "mfu"),
        "peak memory GiB": max(mem) if mem else None,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def _figure(runs: Sequence[Run], smoothing: float):
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("functitan report needs matplotlib: pip install 'functitan[plot]'") from None
    fig = plt.figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(5, 2, height_ratios=[1, 1, 1, 1, 0.55])
    axes = [fig.add_subplot(grid[r, c]) for r in range(4) for c in range(2)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        steps, loss = run.series("loss")
        axes[0].plot(steps, loss, color=color, alpha=0.3, linewidth=1)
        axes[0].plot(steps, smooth(loss, smoothing), color=color, linewidth=2, label=run.name)
        if run.series("eval/loss")[0]:  # [eval]: the held-out loss at its steps
            axes[0].plot(*run.series("eval/loss"), color=color, linestyle="--", marker="o", markersize=4)
        for ax, (_, _, key) in zip(axes[1:], PANELS):
            key = key or run.memory_key
            if key:
                ax.plot(*run.series(key), color=color, linewidth=1.5, label=run.name)
    axes[0].set_title(f"loss (faint: raw; bold: smoothed, weight {smoothing}; dashed: eval)")
    axes[0].set_ylabel("cross-entropy")
    for ax, (title, ylabel, _key) in zip(axes[1:], PANELS):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if not ax.lines:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="upper right")
    table_ax = fig.add_subplot(grid[4, :])
    table_ax.axis("off")
    rows = [summarize(r) for r in runs]
    cols = list(rows[0])
    table = table_ax.table(
        cellText=[[_fmt(r[c]) for c in cols] for r in rows], colLabels=cols, loc="upper center", cellLoc="center"
    )
    table.auto_set_font_size(False)
    table.set_fontsize(11)
    table.scale(1, 1.6)
    for i in range(len(runs)):  # colour each run's name like its lines
        table[i + 1, 0].get_text().set_color(colors[i % len(colors)])
    table_ax.set_title("summary")
    fig.suptitle("functitan report: " + ", ".join(r.name for r in runs), fontsize=14)
    return fig


def render_png(runs: Sequence[Run], *, smoothing: float = 0.8) -> bytes:
    """The report image as PNG bytes, ``FIGSIZE * DPI`` pixels."""
    if not runs:
        raise ReportError("no runs to report; pass at least one run directory")
    fig = _figure(runs, smoothing)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _config_diff(runs: Sequence[Run]) -> dict[str, list[Any]]:
    """The config keys whose values differ between runs (run name and folder aside)."""
    flats = [_flat(r.config) for r in runs]
    keys = sorted(set().union(*flats))
    diff = {k: [f.get(k) for f in flats] for k in keys if len({json.dumps(f.get(k)) for f in flats}) > 1}
    return {k: v for k, v in diff.items() if k not in ("metrics.run_name", "metrics.run_dir")}


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;background:#fff}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:.3em .8em;text-align:right}
th{background:#f3f3f3}td:first-child{text-align:left}img{max-width:100%;height:auto}code{background:#f3f3f3}"""


def render_html(runs: Sequence[Run], png: bytes) -> str:
    """A self-contained page: the summary table, the config keys that differ, the image inline (base64)."""
    rows = [summarize(r) for r in runs]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>functitan report</title><style>{_STYLE}</style>",
        "</head><body><h1>functitan report</h1>",
        "<ul>"
        + "".join(
            f"<li><b>{html.escape(r.name)}</b>: <code>{html.escape(r.path)}</code>, {len(r.records)} log records</li>"
            for r in runs
        )
        + "</ul>",
        "<h2>Summary</h2>",
        _table(list(rows[0]), [list(r.values()) for r in rows]),
    ]
    diff = _config_diff(runs)
    if len(runs) > 1:
        parts.append("<h2>Config keys that differ</h2>")
        parts.append(
            _table(["key", *(r.name for r in runs)], [[k, *v] for k, v in diff.items()])
            if diff
            else "<p>none: the runs share every config key</p>"
        )
    b64 = base64.b64encode(png).decode("ascii")
    parts.append(f"<h2>Curves</h2><img alt='training curves' src='data:image/png;base64,{b64}'></body></html>")
    return "\n".join(parts)


def write_report(runs: Sequence[Run], out: str | os.PathLike, *, smoothing: float = 0.8) -> tuple[Path, Path]:
    """Write ``OUT.png`` and ``OUT.html``; returns both paths."""
    png = render_png(runs, smoothing=smoothing)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png_path, html_path = out.with_name(out.name + ".png"), out.with_name(out.name + ".html")
    png_path.write_bytes(png)
    html_path.write_text(render_html(runs, png), encoding="utf-8")
    return png_path, html_path
