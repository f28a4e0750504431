"""Per-rank memory and collective bytes of a candidate: traced at 1 and 2 blocks per stage, extrapolated.

Memory and communication are affine in the number of blocks a rank holds (each block adds the same params,
states, saved activations and collectives), so the step is traced twice and extended to the real count:
``v(k) = v(a) + (k - a) * (v(a + 1) - v(a))``, with ``a = 2`` blocks without pipelining (from two blocks on,
FSDP's prefetch holds the next block's gather: one block alone has none, measured 20% off) and one and two
blocks per stage with pipelining. Ranks that are
alike are traced once: without pipelining every rank runs the same program on equal shapes (rank 0 holds the
largest shard where a split is uneven: DTensor splits like ``torch.chunk``); with pipelining the first and
the last pipeline rank are traced (embedding and most microbatches in flight; head and loss), the middle
ranks hold no more blocks or in-flight microbatches than the first. A gradient-accumulation step is traced
with two microbatches (the peak is reached by the second; collectives scale with the count). A pipeline rank
is traced with one and two microbatches and extended to the number its schedule keeps in flight (the
schedule simulator's ``peak_activations``): four small traces per rank instead of a full schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from .. import pipeline
from ..job_config import ParallelismConfig, build_schedule
from ..pipeline._generators import ScheduleName
from ..sharding import Layout
from ._candidates import Candidate, job_config
from ._cost import pipe_in_flight
from ._trace import Worlds, rank_mesh, trace_rank, young_heap

__all__ = ["Prediction", "predict", "ModelShape", "model_shape"]


class ModelShape(NamedTuple):
    """What the planner reads off a model: its block count, the config field that sets it, block costs."""

    n_blocks: int  # 0: the model declares no pipeline stages (traced whole)
    field: str | None  # the config field whose value is the block count
    stage_model: Any  # the StageModel (costs, keys) or None


def model_shape(model: Any, model_cfg: Any, seq_len: int) -> ModelShape:
    """Find the block count and the config field that sets it (the one field that, set to 1, leaves one block)."""
    if model.stages is None:
        return ModelShape(0, None, None)
    sm = model.stages(model_cfg, Layout(), seq_len=seq_len, dtype=torch.float32)
    for f in dataclasses.fields(model_cfg):
        value = getattr(model_cfg, f.name)
        if f.init and isinstance(value, int) and not isinstance(value, bool) and value == sm.n_blocks:
            try:
                blocks = model.params(dataclasses.replace(model_cfg, **{f.name: 1}))[sm.blocks_key]
            except (ValueError, TypeError, KeyError):
                continue
            if len(blocks) == 1:
                return ModelShape(sm.n_blocks, f.name, sm)
    return ModelShape(sm.n_blocks, None, sm)


class Prediction(NamedTuple):
    """One candidate's worst rank (bytes) and its collectives per step (see ``_trace.RankTrace.comm``)."""

    peak: float
    params: float
    opt_state: float
    grads: float
    rank: int  # the global rank whose peak this is
    comm: dict
    blocks: int  # blocks on that rank
    ops: float = 0.0  # ops dispatched per step on that rank


def _lerp(a: float, b: float, k: float) -> float:
    return a + (k - 1) * (b - a)


def _lerp_comm(c1: dict, c2: dict, k: float, scale: float) -> dict:
    out: dict = {}
    for axes in set(c1) | set(c2):
        for kind in set(c1.get(axes, {})) | set(c2.get(axes, {})):
            b1, n1 = c1.get(axes, {}).get(kind, [0, 0])
            b2, n2 = c2.get(axes, {}).get(kind, [0, 0])
            out.setdefault(axes, {})[kind] = [max(_lerp(b1, b2, k), 0.0) * scale, max(_lerp(n1, n2, k), 0.0) * scale]
    return out


def rank_blocks(shape: ModelShape, cand: Candidate) -> tuple[int, ...]:
    """The blocks each pp rank holds in the real model, rank 0 first: the trainer's own cut of the model's block
    costs (`pipeline.blocks_per_rank`, what `pipeline.make_stages` builds by default)."""
    if cand.pp == 1:
        return (shape.n_blocks,)
    return _blocks_per_rank(shape.stage_model, cand.pp, cand.schedule, cand.stages_per_rank)


