"""A loopback harness for elastic runs: start launchers as processes, kill them by PID, read their metrics.

Used by tests/test_elastic*.py and benchmarks/elastic_recovery.py: test code, which the library does not ship.
Every process the harness starts, and every process below it (torchrun starts its workers in new sessions, and
a SIGKILLed agent orphans its worker), is remembered by ``(pid, start time)`` whenever the harness looks, and killed by PID on ``close()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from functitan.testing import TINY_RUN_ARGS, free_port

__all__ = [
    "Loopback",
    "start_lighthouse",
    "live_group_args",
    "start_store",
    "restart_node_args",
    "read_metrics",
    "committed",
    "descendants",
    "alive",
    "ELASTIC_BATCH",
    "ELASTIC_SEQ",
    "ELASTIC_RUN_ARGS",
]

# The job every elastic scenario trains: the tiny model until killed, a checkpoint each step. A global batch of 12
# sequences splits into microbatches of 2 on 1, 2 or 3 ranks, so the same run continues at any of those sizes.
ELASTIC_BATCH, ELASTIC_SEQ = 12, 32
ELASTIC_RUN_ARGS: tuple[str, ...] = (
    *TINY_RUN_ARGS,
    f"--training.batch_size={ELASTIC_BATCH}",
    f"--training.seq_len={ELASTIC_SEQ}",
    "--optimizer.lr=1e-2",
    "--elastic.microbatch_size=2",
    "--training.steps=100000",
    "--checkpoint.enable=true",
    "--checkpoint.interval=1",
    "--checkpoint.keep_last=2",
)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, parent pid, start time)`` of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> set[int]:
    """The live processes below ``pid``."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)] = st[1]
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pids) -> set[int]:
    """The ones of ``pids`` still running (zombies count as gone)."""
    return {p for p in pids if (st := _stat(p)) is not None and st[0] != "Z"}


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Every record of a metrics.jsonl, in the order written (a redone step appears again)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def committed(records: list[dict]) -> list[dict]:
    """The record of each step that counts: the last one written for it (a step redone after a kill replaces it)."""
    last = {r["step"]: r for r in records}
    return [last[s] for s in sorted(last)]


class Loopback:
    """Processes of one elastic scenario on this machine; ``close()`` leaves none behind.

    Args:
        workdir: where each process's output goes (``<name>.log``), and its temporary files (``tmp/``, as
            ``TMPDIR``): what a killed agent cannot remove (torchrun's, the launcher's) goes with the workdir.
        env: extra environment for every process.
    """

    def __init__(self, workdir: str | os.PathLike, env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "TMPDIR": str(self.workdir / "tmp"), **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self._seen: dict[int, int] = {}  # pid -> start time: every process we ever saw in our trees

    def start(self, name: str, args: Sequence[str], *, python: bool = True) -> subprocess.Popen:
        """Start ``python args...`` (or the command ``args`` when not ``python``) as process ``name``."""
        log = open(self.workdir / f"{name}.log", "wb")
        cmd = [sys.executable, *args] if python else list(args)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        self.procs[name] = proc
        self.remember()
        return proc

    def remember(self) -> None:
        """Note every process below the ones started (call while waiting: orphans lose their parent link)."""
        for proc in self.procs.values():
            for pid in {proc.pid} | descendants(proc.pid):
                if pid not in self._seen and (st := _stat(pid)) is not None:
                    self._seen[pid] = st[2]

    def tree(self, name: str) -> set[int]:
        return {self.procs[name].pid} | descendants(self.procs[name].pid)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> set[int]:
        """Send ``sig`` to process ``name`` and (SIGKILL) everything below it: a machine that dies."""
        self.remember()
        pids = self.tree(name) if sig == signal.SIGKILL else {self.procs[name].pid}
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float) -> float:
        """Poll ``predicate`` until true; returns the seconds waited. Raises TimeoutError naming ``what``."""
        t0 = time.monotonic()
        while not predicate():
            self.remember()
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.workdir}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def leftovers(self) -> set[int]:
        """Processes the harness saw that still run (the same pid and start time)."""
        self.remember()
        return {p for p, t in self._seen.items() if p in alive([p]) and (_stat(p) or ("", 0, -1))[2] == t}

    def close(self) -> set[int]:
        """Kill every process seen, by PID; returns the ones that were still running before that."""
        left = self.leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return left

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")


