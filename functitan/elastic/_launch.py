"""The launcher: ``functitan train --nproc N [--nnodes MIN:MAX --rdzv-endpoint HOST:PORT] ...`` runs torchrun.

It owns torchrun and every process below it:

* SIGTERM / SIGINT to the launcher go to torchrun, which passes them to its workers; they save a checkpoint at
  the next step boundary and exit (functitan._preempt). The launcher waits for all of them, so a
  scheduler that kills the launcher never leaves an orphaned job racing its restart on the run directory.
* A user error on any rank (the rank prints one line and writes it to ``$FUNCTITAN_ERROR_DIR/rank{RANK}.txt``)
  is shown once, as ``functitan: error: ...``, exit code 2, without torchrun's ChildFailedError traceback. A
  real crash keeps every traceback.
* Whatever kills the launcher, even SIGKILL, takes torchrun and every worker with it within about a second
  (functitan.elastic._orphans): a requeued job never races the old one on the run directory.
* ``--nnodes MIN:MAX`` makes the job elastic on torchrun's c10d rendezvous, through a store that no agent
  hosts (``functitan rendezvous``), so losing any node does not end the job; see docs/elastic.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

from .._worker_report import CHECKPOINTS, ERROR_DIR, STOPPED
from ..errors import UserError
from ._orphans import LAUNCHER_PID
from ._reach import REACH_TIMEOUT_S, reach_problem

__all__ = [
    "LaunchError",
    "LaunchSpec",
    "parse_launch_args",
    "launch",
    "torchrun_command",
    "RDZV_CONF",
]

# Rendezvous timing measured on loopback (docs/elastic.md): scale-down in ~12 s instead of ~48 s.
RDZV_CONF = {"last_call_timeout": "5", "keep_alive_interval": "1", "keep_alive_max_attempt": "3", "join_timeout": "600"}
ELASTIC_RESTARTS = 100  # default --max-restarts with --nnodes: a node that leaves costs the others one restart
_FLAGS = ("--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--max-restarts", "--local-addr")


class LaunchError(UserError):
    """A bad launcher flag; the message names it and the fix."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What torchrun runs: ``nproc`` workers per node on ``nnodes`` ("N" or "MIN:MAX") nodes."""

    nproc: int = 1
    nnodes: str = "1"
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    local_addr: str = ""

    @property
    def elastic(self) -> bool:
        return self.nnodes != "1" or bool(self.rdzv_endpoint)


def _positive(flag: str, value: str, *, zero: bool = False) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < (0 if zero else 1):
        what = "the number of restarts is an integer >= 0" if zero else "the number of processes is an integer >= 1"
        raise LaunchError(f"{flag}={value!r}: {what}, e.g. {flag} 2")
    return n


def parse_launch_args(argv: Sequence[str]) -> tuple[LaunchSpec | None, list[str]]:
    """Split the launcher's flags off ``argv``: ``(spec, the trainer's args)``; spec is None without any."""
    values: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name not in _FLAGS:
            rest.append(arg)
            i += 1
            continue
        if "=" in arg:
            values[name] = arg.split("=", 1)[1]
        elif i + 1 < len(argv):
            values[name] = argv[i + 1]
            i += 1
        else:
            raise LaunchError(f"{name} needs a value, e.g. {name}=2")
        i += 1
    if not values:
        return None, rest
    nnodes = values.get("--nnodes", "1")
    lo_hi = nnodes.split(":")
    if len(lo_hi) > 2 or not all(p.isdigit() and int(p) > 0 for p in lo_hi) or int(lo_hi[0]) > int(lo_hi[-1]):
        raise LaunchError(f"--nnodes={nnodes}: expected N or MIN:MAX with 0 < MIN <= MAX, e.g. --nnodes=2:4")
    conf = dict(RDZV_CONF)
    for item in filter(None, values.get("--rdzv-conf", "").split(",")):
        if "=" not in item:
            raise LaunchError(
                f"--rdzv-conf={values['--rdzv-conf']}: expected key=value[,key=value], e.g. last_call_timeout=5"
            )
        k, v = item.split("=", 1)
        conf[k] = v
    elastic = nnodes != "1" or "--rdzv-endpoint" in values
    spec = LaunchSpec(
        nproc=_positive("--nproc", values.get("--nproc", "1")),
        nnodes=nnodes,
        rdzv_endpoint=values.get("--rdzv-endpoint", ""),
        rdzv_id=values.get("--rdzv-id", ""),
        rdzv_conf=conf,
        max_restarts=_positive(
            "--max-restarts", values.get("--max-restarts", str(ELASTIC_RESTARTS if elastic else 0)), zero=True
        ),
        local_addr=values.get("--local-addr", ""),
    )
    if spec.elastic and not spec.rdzv_endpoint:
        raise LaunchError(
            f"--nnodes={nnodes} needs --rdzv-endpoint=HOST:PORT, a rendezvous store every node reaches: start "
            "`functitan rendezvous --port 29400` on a host that outlives the workers and pass --rdzv-endpoint=HOST:29400"
        )
    if spec.elastic and not spec.rdzv_id:
        raise LaunchError(
            "an elastic job needs --rdzv-id=NAME, the same on every node (it also names the run directory)"
        )
    return spec, rest


