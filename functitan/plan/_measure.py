"""``--measure N``: train the top candidates N steps on this machine (gloo) and re-rank them by measured time."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from ._candidates import job_config
from ._report import write_toml

__all__ = ["measure", "measured_step_time"]


def measured_step_time(cfg: Any, world: int, steps: int, workdir: str | Path, timeout: float = 900) -> float:
    """Median step time (s) of ``steps`` steps of ``cfg`` on ``world`` local processes (the first step excluded)."""
    workdir = Path(workdir)
    cfg = dataclasses.replace(
        cfg,
        training=dataclasses.replace(cfg.training, steps=steps, device="cpu", threads=1),
        metrics=dataclasses.replace(cfg.metrics, log_every=1, run_dir=str(workdir), run_name="run"),
    )
    path = workdir / "plan.toml"
    write_toml(cfg, path)
    cmd = [sys.executable, "-m", "functitan.train", "--config", str(path)]
    if world > 1:
        cmd += ["--nproc", str(world)]
    _run_child(cmd, timeout)
    recs = [json.loads(x) for x in (workdir / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = sorted(r["step_time_s"] for r in recs[1:] if "step_time_s" in r) or [recs[-1]["step_time_s"]]
    return times[len(times) // 2]


def _run_child(cmd: list[str], timeout: float) -> None:
    """Run one measured training job; SIGTERM / SIGINT to the planner go to it, and the planner waits for it to
    stop before exiting ``128 + signal`` (it used to leave the job training). The job also gets SIGTERM when the
    planner dies (Linux), so not even a SIGKILL of the planner leaves it behind."""
    from functitan.elastic._orphans import die_with_parent

    main_thread = threading.current_thread() is threading.main_thread()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM) if main_thread else None,
        )
        received: list[int] = []

        def forward(signum: int, frame: object) -> None:
            received.append(signum)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        if received:
            print(f"functitan plan: stopped by {signal.Signals(received[0]).name} while measuring", file=sys.stderr)
            raise SystemExit(128 + received[0])
        if rc != 0:
            log.seek(0)
            raise subprocess.CalledProcessError(rc, cmd, output=log.read())


def measure(plan: Any, *, steps: int, world: int, top: int = 3) -> Any:
    """``plan`` with its first ``top`` fitting rows re-ranked by measured step time (``Row.time`` keeps the
    prediction; ``plan.measured`` maps labels to seconds)."""
    rows = [r for r in plan.rows if r.fits][:top]
    measured = {}
    for r in rows:
        with tempfile.TemporaryDirectory() as d:
            measured[r.cand] = measured_step_time(plan.cfg if r is plan.rows[0] else _cfg(plan, r), world, steps, d)
    rows.sort(key=lambda r: measured[r.cand])
    best = _cfg(plan, rows[0])
    rest = [r for r in plan.rows if r.cand not in measured]
    return plan._replace(rows=rows + rest, cfg=best), {r.cand.label(): measured[r.cand] for r in rows}


def _cfg(plan: Any, row: Any) -> Any:
    return job_config(plan.cfg, row.cand, batch_size=plan.cfg.training.batch_size, seq_len=plan.cfg.training.seq_len)
