"""Durable small writes every checkpoint format shares: fsync a file or a directory, write a JSON document."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading


def fsync(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, doc: dict) -> int:
    """Write ``doc`` to ``path`` and fsync it; return its size in bytes."""
    data = json.dumps(doc, indent=1, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data)


def lower_priority() -> None:
    """Run the calling thread (a writer of an asynchronous save's pool) at the lowest CPU priority.

    The write (checksums, copies into the page cache) then takes the CPU mostly when the training loop leaves
    it idle: on a busy host the commit waits rather than the step. On 2 CPU cores the ranks fill, the step
    after a save (benchmarks/checkpoint_vs_dcp.py's) took ~365 ms longer than a plain one with the writers at
    the training's priority, ~100 ms at this one, staging included; the total over the steps until the
    commit stayed the same (0.41-0.42 s against 0.33-0.43 s: the write's CPU time is spent either way), spread
    over 6-10 steps instead of 1-2. Linux only: there a thread's nice value is its own (``setpriority`` on
    its thread id); the pool's threads end with the save.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
