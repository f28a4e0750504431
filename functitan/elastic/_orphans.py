"""No process outlives the ``functitan`` launcher that started it, whatever kills the launcher (even SIGKILL).

The launcher cannot clean up after a SIGKILL, so each process below it watches for itself:

* torchrun runs as ``python -m functitan.elastic._torchrun``: it asks the kernel for SIGKILL when its parent, the
  launcher, dies (Linux ``prctl(PR_SET_PDEATHSIG)``), then runs torchrun's own ``main``;
* each worker (``functitan.train`` under the launcher) watches the launcher's pid and its torchrun agent's in a
  daemon thread (a pidfd: no polling) and SIGKILLs itself when either is gone.

So a scheduler that SIGKILLs the launcher, then restarts the job at once, never finds the old workers still
writing into the run directory. What a SIGKILL takes is the work since the newest committed checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time

__all__ = ["LAUNCHER_PID", "die_with_parent", "watch_launcher"]

LAUNCHER_PID = "FUNCTITAN_LAUNCHER_PID"  # set by the launcher in torchrun's environment: its own pid
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent (pid ``parent``) dies; exit now if it already
    did. Linux only (elsewhere the workers' watch still stops the job's workers)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect: we were reparented already
        os._exit(128 + int(sig))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _watch(pids: list[int]) -> None:
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)
        except (OSError, AttributeError):  # no pidfd (not Linux >= 5.3): poll
            fds = []
            break
    if fds:
        select.select(fds, [], [])  # a pidfd turns readable when its process has exited
    else:
        while not any(map(_gone, pids)):
            time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)  # no checkpoint: nobody is left to wait for it, and a restart may be running


def watch_launcher() -> None:
    """On a worker started by the launcher: die as soon as the launcher or this worker's torchrun agent is gone.

    Does nothing outside the launcher (``$FUNCTITAN_LAUNCHER_PID`` unset): a plain torchrun or one process."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or not launcher.isdigit():
        return
    pids = sorted({int(launcher), os.getppid()})
    threading.Thread(target=_watch, args=(pids,), name="functitan-launcher-watch", daemon=True).start()