@functools.cache  # the screen asks for every candidate; the cut depends only on these four
def _blocks_per_rank(stage_model: Any, pp: int, schedule: ScheduleName, v: int) -> tuple[int, ...]:
    """``pipeline.blocks_per_rank``, with the cut shared by the schedules of one stage count (``_layers``)."""
    par = ParallelismConfig(pp=pp, pipeline_schedule=schedule, stages_per_rank=v)
    # where the stages sit does not depend on the microbatch count: the fewest the schedule accepts do
    sched = build_schedule(par, pp * v)
    layers = _layers(stage_model, sched.num_stages)
    return tuple(sum(len(layers[s]) for s in sched.stages_of(r)) for r in range(sched.pp))


@functools.cache
def _layers(stage_model: Any, n_stages: int) -> tuple[range, ...]:
    """``pipeline.balanced_layers``: its exact split is a dynamic program of ``n_stages x n_blocks^2`` steps (0.1 s at
    126 blocks and 64 stages), and 1F1B and ZB-H1 on ``pp`` ranks, or interleaved 1F1B and ZB-V on half as many,
    cut the model into the same stages: 1.6 s of the 405B screen's 2.2 s before the cut was shared."""
    return pipeline.balanced_layers(stage_model, n_stages)


@young_heap()  # its two or more traces share one full collection
def predict(
    base_cfg: Any,
    model: Any,
    model_cfg: Any,
    shape: ModelShape,
    cand: Candidate,
    *,
    batch_size: int,
    seq_len: int,
    backend: str | None = None,
    worlds: Worlds | None = None,
    moe_load: float = 1.0,
) -> Prediction:
    """Trace ``cand`` (one or two ranks, two block counts) and extrapolate to the model's real size.

    ``backend``: the collectives' backend whose buffers count ("gloo" for CPU ranks; see ``trace_rank``).
    ``worlds``: the fake worlds and meshes kept between the candidates of one plan (``_trace.fake_worlds``).
    ``moe_load``: under ep, the traced rank's routed rows as a multiple of the balanced load (``trace_rank``)."""
    world, m = cand.world, cand.microbatches
    if shape.field is None:  # no block structure known: trace the whole model
        cfg = job_config(base_cfg, cand, batch_size=batch_size, seq_len=seq_len)
        t = trace_rank(cfg, model, model_cfg, world=world, rank=0, backend=backend, moe_load=moe_load)
        return Prediction(t.peak, t.params, t.opt_state, t.grads, 0, t.comm, shape.n_blocks, t.ops)
    real = rank_blocks(shape, cand)
    if cand.pp == 1:
        m_traced = min(m, 2)
        traced = dataclasses.replace(cand, microbatches=m_traced)
        cfg = job_config(base_cfg, traced, batch_size=batch_size // m * m_traced, seq_len=seq_len)
        # three and four blocks: the peak grows by the same bytes per block from three on. From two (FSDP's
        # prefetch holds the next block's gather from there) the slope 2 -> 3 still differed from the next ones
        # where the peak moved between program points: GPT-2 with a 1024-row position table was 6.9% under at 4
        # blocks (fsdp4), the same GPT-2 at 64 rows 3.8% over; traced at full size every count is exact.
        a = min(3, real[0])
        with rank_mesh(cfg.parallelism, world, 0, worlds) as mesh:
            t1, t2 = (
                trace_rank(
                    cfg,
                    model,
                    dataclasses.replace(model_cfg, **{shape.field: n}),
                    world=world,
                    rank=0,
                    mesh=mesh,
                    backend=backend,
                    moe_load=moe_load,
                )
                for n in (a, a + 1)
            )
        return _combine(t1, t2, real[0] - a + 1, 0, m / m_traced)
    real_inflight = pipe_in_flight(cand.pp, cand.schedule, cand.stages_per_rank, m)
    worst, most_ops = None, 0.0
    for pp_rank in sorted({0, cand.pp - 1}):
        rank = pp_rank * (world // cand.pp)
        grid = _pp_grid(
            base_cfg,
            model,
            model_cfg,
            shape,
            cand,
            batch_size=batch_size,
            seq_len=seq_len,
            rank=rank,
            backend=backend,
            worlds=worlds,
            moe_load=moe_load,
        )
        # in-flight microbatches on this rank with 1 and 2 microbatches, and in the real schedule
        i1, i2 = (pipe_in_flight(cand.pp, cand.schedule, cand.stages_per_rank, mt)[pp_rank] for mt in (1, 2))
        # from two microbatches on, each more in flight adds what the second added (zero-bubble schedules also
        # hold W's inputs, which the in-flight count does not see: two microbatches are the floor)
        u = 1.0 + ((real_inflight[pp_rank] - i2) / (i2 - i1) if i2 != i1 else 0.0)
        k = real[pp_rank] / cand.stages_per_rank  # blocks per stage on this rank, on average
        p1, p2 = _combine(grid[1, 1], grid[2, 1], k, rank, 1.0), _combine(grid[1, 2], grid[2, 2], k, rank, 1.0)
        peak = p1.peak + u * (p2.peak - p1.peak)
        comm = _lerp_comm(p1.comm, p2.comm, m, 1.0)  # collectives grow by microbatch, in flight or not
        most_ops = max(most_ops, _lerp(p1.ops, p2.ops, m))  # the busiest host paces the pipeline
        p = p2._replace(peak=peak, comm=comm, blocks=real[pp_rank])
        if worst is None or p.peak > worst.peak:
            worst = p
    if worst is None:  # unreachable: the loop visits pp rank 0
        raise RuntimeError(f"no pipeline rank was traced for {cand}")
    return worst._replace(ops=most_ops)


def _pp_grid(
    base_cfg,
    model,
    model_cfg,
    shape: ModelShape,
    cand: Candidate,
    *,
    batch_size: int,
    seq_len: int,
    rank: int,
    backend: str | None,
    worlds: Worlds | None = None,
    moe_load: float = 1.0,
) -> dict:
    """``{(blocks per stage, microbatches): trace}`` of one pipeline rank at 1 and 2 of each, in one mesh."""
    stages, m, field = cand.pp * cand.stages_per_rank, cand.microbatches, str(shape.field)
    grid = {}
    par = job_config(base_cfg, cand, batch_size=batch_size, seq_len=seq_len).parallelism
    with rank_mesh(par, cand.world, rank, worlds) as mesh:
        for mt in (1, 2):
            one = dataclasses.replace(cand, microbatches=mt)
            cfg = job_config(base_cfg, one, batch_size=batch_size // m * mt, seq_len=seq_len)
            for per_stage in (1, 2):
                layers = tuple(range(s * per_stage, (s + 1) * per_stage) for s in range(stages))
                mcfg = dataclasses.replace(model_cfg, **{field: stages * per_stage})
                grid[per_stage, mt] = trace_rank(
                    cfg,
                    model,
                    mcfg,
                    world=cand.world,
                    rank=rank,
                    stage_layers=layers,
                    mesh=mesh,
                    backend=backend,
                    moe_load=moe_load,
                )
    return grid


def _combine(t1, t2, k: float, rank: int, comm_scale: float, blocks: int | None = None) -> Prediction:
    # the peak is the max over program points of affine functions of k; the after-forward point is one of
    # them, so it bounds the extrapolated peak from below when the peak's location moves with k
    peak = max(_lerp(t1.peak, t2.peak, k), _lerp(t1.after_forward, t2.after_forward, k))
    return Prediction(
        peak=peak,
        params=_lerp(t1.params, t2.params, k),
        opt_state=_lerp(t1.opt_state, t2.opt_state, k),
        grads=_lerp(t1.grads, t2.grads, k),
        rank=rank,
        comm=_lerp_comm(t1.comm, t2.comm, k, comm_scale),
        blocks=int(round(k)) if blocks is None else blocks,
        ops=max(_lerp(t1.ops, t2.ops, k), 0.0) * comm_scale,
    )
