"""Enumerate the layouts a model can train with on a world size, pruned by the trainer's own validators.

A candidate is one value per trainer key (``[parallelism]`` degrees and schedule, ``training.microbatches``,
``remat``, ``param_dtype``); it becomes a ``JobConfig`` with ``job_config`` and is checked by the same
functions the trainer calls (``mesh.resolve_degrees``, ``Model.check_layout``, the trainer's batch split,
``pipeline.balance`` and the schedule's constraints). A layout family that fails is counted under the
validator's own message, so the plan says why it was pruned.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._choices import RematName
from ..job_config import JobConfig, ParallelismConfig, ParamDType, TrainingConfig
from ..mesh import resolve_degrees
from ..pipeline._generators import ScheduleName
from ..train import local_batch

__all__ = ["Candidate", "enumerate_candidates", "job_config", "SCHEDULES", "REMATS"]

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zb_v")  # gpipe: 1F1B's time with more memory, not offered
REMATS = ("none", "selective", "full")
SPLIT_BACKWARD = ("zb_h1", "zb_v")  # schedules with separate B and W passes


@dataclass(frozen=True, kw_only=True)
class Candidate:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    schedule: ScheduleName = "1f1b"  # with pp > 1
    stages_per_rank: int = 1
    microbatches: int = 1
    remat: RematName = "none"
    sequence_parallel: bool = True
    reshard_after_forward: bool = True
    param_dtype: ParamDType = "bfloat16"

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def label(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"rep{self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}" + ("" if self.reshard_after_forward else "(keep)"))
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            v = f"x{self.stages_per_rank}" if self.schedule == "interleaved_1f1b" else ""
            parts.append(f"pp{self.pp}:{self.schedule}{v}")
        parts.append(f"m{self.microbatches}")
        parts.append(f"remat={self.remat}")
        parts.append({"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[self.param_dtype])
        return " ".join(parts)


def job_config(base: JobConfig, c: Candidate, *, batch_size: int, seq_len: int) -> JobConfig:
    """``base`` with the candidate's layout and the planned batch: the config the trainer runs."""
    par = dataclasses.replace(
        base.parallelism,
        dp_replicate=c.dp_replicate,
        dp_shard=c.dp_shard,
        tp=c.tp,
        pp=c.pp,
        sequence_parallel=c.sequence_parallel,
        reshard_after_forward=c.reshard_after_forward,
        pipeline_schedule=c.schedule if c.pp > 1 else base.parallelism.pipeline_schedule,
        stages_per_rank=c.stages_per_rank if c.schedule == "interleaved_1f1b" else base.parallelism.stages_per_rank,
    )
    tr = dataclasses.replace(
        base.training,
        batch_size=batch_size,
        seq_len=seq_len,
        microbatches=c.microbatches,
        remat=c.remat,
        param_dtype=c.param_dtype,
    )
    return dataclasses.replace(base, parallelism=par, training=tr)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _why(e: Exception) -> str:
    return str(e).split("; ")[0]


def enumerate_candidates(
    model: Any,
    model_cfg: Any,
    *,
    world: int,
    per_node: int,
    batch_size: int,
    seq_len: int,
    n_blocks: int,
    param_dtypes: tuple[str, ...] = ("bfloat16",),
    max_microbatch_rows: int = 8,
) -> tuple[list[Candidate], Counter]:
    """``(valid candidates, Counter of pruned families by reason)``.

    ``n_blocks``: the model's number of pipeline blocks (``Model.stages(...).n_blocks``), 0 when it has none.
    Microbatch sizes are powers of two up to ``max_microbatch_rows`` rows.
    """
    pruned: Counter = Counter()
    out: list[Candidate] = []
    for tp in _divisors(world):
        if tp > per_node:
            pruned[f"tp={tp} > {per_node} devices per node: tensor-parallel collectives would cross nodes"] += 1
            continue
        for sp in (True,) if tp > 1 else (True,):
            try:
                if model.check_layout is not None:
                    model.check_layout(model_cfg, tp=tp, seq_len=seq_len, sequence_parallel=sp and tp > 1)
            except ValueError as e:
                pruned[f"tp={tp}: {_why(e)}"] += 1
                continue
            for pp in _divisors(world // tp):
                out.extend(
                    _with_pp(model, tp, pp, sp, world, batch_size, n_blocks, param_dtypes, max_microbatch_rows, pruned)
                )
    if any(c.tp > 1 for c in out):
        pruned[
            "sequence_parallel=false with tp > 1: same collective bytes as SP, more activation memory (dominated)"
        ] += 1
    return out, pruned


def _with_pp(model, tp, pp, sp, world, batch_size, n_blocks, dtypes, max_rows, pruned) -> Iterator[Candidate]:
    if pp > 1 and (model.stages is None or n_blocks == 0):
        pruned[f"pp={pp}: model {model.name!r} declares no pipeline stages"] += 1
        return
    schedules = SCHEDULES if pp > 1 else ("1f1b",)
    dp = world // (tp * pp)
    for sched in schedules:
        v = 2 if sched in ("interleaved_1f1b", "zb_v") else 1
        if pp > 1 and n_blocks < pp * v:
            pruned[f"pp={pp} {sched}: {n_blocks} blocks cannot fill {pp * v} stages"] += 1
            continue
        for rep in _divisors(dp):
            shard = dp // rep
            try:
                resolve_degrees(world, pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp)
                rows = local_batch(
                    JobConfig(
                        training=TrainingConfig(batch_size=batch_size, microbatches=1),
                        parallelism=ParallelismConfig(tp=tp, pp=pp),
                    ),
                    dp,
                )[0]
            except ValueError as e:
                pruned[f"dp={dp}: {_why(e)}"] += 1
                continue
            for mbs in (r for r in (1, 2, 4, 8, 16, 32) if r <= max_rows and rows % r == 0):
                m = rows // mbs
                if pp > 1 and m < pp:
                    pruned[f"pp={pp}: {m} microbatches < pp stages (the pipeline never fills)"] += 1
                    continue
                for remat in REMATS:
                    if remat == "selective" and sched in SPLIT_BACKWARD and pp > 1:
                        pruned[f"{sched} with remat=selective: selective checkpointing allows one backward pass"] += 1
                        continue
                    for reshard in (True, False) if shard > 1 and remat == "none" else (True,):
                        for dt in dtypes:
                            yield Candidate(
                                dp_replicate=rep,
                                dp_shard=shard,
                                tp=tp,
                                pp=pp,
                                schedule=sched,
                                stages_per_rank=v,
                                microbatches=m,
                                remat=remat,
                                sequence_parallel=sp,
                                reshard_after_forward=reshard,
                                param_dtype=dt,
                            )
