"""One job per run folder: ``<run>/run.lock``, an ``flock`` held by the job's first rank while it trains.

Two jobs on one run folder (a requeue started while the old job still ran) interleave their checkpoints and
remove each other's saves in flight. The lock is an ``flock``: the kernel releases it when its holder dies, by
any signal, so a lock left by a dead job is never in the way; the file says who holds it (pid, host, since when)
for the message. Where ``flock`` does not work (some network file systems), the pid in the file decides: a
holder on this host that is not running any more is taken over.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..errors import UserError

__all__ = ["RunInUseError", "RunLock", "lock_run"]

LOCK_FILE = "run.lock"


class RunInUseError(UserError):
    """Another job holds the run folder; the message names it (pid, host) and the fix."""


class RunLock:
    """The held lock of one run folder (on the first rank; a no-op on the others). ``release()`` or ``with``."""

    def __init__(self, fd: int | None = None) -> None:
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _running_here(holder: dict) -> bool:
    """The holder is a live process of this host (other than us)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refusal(run_dir: Path, holder: dict) -> RunInUseError:
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    since = f" since {holder['since']}" if "since" in holder else ""
    return RunInUseError(
        f"run folder {run_dir} is in use by another job ({who}{since}, {run_dir / LOCK_FILE}); stop that job "
        f"first, or give this one another metrics.run_name (or metrics.run_dir)"
    )


def _try_lock(run_dir: Path) -> RunLock:
    """Take the lock on this process or raise RunInUseError naming its holder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(path)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                return RunLock()  # this process holds it already (a second run() in one process)
            raise _refusal(run_dir, holder) from None
        if _running_here(holder):  # no flock here (ENOLCK on a network file system): the pid decides
            os.close(fd)
            raise _refusal(run_dir, holder) from None
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    doc = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, doc, 0)
    return RunLock(fd)


def lock_run(run_dir: str | os.PathLike, *, wait_s: float = 0.0) -> RunLock:
    """Lock the run folder for this job (its first rank takes the lock; every rank calls this, at the same point).

    Raises RunInUseError on every rank when another job holds it. ``wait_s``: keep trying that long first (an
    elastic restart, whose previous workers may still be exiting).
    """
    run_dir = Path(run_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    lock, error = RunLock(), None
    if rank == 0:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                lock = _try_lock(run_dir)
                break
            except RunInUseError as exc:
                if time.monotonic() >= deadline:
                    error = str(exc)
                    break
                time.sleep(0.5)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RunInUseError(error)
    return lock