def torchrun_command(spec: LaunchSpec, argv: Sequence[str], log_dir: str | os.PathLike | None = None) -> list[str]:
    """The torchrun command line that runs ``functitan.train argv`` as ``spec`` says.

    ``log_dir``: torchrun's directory for its workers' error files (default: a ``torchelastic_*`` directory of
    its own in /tmp, which it leaves behind when a signal stops it).
    """
    # torchrun itself, under a wrapper that dies with the launcher (functitan.elastic._orphans)
    cmd = [sys.executable, "-m", "functitan.elastic._torchrun", f"--nproc-per-node={spec.nproc}"]
    if log_dir is not None:
        cmd.append(f"--log-dir={log_dir}")
    if not spec.elastic:
        cmd += ["--standalone", f"--max-restarts={spec.max_restarts}"]
    else:
        conf = {**spec.rdzv_conf, "is_host": "false"}  # the store is standalone: no agent hosts it
        cmd += [
            f"--nnodes={spec.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
            "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
            f"--max-restarts={spec.max_restarts}",
            "--monitor-interval=0.5",
        ]
        if spec.local_addr:
            cmd.append(f"--local-addr={spec.local_addr}")
    return [*cmd, "-m", "functitan.train", *argv]


class _StderrPump:
    """Copies torchrun's stderr (its workers' too) to ours, holding back what may have to be replaced by one line.

    Held back: the ranks' ``functitan: error:`` lines (shown once by the launcher instead of once per rank), and
    everything after torchrun reports a failed worker or a signal (its ChildFailedError / SignalException
    traceback). ``release()`` prints what was held, for failures that are not user errors.
    """

    # the agent stopping the other workers after one failed comes first ("Sending process N closing signal")
    FAILURE_MARKS = ("closing signal SIG", "failed (exitcode:", "ChildFailedError", "SignalException")

    def __init__(self, src: IO[bytes], dst: IO[bytes], *, hold_on_failure: bool):
        self.src, self.dst, self.hold_on_failure = src, dst, hold_on_failure
        self.held: list[bytes] = []
        self.holding = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for line in iter(self.src.readline, b""):
            text = line.decode(errors="replace")
            if self.hold_on_failure and not self.holding and any(m in text for m in self.FAILURE_MARKS):
                self.holding = True
            if self.holding or text.startswith("functitan: error:"):
                self.held.append(line)
            else:
                self.dst.write(line)
                self.dst.flush()

    def join(self) -> None:
        self._thread.join()

    def release(self) -> None:
        for line in self.held:
            self.dst.write(line)
        self.dst.flush()
        self.held.clear()


