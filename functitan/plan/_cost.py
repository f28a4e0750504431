"""The analytic side: memory by formula (ZeRO; Korthikanti et al. 2022) and step time by an alpha-beta model.

Memory per rank (bytes), for the screen that picks which candidates to trace and for the column printed
beside every traced peak:

    params + grads + optimizer state   (4 + 4 + 8) * P_rank            ZeRO-3 over dp_shard x cp (Rajbhandari
                                                                       2020; torchtitan's fsdp = dp_shard x cp)
    gathered params                    c * (top + 2 blocks) / tp       FSDP: this block + the prefetched one
    activations per block, per token   c * (6h + 4kv + 4f) / tp        all saved (SwiGLU, GQA, flash attention:
                                       c * (4h + 2kv + 2f) / tp        selective: matmul/attention outputs
                                       c * h / tp (+ one block)        full: the block input
    logits                             tokens * V / tp * (c + 8)       compute-dtype logits, fp32 loss + grad
    cp all-gather, per block           c * 2kv * seq / tp              the whole sequence's K and V, saved by
                                                                       attention (remat: one block's)
    cp all-gather's mask               c * seq / cp * seq              one additive causal mask, every layer's

with ``c`` the compute bytes, ``h, kv, f`` the model, kv and MLP widths, ``/tp`` with sequence parallelism
(Korthikanti et al.'s ``34 sbh / t`` without dropout, for a SwiGLU MLP and flash attention), and ``tokens`` a
rank's: a microbatch's rows x ``seq / cp`` (context parallelism holds ``1/cp`` of every sequence). Pipelines
multiply block activations by the microbatches their schedule keeps in flight (the simulator's count).

Time per step: compute = model FLOPs of the rank / (peak x achievable fraction), stretched by the pipeline
bubble of functitan's own schedule simulator; each collective costs ``alpha * (n-1) + bytes * (n-1)/n / bw``
(an all-reduce twice that) on the link level its group spans (NVLink inside a node, InfiniBand across). The
FSDP all-gather of the next block is prefetched (forward and backward), so it hides behind compute, and so does
a block's reduce-scatter, with or without activation checkpointing (it runs under the previous block's
backward); FSDP's group is ``dp_shard x cp``. Tensor-parallel, DDP, pipeline and context-parallel transfers are
synchronous in functitan and add up: cp's all-gather of every layer's K and V (``(cp-1)/cp`` of the whole
sequence's K/V bytes) in forward, the reduce-scatter of their gradients in backward, the all-gather again in the
recompute of remat (selective recomputes every all-gather); Ulysses' all-to-alls; ring's sends (overlapped in
forward, not in backward: counted whole). FLOPs split by the world, cp included: each cp rank holds ``1/cp`` of
the tokens and attends ``1/cp`` of the queries (the all-gather's masked attention computes every score of its
rows: the model's FLOP count, which does not halve causal attention, is what it runs). Host time is the ops the
trace dispatches on the rank times the device's seconds per op (Python, dispatcher, autograd, launch): on a GPU
the host queues kernels ahead, so compute and host time overlap (the larger counts); on a CPU the host is the
device, so they add (tiny models on CPU are mostly host time). Where local processes outnumber the cores (a
calibrated CPU, ``share`` ranks per core), rates are measured with all ranks busy and a rank idle in the pipeline
bubble lends its core to the others: the bubble stretches the step only by ``max(1, 1 / (share * (1 - bubble)))``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from .. import pipeline
from ..job_config import ParallelismConfig, build_schedule
from ._candidates import Candidate
from ._devices import Cluster

__all__ = [
    "pipe_bubble",
    "pipe_in_flight",
    "Time",
    "step_time",
    "analytic_memory",
    "analytic_comm",
    "axis_degree",
    "spans_nodes",
    "TIME_TOLERANCE",
]

# The cost model's stated error between layouts: step times within 5% of each other are a tie it cannot call
# (benchmarks/plan_vs_measured.py: layouts 5-15% apart measured in either order across runs; the top two of
# issue 30's Llama were 1.6% apart and one run picked the slower one)
TIME_TOLERANCE = 0.05

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
# FSDP's all-gathers and reduce-scatters, prefetched: over dp_shard x cp (mesh.FSDP_AXES), and under ep a dense
# param's over dp_shard x ep x cp (mesh.EP_DENSE: ep's ranks are data parallel for it)
FSDP_AXES = frozenset(("dp_shard", "ep", "cp"))
# the traced step's context-parallel attention traffic (``_trace``: a K/V tensor, not a flat parameter bucket),
# and the collective each costs as
CP_KINDS = {"cp_all_gather": "all_gather", "cp_reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all"}


class Time(NamedTuple):
    total: float  # seconds per step
    compute: float  # pure compute (with remat's recompute), before the bubble
    host: float  # host time: ops dispatched x seconds per op (overlaps compute on GPUs, adds to it on CPUs)
    work: float  # compute and host time together (the larger of the two on GPUs, their sum on CPUs)
    busy: float  # work stretched by the pipeline bubble
    bubble: float  # fraction of the pipeline idle (0 without pp)
    comm_exposed: float  # seconds of communication not hidden behind compute
    by_axis: dict  # axes -> seconds (all collectives on them, hidden or not)
    tokens_per_s: float
    mfu: float


def _degrees(c: Candidate) -> dict[str, int]:
    """The mesh's axis sizes (ep borrows from dp_shard x cp x tp: the mesh's ep axis holds its dp_shard ranks,
    ``functitan.mesh.check_ep``)."""
    borrowed = c.ep // (c.cp * c.tp) if c.ep > 1 else 1
    return {
        "pp": c.pp,
        "dp_replicate": c.dp_replicate,
        "dp_shard": c.dp_shard // borrowed,
        "ep": borrowed,
        "cp": c.cp,
        "tp": c.tp,
    }


def axis_degree(c: Candidate, axes: tuple[str, ...]) -> int:
    d = _degrees(c)
    return math.prod(d[a] for a in axes)


def spans_nodes(c: Candidate, axes: tuple[str, ...], per_node: int) -> bool:
    """Does the group of rank 0 over ``axes`` reach beyond the first node? (axis order pp, dp_replicate, dp_shard,
    ep, cp, tp with tp innermost: a rank's stride on an axis is the product of the inner degrees)."""
    d = _degrees(c)
    stride, top = 1, 0
    for a in reversed(_ORDER):
        if a in axes:
            top += (d[a] - 1) * stride
        stride *= d[a]
    return top >= per_node


def _steady(pp: int, v: int, m: int) -> int:
    """Past ``2 * stages`` microbatches a schedule is in steady state: its warm-up and cool-down (idle time,
    microbatches in flight) no longer grow, so it is built there and only its busy time scaled to ``m``."""
    return min(m, 2 * pp * v)


@functools.cache
def _schedule(pp: int, schedule: str, v: int, m: int) -> pipeline.Schedule:
    """Built once for its in-flight count and its timing (a 64-rank schedule takes ~20 ms to build)."""
    return build_schedule(ParallelismConfig(pp=pp, pipeline_schedule=schedule, stages_per_rank=v), m)


@functools.cache
def pipe_in_flight(pp: int, schedule: str, v: int, m: int) -> tuple[int, ...]:
    """Microbatches in flight per rank at its peak, read off the schedule's order (no timing: the screen asks
    this of every pipelined candidate, and timing a 64-rank schedule costs eight times as much)."""
    if pp == 1:
        return (1,)
    return pipeline.peak_activations(_schedule(pp, schedule, v, _steady(pp, v, m)))


@functools.cache
def pipe_bubble(pp: int, schedule: str, v: int, m: int) -> float:
    """The idle fraction of a schedule, from functitan's simulator with equal F, B and W costs."""
    if pp == 1:
        return 0.0
    steady = _steady(pp, v, m)
    # a built-in schedule: every kind of them is validated by tests/test_pipeline_schedules.py
    sim = pipeline.simulate(_schedule(pp, schedule, v, steady), validated=True)
    if m <= steady:
        return float(sim.bubble_fraction)
    idle, busy = sum(sim.idle), sum(sim.busy) * m / steady
    return float(idle / (idle + busy))


def pipeline_bubble(c: Candidate) -> float:
    return pipe_bubble(c.pp, c.schedule, c.stages_per_rank, c.microbatches)


def in_flight(c: Candidate) -> int:
    return max(pipe_in_flight(c.pp, c.schedule, c.stages_per_rank, c.microbatches))


def _collective_s(kind: str, nbytes: float, count: float, n: int, bw: float, alpha: float) -> float:
    if kind == "p2p":
        return count * alpha + nbytes / bw
    kind = CP_KINDS.get(kind, kind)  # all_to_all: bytes are what a rank holds, (n-1)/n of it sent
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (count * alpha * (n - 1) + nbytes * (n - 1) / n / bw)


def step_time(
    c: Candidate,
    cluster: Cluster,
    comm: dict,
    *,
    flops_per_token: float,
    tokens: int,
    n_blocks: int,
    ops: float = 0.0,
    bubble: float | None = None,
) -> Time:
    """Seconds per step (module docstring); ``ops``: the ops the busiest rank dispatches per step (traced);
    ``bubble``: the pipeline's idle fraction instead of its schedule's simulated one (0: a lower bound of the
    time, which grows with it)."""
    dev = cluster.device
    flops = flops_per_token * tokens / cluster.world * (4 / 3 if c.remat == "full" else 1.0)
    compute = flops / (dev.peak(c.param_dtype) * dev.efficiency)
    by_axis, exposed, hidden = {}, 0.0, 0.0
    for axes, kinds in comm.items():
        n = axis_degree(c, axes)
        if n <= 1:
            continue
        inter = spans_nodes(c, axes, cluster.per_node)
        bw, alpha = (dev.inter_bw, dev.inter_alpha) if inter else (dev.intra_bw, dev.intra_alpha)
        for kind, (nbytes, count) in kinds.items():
            t = _collective_s(kind, nbytes, count, n, bw, alpha)
            by_axis[axes] = by_axis.get(axes, 0.0) + t
            if FSDP_AXES.issuperset(axes) and kind in ("all_gather", "reduce_scatter"):
                hidden += t
            else:
                exposed += t
    b = pipeline_bubble(c) if bubble is None else bubble
    host = ops * dev.op_s
    # a GPU's host queues kernels ahead (the slower of the two paces the step); a CPU's host is the device
    work = max(compute, host) if dev.host_async else compute + host
    # ranks sharing cores (``share`` > 1) run at the rate measured with all of them busy; a rank idle in the
    # bubble lends its core to the others, so the bubble costs only once the rest cannot absorb it
    busy = work * max(1.0, 1.0 / (dev.share * (1 - b))) if b < 1 else math.inf
    # FSDP prefetch: the next block's all-gather (reduce-scatter) runs under this block's forward (backward);
    # the first (last) one is exposed
    exposed += max(hidden - work, hidden / max(n_blocks + 1, 2))
    total = busy + exposed
    return Time(
        total=total,
        compute=compute,
        host=host,
        work=work,
        busy=busy,
        bubble=b,
        comm_exposed=exposed,
        by_axis=by_axis,
        tokens_per_s=tokens / total,
        mfu=flops_per_token * tokens / (total * cluster.world * dev.peak(c.param_dtype)),
    )


class ModelDims(NamedTuple):
    h: int
    kv: int
    f: int
    vocab: int
    block_params: int  # the largest block's (a MoE block's, where the first ones are dense)
    top_params: int  # embedding, head, final norm
    n_blocks: int
    expert_params: int = 0  # of block_params, the routed experts' (sharded over ep and FSDP, never over tp)
    top_k: int = 0  # experts per token (the config's ``top_k``), for the screen's all-to-all bytes under ep


def analytic_memory(
    c: Candidate, d: ModelDims, *, seq_len: int, batch_size: int, blocks: int, first: bool = True, last: bool = True
) -> dict[str, float]:
    """Bytes per rank by formula (module docstring); ``blocks`` on this rank."""
    cb = _BYTES[c.param_dtype]
    tops = (0.5 if first else 0) + (0.5 if last else 0)
    dense_block = d.block_params - d.expert_params
    # dense params: tp x FSDP over dp_shard (ep's ranks included) x cp; routed experts: ep x FSDP over what ep left
    p_rank = (blocks * dense_block + tops * d.top_params) / (c.tp * c.fsdp) + blocks * d.expert_params / c.ep / c.efsdp
    mbs = batch_size // c.dp // c.microbatches
    tok = mbs * seq_len // c.cp  # this rank's tokens of a microbatch
    sp = c.tp
    per_block = (
        {
            "none": cb * (6 * d.h + 4 * d.kv + 4 * d.f),
            "selective": cb * (4 * d.h + 2 * d.kv + 2 * d.f),
            "full": cb * d.h,
        }[c.remat]
        * tok
        / sp
    )
    kv_all = 0.0  # the all-gather's whole-sequence K and V, per block, and its mask (one, shared)
    if c.cp > 1 and c.cp_attention == "allgather":
        kv_all = cb * 2 * d.kv * mbs * seq_len / c.tp
        # kept by attention for backward without remat; remat re-gathers them (selective recomputes every
        # all-gather, as it does FSDP's: ``_collectives.GATHERING``)
        per_block += kv_all if c.remat == "none" else 0.0
    stage_blocks = blocks / max(c.stages_per_rank, 1) if c.pp > 1 else blocks
    acts = per_block * (blocks if c.pp == 1 else stage_blocks * in_flight(c))
    if c.remat != "none":  # the block in recompute holds its gathered K/V
        acts += kv_all
    if c.remat == "full":
        acts += cb * (6 * d.h + 4 * d.kv + 4 * d.f) * tok / sp
    if kv_all:
        acts += cb * (seq_len // c.cp) * seq_len
    logits = tok * d.vocab / c.tp * (cb + 8) if last else 0.0
    gathered_block = dense_block / c.tp + d.expert_params / c.ep  # a block's params as its compute sees them
    if c.fsdp > 1:
        held = 2 if (c.reshard_after_forward or c.remat != "none") else blocks
        gathered = cb * (held * gathered_block + tops * d.top_params / c.tp)
    else:
        gathered = 2 * cb * gathered_block if cb < 4 else 0.0
    out = {
        "params": 4 * p_rank,
        "grads": 4 * p_rank,
        "opt_state": 8 * p_rank,
        "buffers": gathered,
        "activations": acts + logits,
    }
    out["total"] = sum(out.values())
    return out


def _fsdp_axes(c: Candidate, *, experts: bool = False) -> tuple[str, ...]:
    """The mesh axes of FSDP's group for dense params (``mesh.fsdp_groups``: dp_shard x cp flattened where both are
    > 1; under ep, dp_shard is ``dp_shard_ep``, dp_shard and ep as one) or, ``experts``, for the routed experts
    (what ep left of dp_shard: ep > 1 spans all of cp)."""
    degrees = _degrees(c)
    axes = ("dp_shard", "cp") if experts else ("dp_shard", "ep", "cp")
    axes = ("dp_shard",) if experts and c.ep > 1 else axes
    return tuple(a for a in axes if degrees[a] > 1)


def analytic_comm(c: Candidate, d: ModelDims, *, seq_len: int, batch_size: int, blocks: int) -> dict:
    """Collective bytes per step on each axis group by formula, in the trace's format (the screen's input)."""
    cb, m = _BYTES[c.param_dtype], c.microbatches
    mbs = batch_size // c.dp // m
    p_dense = (blocks * (d.block_params - d.expert_params) + d.top_params / max(c.pp, 1)) / c.tp
    p_experts = blocks * d.expert_params / c.ep
    tok = mbs * seq_len // c.cp  # a rank's tokens of a microbatch
    out: dict = {}
    regather = 2 if (c.reshard_after_forward or c.remat != "none") else 1
    # under ep the routed experts are gathered on their own group (what ep left of dp_shard)
    groups = [(_fsdp_axes(c), p_dense + (p_experts if c.ep == 1 else 0.0))]
    if c.ep > 1 and p_experts:
        groups.append((_fsdp_axes(c, experts=True), p_experts))
    for axes, p in groups:
        if axes:  # a group of more than one rank
            out[axes] = {
                "all_gather": [regather * p * cb * m, regather * (blocks + 1) * m],
                "reduce_scatter": [4 * p * m, (blocks + 1) * m],
            }
    if c.dp_replicate > 1:
        p_rank = p_dense / c.fsdp + p_experts / c.efsdp
        out[("dp_replicate",)] = {"all_reduce": [4 * p_rank * m, 9 * (blocks + 1) * m]}
    if c.tp > 1:
        act = tok * d.h * cb
        per = 4 + (2 if c.remat == "full" else 0)
        out[("tp",)] = {
            "all_gather": [per * act * blocks * m, per * blocks * m],
            "reduce_scatter": [per * act * blocks * m, per * blocks * m],
        }
    if c.cp > 1:
        again = 1 if c.remat == "none" else 2  # remat gathers K/V again in the recompute
        cp: dict = out.setdefault(("cp",), {})
        if c.cp_attention == "ulysses":  # q, k, v to heads and the output back, forward and backward
            local = tok * (2 * d.h + 2 * d.kv) * cb / c.tp
            cp["all_to_all"] = [(1 + again) * local * blocks * m, (1 + again) * 4 * blocks * m]
        elif c.cp_attention == "ring":  # K/V around the ring, their gradient accumulators in backward (fp32)
            kv = tok * 2 * d.kv / c.tp
            cp["p2p"] = [(again * cb + cb + 4) * kv * (c.cp - 1) * blocks * m, (again + 2) * c.cp * blocks * m]
        else:  # the whole sequence's K and V gathered (the payload: what the gather returns), dK, dV scattered
            kv = mbs * seq_len * d.kv * cb / c.tp
            cp["cp_all_gather"] = [again * 2 * kv * blocks * m, again * 2 * blocks * m]
            cp["cp_reduce_scatter"] = [2 * kv * blocks * m, 2 * blocks * m]
    if c.pp > 1:
        act = tok * d.h * cb / c.tp
        out[("pp",)] = {"p2p": [4 * act * m * c.stages_per_rank, 4 * m * c.stages_per_rank]}
    if c.ep > 1:  # each MoE block's dispatch and combine, forward and backward (and the recompute's forward)
        # a rank's routed rows: its sequence piece under SP, its share of the tokens where the group spans tp
        rows = tok / c.tp * max(d.top_k, 1) * d.h * cb
        n = (4 + (2 if c.remat == "full" else 0)) * blocks * m
        group = tuple(a for a in ("ep", "cp", "tp") if _degrees(c)[a] > 1)  # the experts' group: ep x cp x tp
        out[group] = {"all_to_all": [rows * n, 2 * n]}  # each a count exchange first
    return out