def _last_step(path: Path, world: int | None = None, after: int = 0) -> int:
    """The newest step recorded (with ``world_size == world`` when given, and after ``after`` records)."""
    recs = read_metrics(path)[after:]
    steps = [r["step"] for r in recs if world is None or r.get("world_size") == world]
    return max(steps, default=0)


def start_store(h: Loopback, port: int, timeout: float) -> None:
    """A standalone ``functitan rendezvous`` store on ``127.0.0.1:port`` as process ``store``."""
    h.start("store", ["-m", "functitan.cli", "rendezvous", "--host=127.0.0.1", f"--port={port}"])
    h.wait_until("the store", lambda: "rendezvous store on" in h.log("store"), timeout)


def restart_node_args(port: int, name: str, nodes: int, train_args: Sequence[str]) -> list[str]:
    """``python -m functitan.cli train ...`` of one restart-level node (``--nnodes nodes-1:nodes``) against the
    store on ``port``; ``name`` is the rendezvous id (it also names the run)."""
    return [
        "-m",
        "functitan.cli",
        "train",
        "--nproc=1",
        f"--nnodes={nodes - 1}:{nodes}",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={name}",
        "--max-restarts=20",
        "--local-addr=127.0.0.1",
        *train_args,
    ]


def restart_scenario(
    workdir: str | os.PathLike,
    train_args: Sequence[str],
    *,
    steps_per_phase: int = 3,
    timeout: float = 120.0,
    nodes: int = 3,
) -> dict:
    """Restart level on loopback: ``nodes`` agents -> SIGKILL one (agent and worker) -> the others continue ->
    a new one joins -> ``nodes`` again -> SIGTERM every launcher (a preemption save). Returns what happened.

    ``train_args`` are the trainer's flags (the run directory and name included); every node runs
    ``functitan train --nproc 1 --nnodes 2:MAX`` against a standalone ``functitan rendezvous`` store.
    """
    workdir = Path(workdir)
    port = free_port()
    run_dir = next(a.split("=", 1)[1] for a in train_args if a.startswith("--metrics.run_dir="))
    name = next(a.split("=", 1)[1] for a in train_args if a.startswith("--metrics.run_name="))
    metrics = Path(run_dir) / name / "metrics.jsonl"
    h = Loopback(workdir)
    out: dict = {"events": []}

    def node(i: int):
        return h.start(f"node{i}", restart_node_args(port, name, nodes, train_args))

    def event(what: str) -> None:
        out["events"].append((what, time.time(), _last_step(metrics)))

    try:
        start_store(h, port, timeout)
        for i in range(nodes):
            node(i)
        h.wait_until(
            f"{steps_per_phase} steps on {nodes} nodes", lambda: _last_step(metrics, nodes) >= steps_per_phase, timeout
        )
        event("kill")
        h.kill(f"node{nodes - 1}")
        n_before = len(read_metrics(metrics))
        h.wait_until(
            f"{steps_per_phase} steps on {nodes - 1} nodes",
            lambda: _last_step(metrics, nodes - 1, n_before) >= out["events"][-1][2] + steps_per_phase,
            timeout,
        )
        event("join")
        node(nodes)
        n_before = len(read_metrics(metrics))
        h.wait_until(
            f"{steps_per_phase} steps on {nodes} nodes again",
            lambda: _last_step(metrics, nodes, n_before) >= out["events"][-1][2] + steps_per_phase,
            timeout,
        )
        event("stop")
        for i in [*range(nodes - 1), nodes]:
            h.kill(f"node{i}", signal.SIGTERM)
        for i in [*range(nodes - 1), nodes]:
            h.wait_until(f"node{i} to exit", lambda i=i: h.procs[f"node{i}"].poll() is not None, timeout=60)
        out["returncodes"] = {f"node{i}": h.procs[f"node{i}"].returncode for i in [*range(nodes - 1), nodes]}
        h.kill("store", signal.SIGTERM)
        h.wait_until("the store to exit", lambda: h.procs["store"].poll() is not None, timeout=30)
    finally:
        out["records"] = read_metrics(metrics)
        out["leftovers"] = h.close()
        out["logs"] = workdir
    return out


