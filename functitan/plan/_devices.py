"""The cluster a plan is for: devices (memory, peak FLOP/s, link bandwidths) and how many of them.

Every number here is an assumption the planner prints beside its table. Peak FLOP/s come from the metrics
datasheet table (``functitan.metrics.peak_flops``'s, one source); memory is what ``torch.cuda`` reports as the
device's total; link figures are per-GPU unidirectional bandwidths of the usual HGX systems (NVLink within a
node, one InfiniBand NIC per GPU between nodes) and ring latencies typical of NCCL. ``--calibrate`` measures
this machine's matmul rate and gloo collectives instead (``calibrate``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..metrics._peak import _table_lookup

__all__ = ["Device", "Cluster", "DEVICES", "device", "calibrate", "matmul_rate", "op_time"]

_GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator and its links (bytes, FLOP/s, bytes/s, seconds)."""

    name: str
    memory: float  # bytes a process may use (the device total)
    peak_bf16: float  # dense FLOP/s in bf16
    peak_fp32: float  # dense FLOP/s in fp32 (TF32 tensor cores on GPUs)
    efficiency: float  # achievable fraction of peak for a transformer step's matmuls
    intra_bw: float  # bytes/s per device within a node (NVLink; CPU: loopback)
    intra_alpha: float  # seconds of latency per ring step within a node
    inter_bw: float  # bytes/s per device between nodes (InfiniBand)
    inter_alpha: float
    reserve: float  # bytes not available to tensors (CUDA context, NCCL buffers, allocator fragmentation)
    op_s: float  # host seconds per dispatched op (Python, dispatcher, autograd, kernel launch)
    host_async: bool  # the host queues kernels ahead of the device (GPUs): its time overlaps the device's
    share: float = 1.0  # ranks per core when local processes outnumber the cores (calibrated CPUs): rates are
    #                     measured with all of them running, and an idle rank's core goes to the others
    source: str  # where the numbers come from (printed)

    def peak(self, dtype: str) -> float:
        return self.peak_bf16 if dtype in ("bfloat16", "float16") else self.peak_fp32

    @property
    def usable(self) -> float:
        return self.memory - self.reserve


def _gpu(key: str, table_name: str, mem_gib: float, intra_gbs: float, inter_gbs: float) -> Device:
    bf16 = _table_lookup(table_name, "bf16", None).value
    tf32 = _table_lookup(table_name, "tf32", None).value
    if bf16 is None or tf32 is None:
        raise ValueError(f"device table {table_name!r} lacks a bf16 or tf32 peak; give both (FLOP/s) in its entry")
    return Device(
        name=key,
        memory=mem_gib * _GIB,
        peak_bf16=bf16,
        peak_fp32=tf32,
        efficiency=0.45,
        intra_bw=intra_gbs * 1e9,
        intra_alpha=5e-6,
        inter_bw=inter_gbs * 1e9,
        inter_alpha=10e-6,
        reserve=6 * _GIB,
        op_s=10e-6,
        host_async=True,
        source=f"{table_name} datasheet peak; {mem_gib} GiB; NVLink {intra_gbs:g} GB/s and IB "
        f"{inter_gbs:g} GB/s per GPU; 5/10 us latency; 45% of peak achievable; 6 GiB reserved; "
        "10 us of host time per op (eager launch), overlapped with the device's work",
    )


def matmul_rate(n: int = 512, budget_s: float = 0.3, *, best: bool = True) -> float:
    """fp32 square-matmul FLOP/s of this CPU over ``budget_s``: the best call (rides out a busy machine), or with
    ``best=False`` the throughput (calls done / time taken: what a process gets while others share the cores)."""
    return 2 * n**3 / _per_call(torch.mm, (torch.randn(n, n), torch.randn(n, n)), budget_s, best)


def op_time(budget_s: float = 0.3, *, best: bool = True) -> float:
    """Host seconds per dispatched op of a training step: a chain of 16-wide matmuls and elementwise ops (kernels
    next to free), its forward recorded by autograd and its backward run, timed and divided by the ops it
    dispatches. A training step's op also records its autograd node and runs its backward through the engine: a
    bare ``torch.add`` on 64 elements takes ~0.4x as long. (The planner's trace counts a step's dispatched ops;
    under FakeTensorMode it also counted the autograd engine's device queries, which doubled the count.)"""
    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(8)]
    x = torch.randn(4, 16)

    def step() -> None:
        h = x
        for w in ws:
            h = torch.nn.functional.silu(h @ w) * 0.5 + h
        torch.autograd.grad(h.square().mean(), ws)

    counter = _OpCount()
    with torch.enable_grad():  # a caller's no_grad would leave nothing to differentiate
        with counter:
            step()
        return _per_call(step, (), budget_s, best) / counter.ops


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _per_call(fn, args, budget_s: float, best: bool) -> float:
    fastest, calls = math.inf, 0
    start = time.perf_counter()
    deadline = start + budget_s
    while True:
        t0 = time.perf_counter()
        fn(*args)
        t1 = time.perf_counter()
        fastest, calls = min(fastest, t1 - t0), calls + 1
        if t1 > deadline:
            return fastest if best else (t1 - start) / calls


