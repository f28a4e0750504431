"""The planner: enumerate, screen by formula, trace the best, rank by predicted step time."""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from ..errors import UserError
from ..job_config import DEFAULT_FLAVOR, DEFAULT_MODEL, JobConfig, ModelConfig
from ..model import Param, count, load_model
from ..tree import flatten_with_names
from ._candidates import MIN_CP_TOKENS, Candidate, enumerate_candidates, job_config
from ._cost import TIME_TOLERANCE, ModelDims, Time, analytic_comm, analytic_memory, step_time
from ._devices import Cluster
from ._predict import ModelShape, model_shape, predict, rank_blocks
from ._trace import Worlds, fake_worlds, young_heap

__all__ = ["Row", "Plan", "plan", "rank", "PlanError", "MARGIN", "MOE_LOAD"]

_GIB = float(1 << 30)
MIN_TRACED = 4  # fitting candidates traced however few --top shows (a trace takes 0.5-5 s)
MARGIN = 0.10  # of usable memory kept free: what torchtitan's users leave for fragmentation and spikes
# under expert parallelism, the traced rank's routed rows as a multiple of the balanced share: routing is uneven
# (real steps of the debug Qwen3-MoE sent one ep rank up to 1.56x its share in a layer) and a meta tensor has no
# values to route by. 1.25 is the capacity factor of the MoEs that drop tokens beyond it (GShard, Switch)
MOE_LOAD = 1.25


class PlanError(UserError):
    """Bad planner input: the message is one line naming what to change."""


class Row(NamedTuple):
    cand: Candidate
    peak: float  # traced and extrapolated bytes of the worst rank
    parts: dict  # params, grads, opt_state, buffers, activations (bytes)
    analytic: dict  # the formula's parts and total
    time: Time
    fits: bool  # peak within usable memory less the margin: a layout the planner may recommend


class Plan(NamedTuple):
    rows: list  # traced candidates, best first
    pruned: Counter
    screened: int  # candidates valid for the trainer
    over_memory: int  # dropped by the formula screen
    cfg: JobConfig  # the recommended config (rows[0])
    assumptions: list
    seconds: float  # wall time of planning
    cpu_seconds: float  # CPU time of this process (the planner is single-threaded; wall time on a busy machine is not)
    usable: float = 0.0  # bytes a rank may use (the device's memory less its reserve)
    margin: float = MARGIN  # fraction of ``usable`` a recommended layout leaves free
    tolerance: float = TIME_TOLERANCE  # step times within this fraction of each other are a tie


def model_dims(model: Any, model_cfg: Any, shape: ModelShape) -> ModelDims:
    """Widths read off the parameter declaration by logical name (embed, kv_heads, mlp, vocab)."""
    decl = model.params(model_cfg)
    sizes: dict[str, int] = {}
    for _, p in flatten_with_names(decl, is_leaf=lambda x: isinstance(x, Param))[0]:
        for n, s in zip(p.names, p.shape):
            sizes[n] = max(sizes.get(n, 0), s)
    key = shape.stage_model.blocks_key if shape.stage_model is not None else None
    blocks = decl[key] if key else []
    # the largest block (a MoE one where the first are dense, DeepSeek-V3's first_k_dense) and its routed experts
    block = max((count(b, exclude=None) for b in blocks), default=0)
    experts = max((count(b, exclude=lambda _, p: "experts" not in p.names) for b in blocks), default=0)
    total = count(decl)
    n = max(shape.n_blocks, 1)
    return ModelDims(
        h=sizes.get("embed", 0),
        kv=sizes.get("kv_heads", sizes.get("heads", 0)),
        f=sizes.get("mlp", 0),
        vocab=sizes.get("vocab", 0),
        block_params=block,
        top_params=max(total - sum(count(b, exclude=None) for b in blocks), 0) if blocks else total,
        n_blocks=n,
        expert_params=experts,
        top_k=int(getattr(model_cfg, "top_k", 0)) if experts else 0,  # Qwen3-MoE's and DeepSeek-V3's field
    )


