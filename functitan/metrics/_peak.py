"""Peak dense FLOP/s of the device a run trains on: the denominator of MFU.

GPUs are looked up in a table of vendor datasheet numbers, matched on ``torch.cuda.get_device_name``; a
CPU is measured with a short matmul calibration. An accelerator that is not in the table gets no number at
all (``value=None``), so MFU is reported absent rather than computed against a guessed peak (torchtitan
silently falls back to A100 numbers; a wrong denominator is worse than none).
"""

from __future__ import annotations

import functools
import math
import re
import time
from typing import NamedTuple

import torch

__all__ = ["PeakFlops", "peak_flops"]

_T = 1e12


class PeakFlops(NamedTuple):
    """A peak FLOP/s and where it came from.

    Attributes:
      value: dense FLOP/s of one device for the dtype, or None when unknown (MFU is then None too).
      source: ``"table:<name>"`` (datasheet), ``"cpu-calibrated"`` (measured) or ``"unknown:<why>"``.
    """

    value: float | None
    source: str


class _Entry(NamedTuple):
    pattern: str  # regex searched in torch.cuda.get_device_name()
    name: str
    sms: int | None  # SMs (CUs on AMD) of the full chip; fewer on the device means a MIG slice
    tflops: dict[str, float]  # dense TFLOP/s by "bf16" | "fp16" | "tf32" | "fp32"


def _e(
    pattern: str,
    name: str,
    sms: int | None,
    bf16: float | None,
    fp16: float | None,
    tf32: float | None,
    fp32: float | None,
) -> _Entry:
    tflops = {k: v for k, v in (("bf16", bf16), ("fp16", fp16), ("tf32", tf32), ("fp32", fp32)) if v is not None}
    return _Entry(pattern, name, sms, tflops)


# Dense (no 2:4 sparsity) tensor-core peaks at boost clock, from each vendor's datasheet; the datasheets
# quote sparse numbers for bf16/fp16/tf32 with a footnote, which are halved here. "fp32" is the non-tensor
# (or, on AMD, matrix-core) FP32 peak. The first matching pattern wins, so longer names come first
# (A100 before A10, L40S before L40 before L4, H100 NVL/PCIe before H100).
_TABLE: tuple[_Entry, ...] = (
    #  pattern                     name           SMs   bf16     fp16     tf32    fp32
    _e(r"\bB200\b", "B200", None, 2250.0, 2250.0, 1100.0, None),
    _e(r"\bGH200\b", "GH200", 132, 989.4, 989.4, 494.7, 67.0),
    _e(r"\bH200 NVL\b", "H200 NVL", 132, 835.5, 835.5, 417.5, 60.0),
    _e(r"\bH200\b", "H200", 132, 989.4, 989.4, 494.7, 67.0),
    _e(r"\bH100 NVL\b", "H100 NVL", 132, 835.5, 835.5, 417.5, 60.0),
    _e(r"\bH100 PCIe\b", "H100 PCIe", 114, 756.5, 756.5, 378.0, 51.0),
    _e(r"\bH100\b", "H100 SXM", 132, 989.4, 989.4, 494.7, 67.0),
    _e(r"\bH800 PCIe\b", "H800 PCIe", 114, 756.5, 756.5, 378.0, 51.0),
    _e(r"\bH800\b", "H800 SXM", 132, 989.4, 989.4, 494.7, 67.0),
    _e(r"\bH20\b", "H20", 78, 148.0, 148.0, 74.0, 44.0),
    _e(r"\bA100\b", "A100", 108, 312.0, 312.0, 156.0, 19.5),
    _e(r"\bA800\b", "A800", 108, 312.0, 312.0, 156.0, 19.5),
    # NVIDIA publishes no A10G datasheet (it is AWS's variant of the A10): these are the A10's numbers.
    _e(r"\bA10G\b", "A10G(A10 datasheet)", None, 125.0, 125.0, 62.5, 31.2),
    _e(r"\bA10\b", "A10", 72, 125.0, 125.0, 62.5, 31.2),
    _e(r"\bA30\b", "A30", 56, 165.0, 165.0, 82.0, 10.3),
    _e(r"\bA40\b", "A40", 84, 149.7, 149.7, 74.8, 37.4),
    _e(r"\bL40S\b", "L40S", 142, 362.05, 362.05, 183.0, 91.6),
    _e(r"\bL40\b", "L40", 142, 181.05, 181.05, 90.5, 90.5),
    _e(r"\bL4\b", "L4", 58, 121.0, 121.0, 60.0, 30.3),
    # Volta and Turing have fp16 tensor cores but no bf16 and no tf32: bf16 is absent, fp32 is plain fp32.
    _e(r"\bV100S\b", "V100S PCIe", 80, None, 130.0, None, 16.4),
    _e(r"\bV100-PCIE\b", "V100 PCIe", 80, None, 112.0, None, 14.0),
    _e(r"\bV100\b", "V100 SXM2", 80, None, 125.0, None, 15.7),
    _e(r"\bT4\b", "T4", 40, None, 65.0, None, 8.1),
    # AMD Instinct: "SMs" are compute units; fp32 is the FP32 matrix peak.
    _e(r"\bMI325X\b", "MI325X", 304, 1307.4, 1307.4, 653.7, 163.4),
    _e(r"\bMI300X\b", "MI300X", 304, 1307.4, 1307.4, 653.7, 163.4),
    _e(r"\bMI300A\b", "MI300A", 228, 980.6, 980.6, 490.3, 122.6),
)