def _cpu() -> Device:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * (1 << 30)
    fp32 = matmul_rate()
    return Device(
        name="cpu",
        memory=float(total),
        peak_bf16=fp32 / 8,
        peak_fp32=fp32,
        efficiency=0.6,
        intra_bw=1e9,
        intra_alpha=100e-6,
        inter_bw=0.1e9,
        inter_alpha=500e-6,
        reserve=0.0,
        op_s=op_time(0.1),
        host_async=False,
        source="this machine: host memory; fp32 matmul rate and host time per op measured (bf16 = fp32 / 8 "
        "without AMX); gloo loopback 1 GB/s, 100 us per ring step (--calibrate measures them); 60% achievable",
    )


# name -> factory (the CPU entry measures the matmul rate, so it is built on demand)
DEVICES = {
    "h100": lambda: _gpu("h100", "H100", 79.6, 450.0, 50.0),
    "h200": lambda: _gpu("h200", "H200", 139.8, 450.0, 50.0),
    "a100": lambda: _gpu("a100", "A100", 79.2, 300.0, 25.0),
    "cpu": _cpu,
}


def device(name: str) -> Device:
    """The device table's entry ``name`` (ValueError naming the known ones)."""
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"--device={name!r} is not in the device table; choose one of {sorted(DEVICES)}")
    return DEVICES[key]()


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``per_node`` devices; a mesh axis whose group spans nodes runs at the inter-node figures."""

    device: Device
    nodes: int
    per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


def _calibrate_worker(sizes: tuple[int, ...], reps: int) -> tuple[float, float, list[float]]:
    """On each of the concurrent processes: its matmul rate and host time per op, as throughputs while all of
    them run (they share the cores, as training ranks do), and the median time of an all-reduce of each size."""
    import torch.distributed as dist

    dist.barrier()
    rate = matmul_rate(512, 0.5, best=False)
    dist.barrier()
    op = op_time(0.3, best=False)
    times = []
    for n in sizes:
        x = torch.zeros(n // 4)
        dist.all_reduce(x)
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t0)
        times.append(sorted(ts)[len(ts) // 2])
    return rate, op, times


def calibrate(dev: Device, *, processes: int = 2) -> Device:
    """``dev`` with this machine's numbers, measured on ``processes`` concurrent local processes (gloo): the
    fp32 matmul rate and host time per op each gets while the others run (efficiency 1: it is the achievable
    rate), the alpha-beta fit of an all-reduce, and (CPU) how many processes share a core."""
    from ..testing import run_distributed

    sizes = (4 << 10, 4 << 20)
    results = run_distributed(_calibrate_worker, processes, sizes, 9, timeout=300)
    rates = sorted(r for r, _, _ in results)
    fp32 = rates[len(rates) // 2]
    op = sorted(o for _, o, _ in results)[len(results) // 2]
    t_small, t_big = results[0][2]
    ring = 2 * (processes - 1)  # ring steps of an all-reduce
    alpha = t_small / ring
    # at 4 MiB the bytes take at least half the time: a noisy small-size median cannot make the slope vanish
    bw = max(2 * (processes - 1) / processes * (sizes[1] - sizes[0]) / max(t_big - t_small, t_big / 2), 1e6)
    cpu = dev.name == "cpu"
    share = max(processes / len(os.sched_getaffinity(0)), 1.0) if cpu else 1.0
    return replace(
        dev,
        peak_fp32=fp32 if cpu else dev.peak_fp32,
        peak_bf16=fp32 / 8 if cpu else dev.peak_bf16,
        efficiency=1.0 if cpu else dev.efficiency,
        intra_bw=bw,
        intra_alpha=alpha,
        inter_bw=bw if cpu else min(bw, dev.inter_bw),
        inter_alpha=alpha,
        op_s=op if cpu else dev.op_s,
        share=share,
        source=f"calibrated here with {processes} processes: fp32 matmul {fp32 / 1e9:.2f} GFLOP/s per "
        f"process; gloo all-reduce {bw / 1e9:.3f} GB/s, {alpha * 1e6:.0f} us per ring step"
        + (f"; {op * 1e6:.1f} us of host time per op" if cpu else f"; {dev.op_s * 1e6:.0f} us of host time per op")
        + (f"; {share:g} processes per core (an idle rank's core goes to the others)" if share > 1 else ""),
    )