def load(name: str | None, flavor: str | None, overrides: dict) -> tuple[str, Any, Any]:
    name = name or DEFAULT_MODEL
    try:
        model = load_model(name)
        return name, model, model.config(flavor or DEFAULT_FLAVOR, **overrides)
    except (ValueError, TypeError) as e:
        raise PlanError(str(e)) from None


def plan(
    *,
    model_name: str | None,
    flavor: str | None,
    overrides: dict,
    cluster: Cluster,
    global_batch_tokens: int | None = None,
    seq_len: int | None = None,
    top: int = MIN_TRACED,
    base: JobConfig | None = None,
    param_dtypes: tuple[str, ...] | None = None,
    margin: float = MARGIN,
    tolerance: float = TIME_TOLERANCE,
    min_cp_tokens: int = MIN_CP_TOKENS,
    moe_load: float = MOE_LOAD,
    log=print,
) -> Plan:
    """Plan ``cluster`` for the model (module docstring). A layout fits when its traced peak leaves ``margin`` of
    the usable memory free; of fitting layouts whose step times are within ``tolerance`` of the fastest, the
    one with the most headroom, counted up to twice the margin, is recommended (``rank``). Context parallelism is
    offered while each cp rank keeps ``min_cp_tokens`` of a sequence (``enumerate_candidates``). Under expert
    parallelism the traced rank's experts receive ``moe_load`` times the balanced share of routed rows."""
    t0, c0 = time.perf_counter(), time.process_time()
    if top < 1:
        raise PlanError(f"--top={top}: show at least one candidate, e.g. --top {MIN_TRACED}")
    if not 0 <= margin < 1:
        raise PlanError(f"--margin={margin}: the fraction of usable memory to leave free, in [0, 1), e.g. 0.1")
    if not (math.isfinite(moe_load) and moe_load >= 1):
        raise PlanError(f"--moe-load={moe_load}: the busiest ep rank's routed rows over the mean, >= 1, e.g. 1.25")
    name, model, model_cfg = load(model_name, flavor, overrides)
    seq_len, seq_note = _seq_len(seq_len, model_cfg, name, flavor, cluster)
    global_batch_tokens = global_batch_tokens or 8 * seq_len * cluster.world
    if global_batch_tokens % seq_len or global_batch_tokens < seq_len:
        raise PlanError(
            f"--global-batch-tokens={global_batch_tokens} is not a multiple of --seq-len={seq_len}; use "
            f"{max(global_batch_tokens // seq_len, 1) * seq_len}"
        )
    batch_size = global_batch_tokens // seq_len
    shape = model_shape(model, model_cfg, seq_len)
    dims = model_dims(model, model_cfg, shape)
    dev = cluster.device
    limit = dev.usable * (1 - margin)  # the most a recommended layout may need
    dtypes = param_dtypes or (("float32",) if dev.name == "cpu" else ("bfloat16",))
    checked: dict = {}  # the trainer's cp verdicts, shared by every enumeration of this model
    cands, pruned = enumerate_candidates(
        model,
        model_cfg,
        world=cluster.world,
        per_node=cluster.per_node,
        batch_size=batch_size,
        seq_len=seq_len,
        n_blocks=shape.n_blocks,
        param_dtypes=dtypes,
        min_cp_tokens=min_cp_tokens,
        checked=checked,
    )
    if not cands:
        why = "; ".join(r for r, _ in pruned.most_common(3))
        ok = _nearest_world(model, model_cfg, cluster, batch_size, seq_len, shape, dtypes, min_cp_tokens, checked)
        raise PlanError(
            f"no layout uses all {cluster.world} devices ({cluster.nodes} x {cluster.per_node}): {why}"
            + (f"; a world size that works: {ok}" if ok else "")
        )
    base = base or JobConfig()
    base = dataclasses.replace(
        base,
        model=ModelConfig(
            name=name,
            flavor=flavor or DEFAULT_FLAVOR,
            overrides={**{k: getattr(model_cfg, k) for k in overrides}, "vocab_size": model_cfg.vocab_size},
        ),
    )
    fpt = model.flops_per_token(model_cfg, seq_len)
    screen = []  # (candidate, formula memory, blocks on the fullest pipeline rank)
    for c in cands:
        blocks = max(rank_blocks(shape, c))
        screen.append((c, analytic_memory(c, dims, seq_len=seq_len, batch_size=batch_size, blocks=blocks), blocks))

    # only layouts that may fit are timed, fastest first, and a pipeline's bubble (a simulation of its schedule)
    # only when the tracing gets near it (``_fastest_first``)
    def timed(c: Candidate, mem: dict, blocks: int, bubble: float | None = None) -> tuple:
        comm = analytic_comm(c, dims, seq_len=seq_len, batch_size=batch_size, blocks=blocks)
        t = step_time(c, cluster, comm, flops_per_token=fpt, tokens=global_batch_tokens, n_blocks=blocks, bubble=bubble)
        return c, mem, t, blocks

    fitting = [s for s in screen if s[1]["total"] <= limit * 1.1]
    # how many to trace does not depend on how many are shown (``top`` up to MIN_TRACED): the recommendation
    # must not change with a display option, as it did when --top 3 traced fewer candidates than --top 8
    with young_heap(), fake_worlds() as worlds:
        job = _Job(base, model, model_cfg, shape, cluster, batch_size, seq_len, fpt, limit, moe_load, worlds)
        ordered = _fastest_first(fitting, exact=timed, bound=functools.partial(timed, bubble=0.0))
        rows = _trace_best(job, ordered, len(fitting), max(top, MIN_TRACED), pruned, log)
        if not any(r.fits for r in rows):  # the formula was optimistic: try the layout that needs the least memory
            smallest = min(screen, key=lambda s: s[1]["total"])
            row = next((r for r in rows if r.cand == smallest[0]), None) or _smallest_row(job, *smallest, log)
            if row.fits:
                rows.append(row)
    if not any(r.fits for r in rows):
        need = row.peak + dev.reserve
        tight = row.peak <= dev.usable  # it fits, but inside the margin
        raise PlanError(
            f"no layout fits in {dev.memory / _GIB:.1f} GiB per device ({dev.name}) with {100 * margin:g}% of "
            f"{dev.usable / _GIB:.1f} GiB usable left free; the smallest needs {need / _GIB:.1f} GiB "
            f"({smallest[0].label()}, {dev.reserve / _GIB:.0f} GiB reserve included): use devices with that much "
            "memory, more devices, or a smaller batch"
            + (f", or a smaller --margin (it leaves {100 * (1 - row.peak / dev.usable):.1f}% free)" if tight else "")
        )
    rows = rank(rows, tolerance=tolerance, comfortable=dev.usable * (1 - 2 * margin))
    rows = [r for r in rows if r.fits][:top] + [r for r in rows if not r.fits][:top]
    best = rows[0].cand
    cfg = job_config(base, best, batch_size=batch_size, seq_len=seq_len)
    assumptions = [
        f"device {dev.name}: {dev.source}",
        f"cluster: {cluster.nodes} nodes x {cluster.per_node} devices",
        "remat=full recomputes the forward (4/3 of the FLOPs); selective recomputes elementwise ops (no FLOPs)",
        "middle pipeline ranks hold no more than the first (only the first and last are traced)",
        *([seq_note] if seq_note else []),
        *(
            [
                f"cp > 1 (offered with >= {min_cp_tokens} tokens of a sequence per cp rank): all-gather attention, "
                "K/V of every layer gathered over cp (synchronous), dK/dV reduce-scattered; FSDP over dp_shard x cp"
            ]
            if any(c.cp > 1 for c in cands)
            else []
        ),
        *(
            [
                f"ep > 1: the traced rank's experts receive {moe_load:g}x the balanced share of routed tokens (--moe-load)"
            ]
            if any(c.ep > 1 for c in cands)
            else []
        ),
    ]
    return Plan(
        rows=rows,
        pruned=pruned,
        screened=len(cands),
        over_memory=len(screen) - len(fitting),
        cfg=cfg,
        assumptions=assumptions,
        seconds=time.perf_counter() - t0,
        cpu_seconds=time.process_time() - c0,
        usable=dev.usable,
        margin=margin,
        tolerance=tolerance,
    )


