"""Preemption: SIGTERM or SIGINT stops training at the next step boundary, after a checkpoint.

A scheduler sends SIGTERM (and SIGKILL a grace period later); a user presses Ctrl-C. Either way the trainer
finishes the step in flight, saves a checkpoint and exits 0, and the same command resumes a named run. A second
signal, at least ``DUPLICATE_S`` after the first, kills the process at once with the default action; the
checkpoint commit is one atomic rename, so nothing that was committed can be damaged by it. (Within
``DUPLICATE_S`` a repeat is the same stop delivered twice: a scheduler that signals every process of the job
while torchrun forwards the signal to its workers.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Preemption", "Preempted", "DUPLICATE_S"]

DUPLICATE_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Raised inside ``Preemption.interruptible()`` when the stop signal arrives there."""


class Preemption:
    """The stop request of one training run: which signal arrived, if any. Install it around the loop.

    >>> with Preemption() as stop:
    ...     stop.agreed()  # no signal: 0 on every rank
    0
    """

    def __init__(self) -> None:
        self.signum = 0  # the first signal received, 0 when none
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self._interruptible = False

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            if self._interruptible:
                raise Preempted(signum)
        elif now - self._first_at >= DUPLICATE_S:  # a second stop: exit now, as if no handler were installed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A wait that the stop may cut short (waiting for peers that may never come): raises ``Preempted``."""
        if self.signum:
            raise Preempted(self.signum)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def agreed(self, device: torch.device | str = "cpu", group: Any = None) -> int:
        """The signal any rank of ``group`` received (the largest number), the same on every rank; 0 for none.

        Ranks stop at the same step boundary, so the checkpoint they save is one collective save.
        """
        if not (dist.is_initialized() and dist.get_world_size(group) > 1):
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
