"""Recovery from a killed worker, per elastic level, beside a plain torchrun restart from the last checkpoint.

For each scenario (loopback, gloo, the tiny llama of tests/test_elastic.py, async checkpoints every step):
* seconds from the SIGKILL to the next completed step (the first step recorded after the kill that is not run
  again later);
* steps lost: committed steps that had to run again (records of a step written more than once);
* for the elastic levels also the join: seconds from starting the new worker to the first step with it, and the
  longest pause between two completed steps around the join.

    python -m benchmarks.elastic_recovery [--levels torchrun,restart,live]

Wall-clock seconds on a shared machine are noisy (every process imports torch); the JSON records the load
average. Writes benchmarks/results/elastic_recovery.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._common import environment, write_json

# the loopback harness that tests/test_elastic.py runs its scenarios with (test code, not the library's)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from elastic_harness import ELASTIC_RUN_ARGS, live_scenario, plain_restart_scenario, restart_scenario  # noqa: E402

LEVELS = ("torchrun", "restart", "live")


def _summary(out: dict, records: list[dict]) -> dict:
    events = {what: (t, step) for what, t, step in out["events"]}
    kill_t, kill_step = events["kill"]
    final = {r["step"]: r for r in records}  # a step logged just before the kill may be redone: its last record counts
    after = sorted((r for r in final.values() if r["time"] > kill_t), key=lambda r: r["time"])
    res = {
        "returncodes": out.get("returncodes"),
        "leftover_processes": len(out["leftovers"]),
        "steps_before_kill": kill_step,
        "kill_to_next_step_s": round(after[0]["time"] - kill_t, 2) if after else None,
        "steps_lost": len(records) - len({r["step"] for r in records}),
        "step_time_s": round(_median_gap(records), 3),
    }
    if "join" in events:
        join_t, _ = events["join"]
        full = max(r.get("world_size", 0) for r in records)
        joined = [r for r in records if r["time"] > join_t and r.get("world_size") == full]
        res["join_to_first_full_step_s"] = round(joined[0]["time"] - join_t, 2) if joined else None
        around = [r["time"] for r in records if r["time"] > join_t - 5]
        res["longest_pause_around_join_s"] = round(max((b - a for a, b in zip(around, around[1:])), default=0), 2)
    return res


def _median_gap(records: list[dict]) -> float:
    gaps = sorted(b["time"] - a["time"] for a, b in zip(records, records[1:]))
    return gaps[len(gaps) // 2] if gaps else float("nan")


def _run(level: str, work: Path, train: list[str], timeout: float) -> dict:
    if level == "torchrun":
        out = plain_restart_scenario(work / "logs", train, timeout=timeout)
        return _summary(out, out["records"])
    if level == "restart":
        out = restart_scenario(work / "logs", train, timeout=timeout, steps_per_phase=2)
        return _summary(out, out["records"])
    out = live_scenario(work / "logs", train, timeout=timeout, steps_per_phase=3)
    res = _summary(out, out["records"][0])
    res["retried_iterations"] = sum(r.get("retries", 0) for r in out["records"][0])
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        for level in args.levels.split(","):
            t0 = time.time()
            work = Path(tmp) / level
            train = [*ELASTIC_RUN_ARGS, f"--metrics.run_dir={work}/runs", "--metrics.run_name=job"]
            try:
                res = _run(level, work, train, args.timeout)
            except (TimeoutError, KeyError, IndexError) as exc:  # recorded in the results, not hidden
                res = {"error": f"{type(exc).__name__}: {exc}"}
            res["scenario_wall_s"] = round(time.time() - t0, 1)
            results[level] = res
            print(level, res, flush=True)
    path = Path(__file__).parent / "results" / "elastic_recovery.json"
    if path.exists() and set(results) != set(LEVELS):  # a partial rerun updates its levels only
        results = {**json.loads(path.read_text())["results"], **results}
    write_json(
        path,
        {
            "what": "seconds from SIGKILL of one of 3 workers to the next completed step, and steps lost",
            "levels": {
                "torchrun": "plain torchrun --nproc 3 --max-restarts 3: all workers restart from the last checkpoint",
                "restart": "--nnodes 2:3, c10d + standalone store: survivors restart at world size 2, then 3",
                "live": "torchft replica groups: survivors keep their processes and step on",
            },
            "results": results,
            "environment": environment(1, torch.device("cpu")),
        },
    )


if __name__ == "__main__":
    main()
