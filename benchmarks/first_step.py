"""First step vs later steps: step 1 / median(steps 2..10) of the trainer, per layout and microbatch count.

The layouts are those of the equivalence matrix (tests/test_parallel.py: DDP 4, FSDP 4, HSDP 2x2, FSDP 2 x TP 2,
TP 4 + SP) and a pipeline (PP 2 x FSDP 2, ZB-H1), each with ``training.microbatches`` 1 and 2, compile off.
Every run is a fresh process group (the first step is a first only once per process): the trainer as a user
runs it (``functitan.train.run`` on the debug Llama, the bundled corpus), with each ``train_step`` call timed.
Runs alternate over the cases (case order reversed every round) so load drift hits each alike; the JSON holds
every run's ratio and the median over runs. Target: <= 3.

    python -m benchmarks.first_step                  # 3 runs of every case
    python -m benchmarks.first_step --runs 1 --cases fsdp4 --microbatches 2

Writes ``benchmarks/results/first_step.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import _common
from functitan.testing import run_distributed

RESULTS = Path(__file__).parent / "results"
LAYOUTS: dict[str, dict[str, Any]] = {  # tests/test_parallel.py's matrix, and a pipeline
    "ddp4": {"parallelism.dp_replicate": 4, "parallelism.dp_shard": 1},
    "fsdp4": {"parallelism.dp_shard": 4},
    "hsdp2x2": {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 2},
    "fsdp2_tp2": {"parallelism.dp_shard": 2, "parallelism.tp": 2, "parallelism.sequence_parallel": False},
    "tp4_sp": {"parallelism.dp_shard": 1, "parallelism.tp": 4, "parallelism.sequence_parallel": True},
    "pp2_fsdp2_zbh1": {"parallelism.pp": 2, "parallelism.dp_shard": 2, "parallelism.pipeline_schedule": "zb_h1"},
}
BASE = {
    "model.flavor": "debug",
    "training.batch_size": 8,
    "training.seq_len": 128,
    "training.compile": False,
    "metrics.log_every": 1000,
}


def _timed_run(overrides: dict[str, Any]) -> list[float]:
    """Seconds of each ``train_step`` call of one trainer run (the slowest rank's, after a barrier).

    The trainer's stepper seam (``run(cfg, stepper=...)``) hands the step to a stepper: this one times each call
    and leaves the rest to the default, ``local_stepper``."""
    import torch
    import torch.distributed as dist

    import functitan.train as T
    from functitan.config import apply_overrides
    from functitan.job_config import JobConfig

    times: list[float] = []

    @contextlib.contextmanager
    def timed_stepper(cfg: Any, train_step: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        def timed(state: Any, batch: Any, **kw: Any) -> Any:
            dist.barrier()
            t0 = time.perf_counter()
            out = train_step(state, batch, **kw)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
            return out

        with T.local_stepper(cfg, timed, *args, **kwargs) as advance:
            yield advance

    T.run(apply_overrides(JobConfig(), overrides), stepper=timed_stepper)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cases", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--microbatches", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--run-dir", default="/tmp/functitan_first_step")
    ap.add_argument("--out", default=str(RESULTS / "first_step.json"))
    args = ap.parse_args(argv)

    cases = [(name, mb) for name in args.cases for mb in args.microbatches]
    per_run: dict[str, list[dict[str, Any]]] = {f"{n}/mb{mb}": [] for n, mb in cases}
    for r in range(args.runs):
        for name, mb in cases if r % 2 == 0 else list(reversed(cases)):
            # a pipeline needs at least as many microbatches as stages
            mbs = max(mb * 2, 2) if "parallelism.pp" in LAYOUTS[name] else mb
            overrides = {
                **BASE,
                **LAYOUTS[name],
                "training.microbatches": mbs,
                "training.steps": args.steps,
                "metrics.run_dir": args.run_dir,
                "metrics.run_name": f"{name}_mb{mb}",
            }
            t0 = time.perf_counter()
            times = run_distributed(_timed_run, 4, overrides, timeout=900)[0]
            later = statistics.median(times[1:])
            key = f"{name}/mb{mb}"
            per_run[key].append(
                {
                    "ratio": times[0] / later,
                    "first_s": times[0],
                    "median_later_s": later,
                    "steps_s": times,
                    "wall_s": time.perf_counter() - t0,
                    "microbatches": mbs,
                }
            )
            print(
                f"run {r} {key}: step 1 {times[0]:.3f}s, later {later:.3f}s, ratio {times[0] / later:.2f}", flush=True
            )
    ratios = {k: statistics.median(x["ratio"] for x in v) for k, v in per_run.items()}
    out = {
        "target": "step 1 / median(steps 2..n) <= 3",
        "ratios": ratios,
        "max_ratio": max(ratios.values()),
        "runs": per_run,
        "config": {**BASE, "steps": args.steps, "runs": args.runs, "world": 4},
        "environment": _common.environment(1, __import__("torch").device("cpu")),
    }
    path = _common.write_json(args.out, out)
    print(f"max ratio {out['max_ratio']:.2f}; wrote {path}")


if __name__ == "__main__":
    main()
