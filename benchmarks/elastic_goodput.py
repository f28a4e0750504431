"""Goodput under a kill every N steps, per elastic level: the same job with and without faults, side by side.

Three workers (restart level: three ``--nnodes 2:3`` nodes on a standalone store; live level: three torchft
replica groups) train the tiny llama of tests/test_elastic.py to ``--steps`` committed steps, with async
checkpoints every step. In the faulty run one worker is SIGKILLed (agent and worker: a machine that dies) each
time ``--kill-every`` more steps have committed, and a replacement is started at once. Per level:

* ``goodput``: the clean run's seconds from step 1 to step ``--steps`` over the faulty run's (startup excluded:
  both pay it once);
* ``cost_per_fault_s``: the extra seconds per fault, and ``steps_lost_per_fault`` (committed steps run again);
* ``goodput_at``: what that cost gives at real fault rates, ``interval / (interval + cost)`` for one fault per
  10 minutes, hour and day of training.

    python -m benchmarks.elastic_goodput [--levels restart,live] [--steps 60] [--kill-every 10]

On this 2-core machine three workers and a starting replacement share two cores: a replacement's torch import
slows the survivors, so the cost per fault here is an upper bound of what separate machines would see (which
this machine cannot show). Writes benchmarks/results/elastic_goodput.json.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._common import environment, write_json
from functitan.testing import free_port

# the loopback harness of tests/test_elastic.py (test code, not the library's)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from elastic_harness import (  # noqa: E402
    ELASTIC_RUN_ARGS,
    Loopback,
    committed,
    live_group_args,
    read_metrics,
    restart_node_args,
    start_lighthouse,
    start_store,
)

LEVELS = ("restart", "live")
WORKERS = 3
RATES_S = {"one_per_10_min": 600, "one_per_hour": 3600, "one_per_day": 86400}


def _scenario(level: str, work: Path, steps: int, kill_every: int, timeout: float) -> dict:
    """One run to ``steps`` committed steps; ``kill_every`` 0: no faults. Returns its step timeline and kills."""
    run_dir, name, port = work / "runs", "job", free_port()
    train = [*ELASTIC_RUN_ARGS, f"--metrics.run_dir={run_dir}"]
    h = Loopback(work / "logs")
    files: dict[int, Path] = {}

    def start(i: int) -> None:
        if level == "restart":  # one run directory: rank 0 of whichever round writes it
            files[i] = run_dir / name / "metrics.jsonl"
            h.start(f"w{i}", restart_node_args(port, name, WORKERS, [*train, f"--metrics.run_name={name}"]))
        else:  # a run directory per replica group; a step is done when any group committed it
            files[i] = run_dir / f"{name}-r{i}" / "metrics.jsonl"
            h.start(f"w{i}", live_group_args(port, i, f"{name}-r{i}", WORKERS // 2 + 1, train))

    def timeline() -> dict[int, float]:
        """step -> when it was committed: its last record (restart level: a redone step counts at its redo), or
        the first group's (live level: every group of the quorum commits the same step)."""
        done: dict[int, float] = {}
        for path in set(files.values()):
            for r in committed(read_metrics(path)):
                done[r["step"]] = min(done.get(r["step"], r["time"]), r["time"])
        return done

    def progress() -> int:
        return max(timeline(), default=0)

    alive, kills, t0 = list(range(WORKERS)), [], time.time()
    try:
        if level == "restart":
            start_store(h, port, timeout)
        else:
            start_lighthouse(h, port, WORKERS // 2 + 1)
        for i in alive:
            start(i)
        while (done := progress()) < steps:
            if time.time() - t0 > timeout:
                raise TimeoutError(f"{level}: {done} of {steps} steps after {timeout:.0f} s; logs in {work / 'logs'}")
            if kill_every and done >= kill_every * (len(kills) + 1):
                victim = alive.pop(0)  # the oldest: in the restart level it usually holds rank 0
                kills.append({"time": time.time(), "step": done})
                h.kill(f"w{victim}")
                start(len(kills) + WORKERS - 1)
                alive.append(len(kills) + WORKERS - 1)
            h.remember()
            time.sleep(0.1)
        for i in alive:
            h.kill(f"w{i}", signal.SIGTERM)
        for i in alive:
            h.wait_until(f"w{i} to exit", lambda i=i: h.procs[f"w{i}"].poll() is not None, timeout=120)
        returncodes = {f"w{i}": h.procs[f"w{i}"].returncode for i in alive}
        server = "store" if level == "restart" else "lighthouse"  # what outlives the workers by design
        h.kill(server, signal.SIGTERM)
        h.wait_until(f"the {server} to exit", lambda: h.procs[server].poll() is not None, timeout=30)
    finally:
        records = [r for path in set(files.values()) for r in read_metrics(path)]
        leftovers = h.close()
    done = timeline()
    redone = len(records) - len({r["step"] for r in records}) if level == "restart" else 0
    return {
        "train_s": round(done[steps] - done[1], 2),  # step 1 to step `steps`, startup excluded
        "wall_s": round(time.time() - t0, 1),
        "kills": len(kills),
        "kill_to_next_step_s": [round(min(t for t in done.values() if t > k["time"]) - k["time"], 2) for k in kills],
        "steps_redone": redone,
        "returncodes": returncodes,
        "leftover_processes": len(leftovers),
    }


def _compare(clean: dict, faulty: dict) -> dict:
    faults = max(faulty["kills"], 1)
    cost = (faulty["train_s"] - clean["train_s"]) / faults
    return {
        "goodput": round(clean["train_s"] / faulty["train_s"], 3),
        "cost_per_fault_s": round(cost, 2),
        "steps_lost_per_fault": round(faulty["steps_redone"] / faults, 2),
        "goodput_at": {rate: round(every / (every + max(cost, 0.0)), 4) for rate, every in RATES_S.items()},
        "clean": clean,
        "faulty": faulty,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-every", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.kill_every <= 0 or args.steps <= args.kill_every:
        parser.error(f"--kill-every={args.kill_every} must be positive and below --steps={args.steps}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="elastic-goodput-") as tmp:
        for level in args.levels.split(","):
            if level not in LEVELS:
                parser.error(f"--levels: unknown level {level!r}; pick from {', '.join(LEVELS)}")
            runs = {}
            for kind, every in (("clean", 0), ("faulty", args.kill_every)):  # peers in one run, one after the other
                runs[kind] = _scenario(level, Path(tmp) / level / kind, args.steps, every, args.timeout)
                print(level, kind, runs[kind], flush=True)
            results[level] = _compare(runs["clean"], runs["faulty"])
    write_json(
        Path(__file__).parent / "results" / "elastic_goodput.json",
        {
            "what": f"goodput of {WORKERS} workers training {args.steps} steps with a SIGKILL every "
            f"{args.kill_every} committed steps (a replacement started at once) vs the same job without faults",
            "levels": {
                "restart": "--nnodes 2:3 on a standalone store: every fault restarts the survivors (and the join "
                "restarts them again); a kill redoes the steps since the newest committed checkpoint",
                "live": "torchft replica groups: survivors step on; the replacement heals from a peer",
            },
            "caveat": "2 cores for 3 workers and a starting replacement: the cost per fault is an upper bound",
            "results": results,
            "environment": environment(1, torch.device("cpu")),
        },
    )


if __name__ == "__main__":
    main()
