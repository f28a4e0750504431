"""`functitan report RUN_DIR [RUN_DIR ...]`: the curves and a summary of runs, as a PNG and an HTML page."""

from __future__ import annotations

import os
from pathlib import Path

from functitan._command import CommandParser, run
from functitan.metrics._report import load_run, write_report

EXAMPLE = """example:
  functitan train --config configs/debug.toml --training.steps=30 --metrics.run_name=a
  functitan train --config configs/debug.toml --training.steps=30 --metrics.run_name=b --optimizer.lr=1e-3
  functitan report runs/a runs/b          # writes runs/report.png and runs/report.html
"""


def _parser() -> CommandParser:
    parser = CommandParser(
        "report",
        examples=EXAMPLE,
        description="Draw loss (raw and smoothed), lr, grad norm, tokens/s, TFLOP/s, MFU, memory and data time of "
        "one or more runs (overlaid) with a summary table, as a PNG and a self-contained HTML page.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run folder holding metrics.jsonl")
    parser.add_argument(
        "--out",
        help="output path without extension (default: RUN_DIR/report for one run, "
        "report in the runs' common parent folder for several)",
    )
    parser.add_argument("--smoothing", type=float, default=0.8, help="EMA weight of the smoothed loss, in [0, 1)")
    return parser


def default_out(run_dirs: list[str]) -> Path:
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report"
    return Path(os.path.commonpath([os.path.abspath(d) for d in run_dirs])) / "report"


def main(argv: list[str]) -> int:
    """Run ``functitan report ARGV...``; returns the exit status (0 ok, 2 bad input: one line, functitan.errors;
    ``--debug`` shows its traceback)."""
    return run(argv, _report)


def _report(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    runs = [load_run(d) for d in args.runs]  # ReportError, a UserError: one line
    png, page = write_report(runs, args.out or default_out(args.runs), smoothing=args.smoothing)
    print(f"wrote {png}\nwrote {page}")
    return 0