def rank(rows: list[Row], *, tolerance: float = TIME_TOLERANCE, comfortable: float = 0.0) -> list[Row]:
    """Fitting rows best first, then the others by step time. The next fitting row is the fastest left, unless
    others are within ``tolerance`` of its time (the cost model's stated error: a tie it cannot call): then the
    one among them with the most headroom (the lowest peak) goes first. Peaks at or under ``comfortable`` bytes
    count as equal (``plan`` passes the usable memory less twice the margin): headroom beyond that buys no
    safety worth a slower step, so among such layouts the faster goes first."""
    left = sorted((r for r in rows if r.fits), key=lambda r: r.time.total)
    out = []
    while left:
        tied = [r for r in left if r.time.total <= left[0].time.total * (1 + tolerance)]
        pick = min(tied, key=lambda r: (max(r.peak, comfortable), r.time.total))
        out.append(pick)
        left = [r for r in left if r is not pick]
    return out + sorted((r for r in rows if not r.fits), key=lambda r: r.time.total)


def _seq_len(seq_len: int | None, model_cfg: Any, name: str, flavor: str | None, cluster: Cluster):
    """``(sequence length, a note when the default was capped)``: the default is 8192 (256 on a CPU), at most the
    model's ``max_seq_len``; an explicit one above it is refused before any tracing (every trace would fail)."""
    longest = getattr(model_cfg, "max_seq_len", None)
    longest = longest if isinstance(longest, int) and longest > 0 else None
    if seq_len is None:
        default = 256 if cluster.device.name == "cpu" else 8192
        if longest is not None and longest < default:
            return longest, f"--seq-len: {longest} (the default {default} capped at model.max_seq_len)"
        return default, None
    if seq_len < 1:
        raise PlanError(f"--seq-len={seq_len}: must be >= 1 (omit it for the default)")
    if longest is not None and seq_len > longest:
        raise PlanError(
            f"--seq-len={seq_len} exceeds model.max_seq_len={longest} of {name} {flavor or DEFAULT_FLAVOR}; use "
            f"--seq-len {longest} or less, or raise it with --model.max_seq_len={seq_len}"
        )
    return seq_len, None


