"""``functitan train``'s command line, without torch: ``--nproc`` / ``--nnodes`` check the config and start
torchrun from here, so the launcher never pays torch's import (about 3 s on every launch); a worker, or a run on
one process, goes on into ``functitan.train``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._command import run
from .config import parse_config, to_toml
from .elastic import launch, parse_launch_args, watch_launcher
from .job_config import JobConfig

EXAMPLE = """examples:
  functitan train --config configs/debug.toml --training.steps=500 --optimizer.lr=1e-3
  functitan train --config configs/debug.toml --print-config > mine.toml   # what differs from the defaults
  functitan train --config mine.toml --dry-run          # build it all, print the banner, write nothing, exit
  functitan train --config configs/debug.toml --nproc 2 --parallelism.dp_shard=2      # FSDP on 2 processes
  functitan report runs/<run-name>                                                   # then look at it
"""


def main(argv: Sequence[str] | None = None, *, worker: Callable[..., int] | None = None) -> int:
    """``functitan train``; a user error is one line and exit code 2 on each failing rank (functitan.errors).

    ``worker(cfg, stepper=...)``: what trains the parsed config and returns the exit status
    (``functitan.train.train_config``, imported when needed; ``python -m functitan.train`` passes its own, so
    that module is not imported twice). The stepper is chosen here: the trainer imports nothing of elastic.

    ``--print-config``: the parsed config as TOML (the keys that differ from the defaults; ``--config`` reads it
    back to the same run), without importing torch. ``--dry-run``: everything up to the first step (mesh, data,
    model, placed state, optimizer) and the banner, on every rank of a launch; nothing is written."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)  # passed on to the workers

    def body(args: list[str]) -> int:
        print_config, dry_run = "--print-config" in args, "--dry-run" in args
        args = [a for a in args if a not in ("--print-config", "--dry-run")]
        spec, rest = parse_launch_args(args)
        if print_config:
            print(to_toml(parse_config(JobConfig, rest, epilog=EXAMPLE)), end="")
            return 0
        if spec is not None:
            # a bad value is reported once, before any process starts
            parse_config(JobConfig, rest, epilog=EXAMPLE).eval.check_data()
            return launch(spec, rest + (["--debug"] if debug else []) + (["--dry-run"] if dry_run else []))
        watch_launcher()  # a worker of `--nproc`: dies with the launcher, even when SIGKILL leaves it no word
        cfg = parse_config(JobConfig, args, epilog=EXAMPLE)
        cfg.eval.check_data()
        if worker is not None:
            return worker(cfg, stepper=_stepper(cfg), dry_run=dry_run)
        from .train import train_config

        return train_config(cfg, stepper=_stepper(cfg), dry_run=dry_run)

    return run(argv, body)


def _stepper(cfg: JobConfig) -> Any:
    """What runs each step: None (the trainer's own), or the live level's (the elastic extra, torchft)."""
    if not cfg.elastic.live:
        return None
    from .elastic.live import live_stepper

    return live_stepper