def _first_error(error_dir: Path) -> str | None:
    """The earliest rank's one-line message, or None when no rank reported a user error."""
    files = sorted(error_dir.glob("rank*.txt"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    for f in files:
        text = f.read_text(errors="replace").strip()
        if text:
            return text.removeprefix("functitan: error:").strip()
    return None


def launch(spec: LaunchSpec, argv: Sequence[str]) -> int:
    """Run torchrun as ``spec`` says until it ends; returns the exit code for the ``functitan`` CLI.

    0: training finished, or stopped by SIGTERM/SIGINT after every local worker saved; 2: a user error on a
    rank (printed once); otherwise torchrun's code (128 + N when stopped by signal N without a clean save).
    """
    if spec.elastic:
        _check_reach(spec)
    with tempfile.TemporaryDirectory(prefix="functitan-errors-") as tmp:
        error_dir = Path(tmp)
        # A fresh store for the workers of every rendezvous round. Sharing the agent's store across rounds hangs
        # restarts here: after a worker died, the new round's gloo ranks read each other's stale addresses and
        # wait forever (torchrun --standalone --max-restarts, torch 2.13); several agents on one host deadlock
        # on scale-up the same way.
        env = {**os.environ, ERROR_DIR: str(error_dir), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env[LAUNCHER_PID] = str(os.getpid())  # torchrun and the workers die with us, even by SIGKILL
        if spec.elastic:
            env["FUNCTITAN_ELASTIC_RUN"] = spec.rdzv_id
        if spec.nproc > 1:  # what torchrun sets itself, without the three-line banner it prints then
            env.setdefault("OMP_NUM_THREADS", "1")
        # its own session: a terminal's Ctrl-C reaches only us, and we decide what torchrun gets
        cmd = torchrun_command(spec, argv, log_dir=error_dir / "torchrun")  # removed with error_dir, signal or not
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True)
        # a failure ends the job only without restarts: then torchrun's summary may give way to one line
        stderr = cast(IO[bytes], proc.stderr)  # stderr=PIPE: never None
        pump = _StderrPump(stderr, sys.stderr.buffer, hold_on_failure=spec.max_restarts == 0)
        received: list[int] = []
        signalled_at: list[float] = []

        def forward(signum: int, frame: object) -> None:
            received.append(signum)
            signalled_at.append(time.time())
            pump.holding = True  # torchrun answers with a SignalException traceback
            try:
                os.kill(proc.pid, signum)  # torchrun passes it to its workers and waits for them
            except ProcessLookupError:
                pass

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = _wait(proc)
            pump.join()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            if proc.poll() is None:  # only when the launcher itself fails: never leave torchrun behind
                proc.kill()
                proc.wait()
        if received:
            # workers that saved and stopped since the signal (an elastic scale-up also stops them, earlier)
            stopped = sum(1 for f in error_dir.glob(f"{STOPPED}*") if f.stat().st_mtime >= signalled_at[0] - 1.0)
            if stopped >= spec.nproc:
                pump.held = [line for line in pump.held if not line.startswith(b"functitan: error:")]
                return 0
            if "--debug" in argv:  # torchrun's SignalException traceback, a second signal's too
                pump.release()
            name = signal.Signals(received[0]).name
            again = f" (and {len(received) - 1} more)" if len(received) > 1 else ""
            print(
                f"functitan: stopped by {name}{again} before every worker saved ({stopped} of {spec.nproc} did); "
                f"{_newest_checkpoint(error_dir)}",
                file=sys.stderr,
            )
            return 128 + received[0]
        if rc != 0:
            message = _first_error(error_dir)
            if message is not None:
                print(f"functitan: error: {message}", file=sys.stderr)
                return 2
        pump.release()
        if rc < 0:  # torchrun itself was killed (the OOM killer, a kill -9 of it): its workers died with it
            print(
                f"functitan: error: torchrun (pid {proc.pid}) was killed by {signal.Signals(-rc).name}, and its "
                f"workers with it; {_newest_checkpoint(error_dir)}",
                file=sys.stderr,
            )
            return 128 - rc
        return rc


def _newest_checkpoint(error_dir: Path) -> str:
    """ "the newest checkpoint is step N (DIR)", or why there is none (a step folder is committed once named)."""
    reported = error_dir / CHECKPOINTS
    if not reported.is_file():
        return "no checkpoint: the job stopped before it began training"
    if not reported.read_text():
        return "no checkpoint (checkpoint.enable=false)"
    root = Path(reported.read_text())
    steps = sorted(int(e.name) for e in root.iterdir() if e.name.isdigit()) if root.is_dir() else []
    return (
        f"the newest checkpoint is step {steps[-1]} ({root / str(steps[-1])})"
        if steps
        else f"no checkpoint in {root} yet"
    )


def _check_reach(spec: LaunchSpec) -> None:
    """The rendezvous store answers at ``--rdzv-endpoint`` within ``read_timeout`` (or REACH_TIMEOUT_S): else one
    line naming the endpoint, what was found and the bound, not torchrun's traceback after 111 s."""
    host, _, port_text = spec.rdzv_endpoint.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise LaunchError(f"--rdzv-endpoint={spec.rdzv_endpoint}: expected HOST:PORT, e.g. --rdzv-endpoint=node0:29400")
    try:
        bound = float(spec.rdzv_conf.get("read_timeout", REACH_TIMEOUT_S))
    except ValueError:
        raise LaunchError(f"--rdzv-conf read_timeout={spec.rdzv_conf['read_timeout']}: seconds, e.g. 60") from None
    problem = reach_problem(host.strip("[]"), int(port_text), bound)
    if problem is not None:
        raise LaunchError(
            f"--rdzv-endpoint={spec.rdzv_endpoint}: no rendezvous store there within {bound:g} s: {problem}; start "
            f"`functitan rendezvous --port {port_text}` on {host} first (or fix the address; "
            "--rdzv-conf read_timeout=SECONDS waits longer)"
        )


def _wait(proc: subprocess.Popen) -> int:
    while True:
        try:
            return proc.wait()
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            continue