class _Job(NamedTuple):
    """What every trace of one plan shares."""

    base: JobConfig
    model: Any
    model_cfg: Any
    shape: ModelShape
    cluster: Cluster
    batch_size: int
    seq_len: int
    fpt: float  # model FLOPs per token
    limit: float  # the most bytes a fitting layout may need (usable memory less the margin)
    moe_load: float  # under ep, the traced rank's routed rows over the balanced share
    worlds: Worlds | None = None  # the fake worlds and meshes kept from one candidate to the next


def _fastest_first(screen: list, *, exact, bound) -> Iterator[tuple]:
    """``exact(*s)`` of each screen entry ``s``, by step time (ties in screen order), each computed only once the
    entries before it are out: ``bound(*s)`` (the time without a pipeline's bubble, which only adds) orders the
    rest. Timing a pipelined layout simulates its schedule: 2.5 s of the 405B screen's 4 for ~90 schedules,
    where the tracing takes the first dozen."""
    heap = []
    for i, s in enumerate(screen):
        e = exact(*s) if s[0].pp == 1 else None  # no pipeline, no bubble: the bound is the time
        heap.append(((e or bound(*s))[2].total, i, e, s))
    heapq.heapify(heap)
    while heap:
        _, i, e, s = heapq.heappop(heap)
        if e is not None:
            yield e
        else:
            e = exact(*s)
            heapq.heappush(heap, (e[2].total, i, e, s))