_DTYPE_KEYS = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "tf32": "tf32",
}


def _dtype_key(dtype: torch.dtype | str) -> str:
    key = _DTYPE_KEYS.get(dtype)
    if key is None:
        raise ValueError(
            f"peak_flops: no peak is tabled for dtype {dtype!r}; pass the matmul dtype of the step: "
            "torch.bfloat16, torch.float16, torch.float32 or 'tf32'"
        )
    return key


def _cuda_fp32_uses_tf32() -> bool:
    # fp32_precision reflects both the new API and the legacy set_float32_matmul_precision / allow_tf32;
    # reading the legacy flags after the new API was used raises, so only this one is read.
    return getattr(torch.backends.cuda.matmul, "fp32_precision", "none") == "tf32"


def _table_lookup(device_name: str, key: str, sm_count: int | None) -> PeakFlops:
    for entry in _TABLE:
        if re.search(entry.pattern, device_name):
            break
    else:
        return PeakFlops(None, f"unknown:{device_name}")
    if key == "fp32" and _cuda_fp32_uses_tf32() and "tf32" in entry.tflops:
        key = "tf32"
    tflops = entry.tflops.get(key)
    if tflops is None:
        return PeakFlops(None, f"table:{entry.name} has no {key} peak")
    value, label = tflops * _T, f"table:{entry.name}"
    if entry.sms is not None and sm_count is not None and 0 < sm_count < entry.sms:
        # A MIG slice (or a partitioned GPU) exposes fewer SMs at the same clock: scale the peak with them.
        value *= sm_count / entry.sms
        label += f" x{sm_count}/{entry.sms} SMs"
    return PeakFlops(value, label if key in ("bf16", "fp16") else f"{label} {key}")


def _best_mm_seconds(a: torch.Tensor, b: torch.Tensor, budget_s: float) -> float:
    """Fastest of at least two ``a @ b`` calls made within ``budget_s``."""
    best, deadline = math.inf, time.perf_counter() + budget_s
    for i in range(50):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        if i >= 1 and time.perf_counter() > deadline:
            break
    return best


@functools.cache
def _cpu_calibrated(dtype: torch.dtype, threads: int, rounds: int = 3) -> float:
    """Best square-matmul FLOP/s of this CPU in ``dtype`` (cached per process, dtype and thread count).

    Sizes grow from 128 to 1024 and the best rate wins; growth stops once one call takes over 20 ms (CPU
    bf16 without AMX runs ~100x slower than fp32, so a fixed size would take seconds there). Another
    process can only make a matmul slower, so the rate is the *maximum* over ``rounds`` sweeps, each a
    best-of timing within a small budget per size: a burst of load during one sweep (a multi-threaded
    matmul waiting a whole scheduler slice for its second thread) does not lower the peak. A calibration
    that still ran slow makes the achieved rate exceed it; ``throughput`` then reports no MFU rather than
    one over 100%. Total time stays around 0.3-0.9 s.
    """
    del threads  # part of the cache key only: the rate scales with torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    best_rate = 0.0
    for _ in range(rounds):
        for n in (128, 256, 512, 1024):
            a = torch.randn(n, n, generator=gen).to(dtype)
            b = torch.randn(n, n, generator=gen).to(dtype)
            seconds = _best_mm_seconds(a, b, budget_s=0.03)
            best_rate = max(best_rate, 2 * n**3 / seconds)
            if seconds > 0.02:
                break
    return best_rate


def peak_flops(device: torch.device | str, dtype: torch.dtype | str) -> PeakFlops:
    """Dense peak FLOP/s of one device for matmuls in ``dtype``.

    CUDA and ROCm devices are looked up by ``torch.cuda.get_device_name`` in a table of datasheet numbers
    (``source="table:<name>"``); ``torch.float32`` means the TF32 peak when TF32 matmuls are enabled
    (``torch.backends.cuda.matmul.fp32_precision == "tf32"``), else the plain FP32 peak. A MIG slice gets the
    full chip's peak scaled by its share of SMs. A CPU is measured once per process with a short matmul
    calibration (``source="cpu-calibrated"``): that is the *achievable* matmul rate of this machine with
    the current ``torch.get_num_threads()``, not a datasheet number. Anything else (an unknown GPU, MPS,
    a dtype the chip has no units for) gives ``value=None``, never a guess.

    Args:
      device: the training device, e.g. ``"cuda:0"`` or ``torch.device("cpu")``.
      dtype: the matmul dtype of the step: ``torch.bfloat16``, ``torch.float16``, ``torch.float32``,
        or ``"tf32"`` to ask for the TF32 peak explicitly.

    Returns:
      ``PeakFlops(value, source)``.

    Example:
      >>> p = peak_flops("cpu", torch.float32)
      >>> p.source, p.value > 0
      ('cpu-calibrated', True)
    """
    key = _dtype_key(dtype)
    device = torch.device(device)
    if device.type == "cpu":
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(key, torch.float32)
        return PeakFlops(_cpu_calibrated(torch_dtype, torch.get_num_threads()), "cpu-calibrated")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sms = getattr(torch.cuda.get_device_properties(device), "multi_processor_count", None)
        return _table_lookup(name, key, sms)
    return PeakFlops(None, f"unknown:{device.type}")
