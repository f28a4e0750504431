"""Peak memory of one device since the last reset: what a step needed, for the log line.

CUDA reports the caching allocator's high-water marks. A CPU reports the process's peak resident set
(``VmHWM``), which Linux resets when "5" is written to ``/proc/self/clear_refs``; without ``/proc``
(macOS) only the peak since process start exists (``ru_maxrss``), under a key that says so.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["reset_peak_memory", "peak_memory"]

_GIB = float(1 << 30)
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def reset_peak_memory(device: torch.device | str) -> bool:
    """Start a new peak-memory window for ``device``.

    Args:
      device: the training device.

    Returns:
      True when the peak was reset; False when this platform cannot reset it (then ``peak_memory``
      reports the peak since process start, under ``mem_max_rss_since_start_gib``).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    if device.type == "cpu":
        try:
            with open(_CLEAR_REFS, "w") as f:  # "5": reset the peak RSS to the current RSS (Linux >= 4.0)
                f.write("5")
            return True
        except OSError:  # no /proc (macOS) or not allowed (some sandboxes)
            return False
    return False


def _vm_hwm_bytes() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_memory(device: torch.device | str) -> dict[str, float | int]:
    """Peak memory of ``device`` since the last ``reset_peak_memory`` (in GiB, plus counts on CUDA).

    Args:
      device: the training device.

    Returns:
      CUDA: ``mem_max_alloc_gib`` (``torch.cuda.max_memory_allocated``, live tensors),
      ``mem_max_reserved_gib`` (``max_memory_reserved``, what the allocator holds: the number that hits
      OOM), ``mem_max_reserved_pct`` (of the device's total), ``mem_alloc_retries`` (cudaMalloc retries
      after a cache flush: a sign of fragmentation) and ``mem_ooms``.
      CPU on Linux: ``mem_max_rss_gib`` (``VmHWM``, resettable). CPU elsewhere:
      ``mem_max_rss_since_start_gib`` (``ru_maxrss``, not resettable). Other devices: ``{}``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        reserved = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return {
            "mem_max_alloc_gib": torch.cuda.max_memory_allocated(device) / _GIB,
            "mem_max_reserved_gib": reserved / _GIB,
            "mem_max_reserved_pct": 100.0 * reserved / total,
            "mem_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "mem_ooms": int(stats.get("num_ooms", 0)),
        }
    if device.type == "cpu":
        hwm = _vm_hwm_bytes()
        if hwm is not None:
            return {"mem_max_rss_gib": hwm / _GIB}
        import resource  # POSIX only: imported where it is needed

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB elsewhere
        return {"mem_max_rss_since_start_gib": maxrss * scale / _GIB}
    return {}
