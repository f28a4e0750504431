"""``functitan plan``: predict memory and step time of every layout of a model on a cluster; recommend one."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from .._command import CommandParser, config_flag, model_flags, run
from ..job_config import parse_model_args
from ._devices import DEVICES, Cluster, calibrate, device
from ._plan import MARGIN, MIN_TRACED, MOE_LOAD, PlanError, plan
from ._report import render_png, table, write_toml

__all__ = ["main"]

DESCRIPTION = """Predict per-rank peak memory (a real train step traced on meta tensors with a fake process group
at the target world size) and step time (alpha-beta collectives, FLOPs, pipeline bubble) of every valid
layout, and recommend the fastest that fits. Model fields: --model.<field>=value (e.g. --model.n_layers=8)."""


def _parser() -> CommandParser:
    p = CommandParser(
        "plan",
        description=DESCRIPTION,
        examples="example:\n  functitan plan --model.flavor llama3_8b --nodes 8 --device h100 --out plan.toml\n"
        "  functitan train --config plan.toml",
    )
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node")
    p.add_argument("--device", default="h100", help=f"one of {sorted(DEVICES)}")
    p.add_argument(
        "--global-batch-tokens", type=int, default=None, help="tokens per step (default: 8 sequences per device)"
    )
    config_flag(p, "training.seq_len", default=None, note="default 8192, 256 on cpu, at most model.max_seq_len")
    p.add_argument(
        "--top",
        type=int,
        default=MIN_TRACED,
        help=f"how many fitting candidates to show; at least {MIN_TRACED} are traced, so a smaller --top recommends "
        "the same layout, and a larger one traces more and may find a faster one",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=MARGIN,
        help=f"fraction of usable memory a recommended layout leaves free (default {MARGIN:g}: fragmentation, spikes)",
    )
    p.add_argument(
        "--moe-load",
        type=float,
        default=MOE_LOAD,
        help=f"under expert parallelism, the busiest rank's routed tokens over the mean (default {MOE_LOAD:g}; "
        "1: perfectly balanced routing)",
    )
    p.add_argument("--calibrate", action="store_true", help="measure this machine's matmul FLOP/s and gloo collectives")
    p.add_argument("--out", default=None, help="write the recommended config (functitan train --config FILE)")
    p.add_argument("--png", default=None, help="draw the memory and time breakdown of the top candidates")
    p.add_argument("--measure", type=int, default=0, metavar="N", help="train the top candidates N steps here, re-rank")
    model_flags(p)
    return p


def _check_writable(flag: str, path: Path) -> None:
    """``path`` can be written: its folder exists (or can be made) and takes a file."""
    if path.is_dir():
        raise PlanError(f"{flag} {path}: is a directory; pass a file name, e.g. {flag} {path / 'plan.toml'}")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".functitan-plan-"):
            pass
    except OSError as e:
        raise PlanError(
            f"{flag} {path}: cannot write in {folder} ({e.strerror or e}); pick a writable folder"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``functitan plan``; bad input is one line and exit 2 (functitan.errors; ``--debug`` shows its traceback)."""
    return run(argv, _plan_cli)


def _plan_cli(argv: list[str]) -> int:
    model, rest = parse_model_args(argv)
    args = _parser().parse_args(rest)
    if args.measure and args.device.lower() != "cpu":  # before any work: it would fail after the whole plan
        raise PlanError(
            f"--measure {args.measure} trains the top layouts here, on this machine's CPU (gloo); a plan for "
            f"--device {args.device} cannot run on it: drop --measure, or plan for --device cpu"
        )
    dev = device(args.device)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise PlanError(f"--nodes={args.nodes} --gpus-per-node={args.gpus_per_node}: both must be >= 1")
    if args.global_batch_tokens is not None and args.global_batch_tokens < 1:  # 0 was taken as the default
        raise PlanError(f"--global-batch-tokens={args.global_batch_tokens}: must be >= 1 (omit it for the default)")
    if args.measure < 0:
        raise PlanError(f"--measure={args.measure}: the steps to train each top candidate, >= 1 (0: no measure)")
    for flag, path in (("--out", args.out), ("--png", args.png)):
        if path:
            _check_writable(flag, Path(path))  # before planning, not after it (40 s of work lost)
    if args.calibrate:
        dev = calibrate(dev, processes=max(2, min(args.nodes * args.gpus_per_node, 8)))
    cluster = Cluster(device=dev, nodes=args.nodes, per_node=args.gpus_per_node)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tracing is single-threaded Python: one core
    try:
        result = plan(
            model_name=model.name,
            flavor=model.flavor,
            overrides=dict(model.overrides),
            cluster=cluster,
            global_batch_tokens=args.global_batch_tokens,
            seq_len=args.seq_len,
            top=args.top,
            margin=args.margin,
            moe_load=args.moe_load,
            log=lambda line: print(line, flush=True),  # progress while it traces
        )
    finally:
        torch.set_num_threads(threads)
    print("assumptions:")
    for a in result.assumptions:
        print(f"  {a}")
    print(f"{result.screened} valid layouts; {result.over_memory} over memory by formula; pruned families:")
    for reason, n in sorted(result.pruned.items()):
        print(f"  {reason} ({n})")
    print(table(result))
    if args.measure:
        from ._measure import measure

        result, measured = measure(result, steps=args.measure, world=cluster.world)
        print("re-ranked by measured step time on this machine:")
        for r in result.rows[: len(measured)]:
            print(f"  {r.cand.label():<44} predicted {r.time.total:.4g} s, measured {measured[r.cand.label()]:.4g} s")
    print(f"planned in {result.seconds:.1f} s ({result.cpu_seconds:.1f} s CPU)")
    if args.out:
        write_toml(result.cfg, args.out)
        print(
            f"wrote {args.out}: functitan train --config {args.out}"
            + (f" --nproc {cluster.world}" if cluster.world > 1 else "")
        )
    if args.png:
        render_png(result, args.png)
        print(f"wrote {args.png}")
    return 0