def start_lighthouse(h: Loopback, port: int, min_replicas: int, heartbeat_timeout_ms: int = 1000) -> None:
    """A torchft lighthouse on ``127.0.0.1:port`` as process ``lighthouse`` (quick ticks: loopback)."""
    lighthouse = Path(sys.executable).with_name("torchft_lighthouse")  # installed beside python by torchft
    h.start(
        "lighthouse",
        [
            str(lighthouse),
            f"--min_replicas={min_replicas}",
            f"--bind=127.0.0.1:{port}",
            "--quorum_tick_ms=50",
            "--join_timeout_ms=500",
            f"--heartbeat_timeout_ms={heartbeat_timeout_ms}",
        ],
        python=False,
    )


def live_group_args(port: int, i: int, run_name: str, min_replicas: int, train_args: Sequence[str]) -> list[str]:
    """``python -m functitan.cli train ...`` of live replica group ``r{i}`` against the lighthouse on ``port``."""
    return [
        "-m",
        "functitan.cli",
        "train",
        "--elastic.live=true",
        f"--elastic.lighthouse=http://127.0.0.1:{port}",
        f"--elastic.replica_id=r{i}",
        "--elastic.advertise_host=127.0.0.1",
        f"--elastic.min_replicas={min_replicas}",
        f"--metrics.run_name={run_name}",
        *train_args,
    ]


