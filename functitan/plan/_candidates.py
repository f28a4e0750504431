"""Enumerate the layouts a model can train with on a world size, pruned by the trainer's own validators.

A candidate is one value per trainer key (``[parallelism]`` degrees and schedule, ``training.microbatches``,
``remat``, ``param_dtype``); it becomes a ``JobConfig`` with ``job_config`` and is checked by the same
functions the trainer calls (``mesh.resolve_degrees``, ``Model.check_layout``, the trainer's ``check_model``
for context parallelism, the trainer's batch split, ``pipeline.balance`` and the schedule's constraints). A
layout family that fails is counted under the validator's own message, so the plan says why it was pruned.

Context parallelism (``cp``, powers of two) is offered for long sequences only: while each cp rank keeps at
least ``min_cp_tokens`` (8192) tokens of every sequence. Below that a cp split holds the same tokens per rank as
the batch split it replaces and adds the K/V traffic of every layer (and the all-gather's mask), so it never
wins; the Llama 3 paper's CP 16 at 131,072 tokens keeps 8192 per rank, torchtitan's CP 8 at 262,144 keeps 32,768.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._choices import CPAttention, RematName
from .._model_setup import check_model, pipeline_refusal
from ..job_config import JobConfig, ParallelismConfig, ParamDType, TrainingConfig
from ..mesh import resolve_degrees
from ..model import expert_count
from ..pipeline._generators import ScheduleName
from ..train import local_batch

__all__ = ["Candidate", "enumerate_candidates", "job_config", "SCHEDULES", "REMATS", "MIN_CP_TOKENS"]

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zb_v")  # gpipe: 1F1B's time with more memory, not offered
REMATS = ("none", "selective", "full")
SPLIT_BACKWARD = ("zb_h1", "zb_v")  # schedules with separate B and W passes
MIN_CP_TOKENS = 8192  # cp > 1 is offered while each cp rank keeps at least this many tokens (module docstring)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: the sequence split over cp ranks (FSDP shards over dp_shard x cp)
    ep: int = 1  # expert parallel: borrows its ranks from dp_shard x cp x tp (functitan.mesh.check_ep)
    cp_attention: CPAttention = "allgather"  # with cp > 1
    schedule: ScheduleName = "1f1b"  # with pp > 1
    stages_per_rank: int = 1
    microbatches: int = 1
    remat: RematName = "none"
    sequence_parallel: bool = True
    reshard_after_forward: bool = True
    param_dtype: ParamDType = "bfloat16"

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """The ranks FSDP shards parameters over: ``dp_shard x cp`` (``mesh.FSDP_AXES``)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """The ranks FSDP shards a routed expert over: what ep leaves of ``dp_shard x cp x tp`` (torchtitan's
        efsdp), ``fsdp`` without ep."""
        return self.dp_shard * self.cp * self.tp // self.ep if self.ep > 1 else self.fsdp

    def label(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"rep{self.dp_replicate}")
        keep = "" if self.reshard_after_forward else "(keep)"  # on FSDP's first axis
        if self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}" + keep)
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.cp > 1:
            algo = "" if self.cp_attention == "allgather" else f":{self.cp_attention}"
            parts.append(f"cp{self.cp}{algo}" + ("" if self.dp_shard > 1 else keep))
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
        cp=c.cp,
        ep=c.ep,
        cp_attention=c.cp_attention if c.cp > 1 else base.parallelism.cp_attention,
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
    min_cp_tokens: int = MIN_CP_TOKENS,
    cp_attentions: tuple[str, ...] = ("allgather",),
    checked: dict | None = None,
) -> tuple[list[Candidate], Counter]:
    """``(valid candidates, Counter of pruned families by reason)``.

    ``n_blocks``: the model's number of pipeline blocks (``Model.stages(...).n_blocks``), 0 when it has none.
    Microbatch sizes are powers of two up to ``max_microbatch_rows`` rows. Context-parallel degrees are the powers
    of two that divide the world left by ``tp`` and leave each cp rank ``min_cp_tokens`` tokens or more (module
    docstring), each with the attentions ``cp_attentions``; the trainer's ``check_model`` prunes them, its verdicts
    kept in ``checked`` (pass one dict to calls that enumerate the same model: ``_check_cp``).
    """
    checked = {} if checked is None else checked
    pruned: Counter = Counter()
    out: list[Candidate] = []
    refused = {pp: pipeline_refusal(model, model_cfg, pp) for pp in _divisors(world) if pp > 1}  # the trainer's
    experts = expert_count(model.params(model_cfg))  # ep > 1 is offered where it divides them (and dp_shard)
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
            for cp, algo in _cp_degrees(
                model, model_cfg, tp, sp, world, seq_len, min_cp_tokens, cp_attentions, checked, pruned
            ):
                for pp in _divisors(world // (tp * cp)):
                    if refused.get(pp):
                        pruned[str(refused[pp])] += 1
                        continue
                    out.extend(
                        _with_pp(
                            model, tp, cp, algo, pp, sp, world, batch_size, n_blocks, param_dtypes, max_microbatch_rows,
                            experts, pruned,
                        )
                    )  # fmt: skip
    if any(c.tp > 1 for c in out):
        pruned[
            "sequence_parallel=false with tp > 1: same collective bytes as SP, more activation memory (dominated)"
        ] += 1
    return out, pruned


def _cp_degrees(
    model, model_cfg, tp, sp, world, seq_len, min_tokens, algos, checked, pruned
) -> Iterator[tuple[int, str]]:
    """``(cp, cp_attention)`` pairs to offer beside ``tp``: 1, and each power of two dividing ``world / tp`` that
    keeps ``min_tokens`` per cp rank and that the trainer's ``check_model`` accepts (``_check_cp``)."""
    yield 1, "allgather"
    withheld, cp = 0, 2
    while cp <= world // tp and (world // tp) % cp == 0:
        if seq_len // cp < min_tokens:
            withheld += 1
        else:
            for algo in algos:
                why = _check_cp(model, model_cfg, checked, tp=tp, sp=sp and tp > 1, cp=cp, seq_len=seq_len, algo=algo)
                if why is None:
                    yield cp, algo
                else:
                    shown = f"cp={cp}{f' x tp={tp}' if tp > 1 else ''}{f' {algo}' if len(algos) > 1 else ''}"
                    pruned[f"{shown}: {why}"] += 1
        cp *= 2
    if withheld:
        pruned[
            f"cp > 1 with fewer than {min_tokens} tokens of a sequence per cp rank: not offered (a batch split holds "
            "as many tokens per rank without the K/V traffic)"
        ] += withheld


def _check_cp(model, model_cfg, checked: dict, *, tp: int, sp: bool, cp: int, seq_len: int, algo: str) -> str | None:
    """The trainer's ``check_model`` for ``cp`` beside ``tp``: None, or its message. It refuses a sequence that
    does not cut into ``2 x cp (x tp)`` chunks before anything else (at once, so it runs for every such degree);
    its other checks (the model's attention through ``layout.attention``, on meta tensors: 0.2-0.6 s at 8B-405B
    shapes) do not depend on the degree under all-gather attention, so their verdict is kept in ``checked`` per
    ``(tp, sp, seq_len, attention)`` (and cp for the others)."""
    pieces = 2 * cp * (tp if sp else 1)
    key = (model.name, repr(model_cfg), tp, sp, seq_len, algo, *((cp,) if algo != "allgather" else ()))
    if seq_len % pieces == 0 and key in checked:
        return checked[key]
    kwargs = {} if algo == "allgather" else {"cp_attention": algo}
    try:
        check_model(model, model_cfg, tp=tp, pp=1, seq_len=seq_len, sequence_parallel=sp, cp=cp, **kwargs)
        why = None
    except ValueError as e:
        why = _why(e)
    if seq_len % pieces == 0:
        checked[key] = why
    return why


def _ep_degrees(experts: int, shard: int, span: int, pruned: Counter) -> list[int]:
    """1, and each expert-parallel degree that ``dp_shard=shard`` x cp x tp (``span`` ranks) lends and the
    ``experts`` routed experts split into (none for a dense model: ``experts`` 0)."""
    out = [1]
    for ep in [span * d for d in _divisors(shard) if span * d > 1] if experts else ():
        if experts % ep:
            pruned[f"ep={ep}: does not divide the model's {experts} routed experts"] += 1
        else:
            out.append(ep)
    return out


def _with_pp(
    model, tp, cp, algo, pp, sp, world, batch_size, n_blocks, dtypes, max_rows, experts, pruned
) -> Iterator[Candidate]:
    if pp > 1 and (model.stages is None or n_blocks == 0):
        pruned[f"pp={pp}: model {model.name!r} declares no pipeline stages"] += 1
        return
    schedules = SCHEDULES if pp > 1 else ("1f1b",)
    dp = world // (tp * cp * pp)
    for sched in schedules:
        v = 2 if sched in ("interleaved_1f1b", "zb_v") else 1
        if pp > 1 and n_blocks < pp * v:
            pruned[f"pp={pp} {sched}: {n_blocks} blocks cannot fill {pp * v} stages"] += 1
            continue
        for rep in _divisors(dp):
            shard = dp // rep
            try:
                resolve_degrees(world, pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp)
                rows = local_batch(
                    JobConfig(
                        training=TrainingConfig(batch_size=batch_size, microbatches=1),
                        parallelism=ParallelismConfig(tp=tp, pp=pp, cp=cp),
                    ),
                    dp,
                )[0]
            except ValueError as e:
                pruned[f"dp={dp}: {_why(e)}"] += 1
                continue
            eps = _ep_degrees(experts, shard, cp * tp, pruned)
            for ep, mbs in ((e, r) for e in eps for r in (1, 2, 4, 8, 16, 32) if r <= max_rows and rows % r == 0):
                m = rows // mbs
                if pp > 1 and m < pp:
                    pruned[f"pp={pp}: {m} microbatches < pp stages (the pipeline never fills)"] += 1
                    continue
                for remat in REMATS:
                    if remat == "selective" and sched in SPLIT_BACKWARD and pp > 1:
                        pruned[f"{sched} with remat=selective: selective checkpointing allows one backward pass"] += 1
                        continue
                    for reshard in (True, False) if shard * cp > 1 and remat == "none" else (True,):
                        for dt in dtypes:
                            yield Candidate(
                                dp_replicate=rep,
                                dp_shard=shard,
                                ep=ep,
                                tp=tp,
                                pp=pp,
                                cp=cp,
                                cp_attention=algo,
                                schedule=sched,
                                stages_per_rank=v,
                                microbatches=m,
                                remat=remat,
                                sequence_parallel=sp,
                                reshard_after_forward=reshard,
                                param_dtype=dt,
                            )
