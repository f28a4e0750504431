"""Faults and bad input (issue 25), through the CLI as typed: no process outlives its launcher, a run folder is
used by one job at a time, a slow save holds the loop back rather than falling behind, and each user error is
one line with exit code 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from functitan.testing import TINY_RUN_ARGS

ROOT = Path(__file__).resolve().parents[1]
TINY = [*TINY_RUN_ARGS, "--training.batch_size=4", "--training.seq_len=32"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _train(run_dir: Path, name: str, *args: str, log: Path) -> subprocess.Popen:
    """``functitan train`` as typed, on the tiny model, training for long enough to be killed while it trains."""
    cmd = [sys.executable, "-m", "functitan.cli", "train", *TINY, "--training.steps=100000"]
    cmd += [f"--metrics.run_dir={run_dir}", f"--metrics.run_name={name}", *args]
    with open(log, "wb") as err:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=_env())


def _wait_for_metrics(run: Path, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no metrics line in {timeout} s: {log.read_text()[-3000:]}"
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------ processes (/proc)


def _stat(pid: int) -> tuple[int, str, str] | None:
    """``(ppid, state, start time)`` of a live process; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every process below ``root``: pid -> its start time (so a reused pid is not taken for it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append(int(entry))
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if (st := _stat(child)) is not None:
                out[child] = st[2]
                todo.append(child)
    return out


def _alive(procs: dict[int, str]) -> list[int]:
    return [pid for pid, start in procs.items() if (st := _stat(pid)) is not None and st[1] != "Z" and st[2] == start]


def _listening_sockets(pids) -> set[tuple[int, str]]:
    """``(port, socket inode)`` of each TCP port these processes listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with_link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if with_link.startswith("socket:["):
                    inodes.add(with_link[8:-1])
        except OSError:
            continue
    return {(port, inode) for port, inode in _listening() if inode in inodes}


def _listening() -> list[tuple[int, str]]:
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    out.append((int(cols[1].rsplit(":", 1)[1], 16), cols[9]))
    return out


# ------------------------------------------------------------------------------------------ 1. no orphans


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_the_launcher_leaves_no_process_and_no_listening_port(tmp_path):
    # a scheduler's kill -9 of `functitan train --nproc N`: torchrun and every worker go with it (they kept training)
    jobs = {n: _train(tmp_path, f"n{n}", "--nproc", str(n), log=tmp_path / f"n{n}.log") for n in (1, 2)}
    try:
        for n, proc in jobs.items():
            _wait_for_metrics(tmp_path / f"n{n}", proc, tmp_path / f"n{n}.log")
        below = {n: _descendants(proc.pid) for n, proc in jobs.items()}
        ports = _listening_sockets(pid for procs in below.values() for pid in procs)
        assert all(len(procs) >= n + 1 for n, procs in below.items()), below  # torchrun and its n workers
        assert ports  # torchrun's store and gloo listen while training
        for proc in jobs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 10
        left = {n: _alive(procs) for n, procs in below.items()}
        while any(left.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            left = {n: _alive(procs) for n, procs in below.items()}
        assert not any(left.values()), f"still running 10 s after the launcher's SIGKILL: {left}"
        assert not ports & set(_listening()), "a socket the job listened on is still open"
    finally:
        for procs in (below if "below" in locals() else {}).values():
            for pid in _alive(procs):
                os.kill(pid, signal.SIGKILL)
        for proc in jobs.values():
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_plan_measure_stops_its_training_job_and_waits_for_it(tmp_path):
    # `plan --measure N` runs each candidate as a child job through _run_child; SIGTERM used to leave it training
    script = "import sys; from functitan.plan._measure import _run_child; _run_child(sys.argv[1:], 600)"
    cmd = [sys.executable, "-c", script, sys.executable, "-m", "functitan.cli", "train", *TINY]
    cmd += ["--training.steps=100000", f"--metrics.run_dir={tmp_path}", "--metrics.run_name=m"]
    log = tmp_path / "plan.log"
    with open(log, "wb") as err:
        planner = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=_env())
    try:
        _wait_for_metrics(tmp_path / "m", planner, log)
        below = _descendants(planner.pid)
        assert below, "no measured job"
        planner.send_signal(signal.SIGTERM)
        assert planner.wait(60) == 128 + signal.SIGTERM
        assert not _alive(below), "the planner exited before its measured job stopped"
        assert log.read_text().strip().splitlines()[-1] == "functitan plan: stopped by SIGTERM while measuring"
    finally:
        planner.kill()
        planner.wait()