def live_scenario(
    workdir: str | os.PathLike,
    train_args: Sequence[str],
    *,
    steps_per_phase: int = 3,
    timeout: float = 120.0,
    replicas: int = 3,
    heartbeat_timeout_ms: int = 1000,
) -> dict:
    """Live level on loopback: a torchft lighthouse and ``replicas`` one-process replica groups -> SIGKILL one ->
    the others keep stepping -> a new one joins and heals from a peer -> ``replicas`` again -> SIGTERM all.

    Each group ``i`` writes its own run directory ``<run_name>-r{i}`` (metrics and checkpoints). Returns the
    events, every group's records and return code, and the processes left before cleanup.
    """
    workdir = Path(workdir)
    port = free_port()
    run_dir = next(a.split("=", 1)[1] for a in train_args if a.startswith("--metrics.run_dir="))
    name = next(a.split("=", 1)[1] for a in train_args if a.startswith("--metrics.run_name="))
    args = [a for a in train_args if not a.startswith("--metrics.run_name=")]
    metrics = {i: Path(run_dir) / f"{name}-r{i}" / "metrics.jsonl" for i in range(replicas + 1)}
    h = Loopback(workdir)
    out: dict = {"events": []}

    def group(i: int):
        return h.start(f"replica{i}", live_group_args(port, i, f"{name}-r{i}", replicas // 2 + 1, args))

    def last(i: int, replicas_seen: int | None = None, after: int = 0) -> int:
        return (
            _last_step(metrics[i], None, after)
            if replicas_seen is None
            else max(
                (r["step"] for r in read_metrics(metrics[i])[after:] if r.get("replicas") == replicas_seen), default=0
            )
        )

    def event(what: str, i: int) -> None:
        out["events"].append((what, time.time(), last(i)))

    try:
        # a majority: two quorums without a common member cannot both commit the same step (split brain)
        start_lighthouse(h, port, replicas // 2 + 1, heartbeat_timeout_ms)
        for i in range(replicas):
            group(i)
        h.wait_until(
            f"{steps_per_phase} steps with {replicas} groups", lambda: last(0, replicas) >= steps_per_phase, timeout
        )
        event("kill", 0)
        h.kill(f"replica{replicas - 1}")
        n0 = len(read_metrics(metrics[0]))
        h.wait_until(
            f"{steps_per_phase} steps with {replicas - 1} groups",
            lambda: last(0, replicas - 1, n0) >= out["events"][-1][2] + steps_per_phase,
            timeout,
        )
        event("join", 0)
        group(replicas)
        n0 = len(read_metrics(metrics[0]))
        h.wait_until(
            f"{steps_per_phase} steps with {replicas} groups again",
            lambda: last(0, replicas, n0) >= out["events"][-1][2] + steps_per_phase,
            timeout,
        )
        event("stop", 0)
        alive_groups = [*range(replicas - 1), replicas]
        for i in alive_groups:
            h.kill(f"replica{i}", signal.SIGTERM)
        for i in alive_groups:
            h.wait_until(f"replica{i} to exit", lambda i=i: h.procs[f"replica{i}"].poll() is not None, timeout=60)
        out["returncodes"] = {f"replica{i}": h.procs[f"replica{i}"].returncode for i in alive_groups}
        h.kill("lighthouse", signal.SIGTERM)
        h.wait_until("the lighthouse to exit", lambda: h.procs["lighthouse"].poll() is not None, timeout=30)
    finally:
        out["records"] = {i: read_metrics(p) for i, p in metrics.items()}
        out["leftovers"] = h.close()
        out["logs"] = workdir
    return out


def plain_restart_scenario(
    workdir: str | os.PathLike,
    train_args: Sequence[str],
    *,
    steps_before: int = 3,
    steps_after: int = 2,
    timeout: float = 120.0,
    nproc: int = 3,
) -> dict:
    """The baseline: ``functitan train --nproc N --max-restarts 3`` (torchrun, one fixed world size); SIGKILL one
    worker; torchrun restarts all of them from the newest checkpoint. Then SIGTERM."""
    workdir = Path(workdir)
    run_dir = next(a.split("=", 1)[1] for a in train_args if a.startswith("--metrics.run_dir="))
    name = next(a.split("=", 1)[1] for a in train_args if a.startswith("--metrics.run_name="))
    metrics = Path(run_dir) / name / "metrics.jsonl"
    h = Loopback(workdir)
    out: dict = {"events": []}
    try:
        h.start("job", ["-m", "functitan.cli", "train", f"--nproc={nproc}", "--max-restarts=3", *train_args])
        h.wait_until(f"{steps_before} steps", lambda: _last_step(metrics) >= steps_before, timeout)
        launcher = h.procs["job"].pid
        torchrun = [p for p in descendants(launcher) if _stat(p)[1] == launcher]
        workers = sorted(p for p in descendants(launcher) if _stat(p)[1] in torchrun)
        out["events"].append(("kill", time.time(), _last_step(metrics)))
        os.kill(workers[-1], signal.SIGKILL)
        n_before = len(read_metrics(metrics))
        h.wait_until(
            f"{steps_after} steps after the restart",
            lambda: _last_step(metrics, None, n_before) >= out["events"][-1][2] + steps_after,
            timeout,
        )
        out["events"].append(("stop", time.time(), _last_step(metrics)))
        h.kill("job", signal.SIGTERM)
        h.wait_until("the job to exit", lambda: h.procs["job"].poll() is not None, timeout=60)
        out["returncodes"] = {"job": h.procs["job"].returncode}
    finally:
        out["records"] = read_metrics(metrics)
        out["leftovers"] = h.close()
        out["logs"] = workdir
    return out
