"""`functitan pipeline show`: print a schedule's timeline and bubble, optionally draw it to a PNG.

functitan pipeline show --schedule zb_v --pp 4 --microbatches 8 --costs 1,1,1,0 --out timeline.png
functitan pipeline show --csv my_schedule.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

from functitan._command import CommandParser, config_flag, run
from functitan.errors import UserError, unknown_command
from functitan.pipeline._csvfile import load_csv
from functitan.pipeline._generators import make_schedule
from functitan.pipeline._render import render_png, render_text, summary
from functitan.pipeline._schedule import Schedule
from functitan.pipeline._simulate import Costs, simulate

EXAMPLE = """example:
  functitan pipeline show --schedule 1f1b --pp 4 --microbatches 8
  functitan pipeline show --schedule zb_v --pp 4 --microbatches 8 --costs 1,1,1,0 --out timeline.png
  functitan pipeline show --csv my_schedule.csv
"""


def _costs(text: str) -> Costs:
    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 4 or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected four non-negative numbers f,b,w,p2p like 1,1,1,0; got {text!r}")
    return Costs(*(int(v) if v.is_integer() else v for v in values))


def _parser() -> CommandParser:
    parser = CommandParser("pipeline", description="Pipeline schedules as data.", examples=EXAMPLE)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser(
        "show", help="print a schedule's timeline and bubble fraction; --out draws a PNG", epilog=EXAMPLE
    )
    source = show.add_mutually_exclusive_group(required=True)
    config_flag(source, "parallelism.pipeline_schedule", default=None, also=["--schedule"], dest="schedule")
    source.add_argument("--csv", help="a custom schedule (torch's compute-only CSV format, one row per rank)")
    config_flag(show, "parallelism.pp", default=4)
    config_flag(show, "training.microbatches", default=8)
    config_flag(show, "parallelism.stages_per_rank", default=None, note="default 2 there")
    show.add_argument("--costs", type=_costs, default=Costs(), help="f,b,w,p2p per action (default 1,1,1,0)")
    show.add_argument("--out", help="write the timeline as a PNG here (needs matplotlib)")
    return parser


def _build(args: argparse.Namespace) -> Schedule:
    if args.csv:
        return load_csv(args.csv)
    if args.stages_per_rank is not None and args.schedule != "interleaved_1f1b":
        raise ValueError(f"--stages-per-rank applies to --schedule interleaved_1f1b only; {args.schedule} fixes it")
    if args.pp * args.microbatches > MAX_CELLS:  # bounded before any list is built: 1e5 x 1e5 took 6.9 GB and more
        raise ValueError(
            f"--pp {args.pp} --microbatches {args.microbatches}: {args.pp * args.microbatches} rank-microbatches is "
            f"more than the {MAX_CELLS} a timeline shows; lower --pp or --microbatches (e.g. --pp 8 --microbatches 32)"
        )
    return make_schedule(args.schedule, args.pp, args.microbatches, args.stages_per_rank)


MAX_CELLS = 2**14  # pp x microbatches: a zb_v timeline of 64 x 256 prints in ~4 s


def main(argv: list[str]) -> int:
    """Run `functitan pipeline ARGV...`; returns the exit status (0 ok, 2 bad input)."""
    if argv and not argv[0].startswith("-") and argv[0] != "show":
        return unknown_command("functitan pipeline", argv[0], ["show"])
    return run(argv, _show)


def _show(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    schedule = _build(args)
    sim = simulate(schedule, args.costs)
    print(render_text(schedule, sim))
    print(summary(schedule, sim))
    print(f"bubble fraction: {float(sim.bubble_fraction):.4f}")
    if args.out:  # like `report --out` and `plan --png`: a missing folder is made
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        try:
            render_png(schedule, sim, args.out)
        except ImportError as e:  # matplotlib: the plot extra
            raise UserError(f"--out {args.out}: {e}") from e
        print(f"wrote {args.out}")
    return 0
