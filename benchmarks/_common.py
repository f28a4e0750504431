"""Helpers shared by the benchmarks: interleaved timing, medians, environment facts, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["interleaved", "median", "environment", "write_json", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a wall-clock interval covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    fns: dict[str, Callable[[], Any]], *, steps: int, warmup: int, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and process-CPU seconds per call of each ``fns[name]``, in alternating rounds (A B C, C B A, ...).

    Alternating cancels slow drift (other processes, thermal state) that would bias back-to-back blocks, and
    reversing the order every round cancels any cost one function leaves to the next (cache state, freed
    memory). ``warmup`` rounds run first and are not timed. Process CPU time does not count the time this
    process waited for a core, so on a shared machine it is the steadier of the two (it does count cache
    and memory-bandwidth contention, and every thread of the process).
    """
    names = list(fns)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + steps):
        for name in names if r % 2 == 0 else reversed(names):
            synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            synchronize(device)
            if r >= warmup:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return wall, cpu


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def environment(threads: int, device: torch.device) -> dict[str, Any]:
    """What a result depends on besides the code: versions, threads, cores, and how busy the machine was."""
    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": str(device),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path