def _trace_best(job: _Job, fitting: Iterable[tuple], candidates: int, traced: int, pruned: Counter, log) -> list[Row]:
    """Trace the screen's candidates fastest first until ``traced`` of them fit (or twice that many are traced).

    The formula is scaled by what the traces found: after a layout of a kind (remat, pipelined) is traced, the
    ratio of its traced peak beyond params, grads and optimizer state to the formula's is known, and a later
    candidate of that kind whose formula, scaled by the smallest such ratio, is over the limit is not traced
    (selective remat saves ~2.3x what the formula counts: each of those traces was wasted)."""
    rows: list[Row] = []
    ratios: dict[tuple, float] = {}
    log(f"tracing the fastest of {candidates} layouts that fit by formula, until {traced} fit:")
    for c, mem, _, blocks in fitting:
        if sum(r.fits for r in rows) >= traced or len(rows) >= 2 * traced:
            break
        kind = (c.remat, c.pp > 1, c.cp > 1)
        states = mem["params"] + mem["grads"] + mem["opt_state"]
        scaled = states + ratios.get(kind, 0.0) * (mem["total"] - states)
        if kind in ratios and scaled > job.limit * 1.05:
            pruned[f"remat={c.remat}{' with pp' if c.pp > 1 else ''}{' with cp' if c.cp > 1 else ''}: over memory "
                   "by the formula scaled to the traced layouts of its kind (not traced)"] += 1  # fmt: skip
            continue
        t0 = time.process_time()
        try:
            row = _traced_row(job, c, mem, blocks)
        except ValueError as e:  # a validator the enumeration does not know refused it: say so, go on
            log(f"  pruned {c.label()}: {str(e).split('; ')[0]}")
            continue
        rows.append(row)
        rest = mem["total"] - states
        if rest > 0:
            ratios[kind] = min(ratios.get(kind, math.inf), (row.peak - states) / rest)
        fit = "fits" if row.fits else ("tight" if row.peak <= job.cluster.device.usable else "over memory")
        log(f"  traced {len(rows)}: {c.label()}: {row.peak / _GIB:.2f} GiB, {fit} ({time.process_time() - t0:.1f} s)")
    return rows


def _smallest_row(job: _Job, c: Candidate, mem: dict, blocks: int, log) -> Row:
    try:
        row = _traced_row(job, c, mem, blocks)
    except ValueError as e:  # not "the smallest needs N GiB": it was never traced, so say why
        raise PlanError(
            f"no traced layout fits in {job.limit / _GIB:.1f} GiB, and the one that needs the least memory by "
            f"formula ({c.label()}) cannot be traced: {e}"
        ) from None
    log(f"  traced the smallest by formula: {c.label()}: {row.peak / _GIB:.2f} GiB")
    return row


def _traced_row(job: _Job, c: Candidate, mem: dict, blocks: int) -> Row:
    """``c`` traced (ValueError: a validator the enumeration does not know refused it)."""
    backend = "gloo" if job.cluster.device.name == "cpu" else None  # CPU ranks run gloo; GPUs NCCL
    p = predict(
        job.base,
        job.model,
        job.model_cfg,
        job.shape,
        c,
        batch_size=job.batch_size,
        seq_len=job.seq_len,
        backend=backend,
        worlds=job.worlds,
        moe_load=job.moe_load,
    )
    tokens = job.batch_size * job.seq_len
    t = step_time(c, job.cluster, p.comm, flops_per_token=job.fpt, tokens=tokens, n_blocks=p.blocks, ops=p.ops)
    rest = p.peak - p.params - p.grads - p.opt_state
    buffers = min(mem["buffers"], max(rest, 0.0))
    parts = {
        "params": p.params,
        "grads": p.grads,
        "opt_state": p.opt_state,
        "buffers": buffers,
        "activations": rest - buffers,
    }
    return Row(cand=c, peak=p.peak, parts=parts, analytic=mem, time=t, fits=p.peak <= job.limit)


def _nearest_world(model, model_cfg, cluster, batch_size, seq_len, shape, dtypes, min_cp_tokens, checked) -> int | None:
    for w in sorted(range(max(cluster.world - 64, 1), cluster.world + 65), key=lambda w: (abs(w - cluster.world), w)):
        if w == cluster.world:
            continue
        cands, _ = enumerate_candidates(
            model,
            model_cfg,
            world=w,
            per_node=cluster.per_node,
            batch_size=batch_size,
            seq_len=seq_len,
            n_blocks=shape.n_blocks,
            param_dtypes=dtypes,
            min_cp_tokens=min_cp_tokens,
            checked=checked,
        )
        if cands:
            return w
    return None
