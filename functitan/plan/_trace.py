"""Trace one real train step of one rank without memory or devices: per-rank peak memory and collective bytes.

The step is the trainer's own (``train.make_layout``, ``train.place_model``, ``train.make_step``) run on meta
tensors (``_OnMeta``) with torch's fake process group at the target world size, in this one CPU process: tensors
carry shapes, dtypes and storage sizes but no data, collectives return at once, and ``LiveBytes`` sums the
storages alive at each instant as torch's ``MemTracker`` does in a real run (to the byte, at a third less time per
op). The same dispatch mode (``_StepMode``, one mode rather than three stacked: each costs every op a
re-dispatch) also answers the step's host reads (``loss.item()``, ``tolist()``: a meta tensor has no value; every
read gives 1.0, a finite loss), counts the bytes of every c10d collective by the mesh axes its group spans, and
every op dispatched (the host's per-op cost is a term of the step time).

Why meta tensors and not ``FakeTensorMode``: the same peaks, comms and collectives to the byte on every layout of
tests/test_plan.py (tests/test_plan_time.py checks two), at 1.8-2.7x less CPU (FakeTensorMode runs each op through Python: a cache key, a cached output
rebuilt, a device query per autograd node; a meta op is torch's C++ shape function). What meta tensors need: SDPA
picks its kernel by device, and on meta it takes the math path (the whole score matrix held for backward), so
``_OnMeta`` routes it to the kernel CPU picks; the fake process group serves meta tensors too (``fake_world``). A
step that makes a tensor on an explicit device (``device="cpu"``) meets meta tensors with a real one, and an op
that takes both fails with a device error: that step is traced under FakeTensorMode instead (``_trace_rank``).

Cost (405B and 8B shapes, one core): the mesh of a world of 16,384 ranks takes 0.3 s to build (1.3 s with every
rank's groups: a fake world makes only its own, ``_own_groups_only``), so one candidate's traces share it
(``rank_mesh``), and a plan's candidates with the same degrees do (``Worlds``).

Gotchas (measured, torch 2.13): the mesh is built outside the trace's modes (its construction reads values).
Context parallelism's all-gather attention shares one causal mask between layers (``_cp.CPContext._causal``), as
a real step does (without it every layer held a mask of its own: 2 GiB a layer for Llama 3 8B at seq 131,072 and
cp 16). RoPE's tables are cached per process (``rope.cached_tables``): each trace starts without them, so it
counts them as a real step's first block does.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.nn.attention
import torch.nn.functional as F
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..mesh import make_mesh
from ..model import Param
from ..train import local_batch, make_layout, make_step, place_model
from ..train_state import TrainState
from ._memtrack import LiveBytes

__all__ = [
    "RankTrace",
    "trace_rank",
    "rank_mesh",
    "fake_world",
    "fake_worlds",
    "Worlds",
    "build_step",
    "step_peak",
    "young_heap",
    "COMM_KINDS",
]

_SCALAR = torch.ops.aten._local_scalar_dense.default
_TO_COPY = torch.ops.aten._to_copy.default
_SDP_CHOICE = torch.ops.aten._fused_sdp_choice.default
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
_SDP_FLAGS = (
    torch.backends.cuda.flash_sdp_enabled,
    torch.backends.cuda.mem_efficient_sdp_enabled,
    torch.backends.cuda.math_sdp_enabled,
    torch.backends.cuda.cudnn_sdp_enabled,
)
COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "p2p", "all_to_all", "cp_all_gather", "cp_reduce_scatter")

_C10D_KIND = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "send": "p2p",
    "recv_": "p2p",
    "broadcast_": "all_reduce",
    "alltoall_base_": "all_to_all",  # Ulysses (context parallel)
    "all_to_all_single": "all_to_all",
}


class RankTrace(NamedTuple):
    """One rank's traced step (bytes).

    ``comm``: {axes: {kind: [bytes, count]}}; ``axes`` is the tuple of mesh axes the collective's group spans
    (``("dp_shard",)``, ``("dp_shard", "cp")`` for FSDP over both, ``("pp", "dp_replicate", "dp_shard", "cp",
    "tp")`` for the world); bytes are the full collective's payload (the gathered output, the reduce-scatter
    input, the all-reduced tensor, the sent one, the all-to-all's input). Context parallelism's K/V all-gathers
    and their gradients' reduce-scatters are ``cp_all_gather`` / ``cp_reduce_scatter``: on the cp group alone,
    an activation (FSDP's buckets on the same group are flat).
    """

    peak: int
    params: int
    opt_state: int
    grads: int
    comm: dict
    after_forward: int = 0  # live bytes when the step's first backward op runs (the first microbatch's forward
    #                         done, all its activations saved): the peak's lower bound at a fixed program point
    #                         (0 with pipelining: not used)
    ops: int = 0  # aten ops the step dispatches on this rank (each costs host time: ``Device.op_s``)


def _nbytes(tree: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for x in optree.tree_leaves(tree, none_is_leaf=False):
        if isinstance(x, DTensor):
            x = x._local_tensor
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
    return total


_NO_READ = object()


def _host_read(func, args, kwargs) -> Any:
    """What a host read of a meta tensor answers (``item``: 1; ``tolist``, a copy to the host: ones, finite, so
    the step takes its normal path), or ``_NO_READ`` for any other op."""
    if func is _SCALAR:
        return 1.0 if args[0].is_floating_point() else 1
    if func is _TO_COPY and args[0].device.type == "meta" and kwargs.get("device") == torch.device("cpu"):
        return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
    return _NO_READ


class _HostReads(TorchDispatchMode):
    """Meta tensors hold no values: every host read answers ones (``_host_read``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = _host_read(func, args, kwargs)
        return func(*args, **kwargs) if read is _NO_READ else read


class _StepMode(LiveBytes):
    """``LiveBytes`` that also answers the step's host reads (as ``_HostReads``), counts c10d collectives by the
    mesh axes their group spans, and counts every op the step dispatches. One mode instead of three stacked:
    each mode on the stack costs every op a Python call and a re-dispatch (a fifth of a trace's time), and the
    device queries (half the ops) are answered at the top instead of passing through two modes first."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.comm: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.ops = 0
        self._shape = tuple(mesh.mesh.shape)
        self._names = tuple(mesh.mesh_dim_names)
        self._axes: dict[str, tuple[str, ...]] = {}
        self._kinds: dict[Any, str | None] = {}  # op -> its collective kind (None: not a collective)

    def _axes_of(self, pg) -> tuple[str, ...]:
        name = pg.group_name
        if name not in self._axes:
            ranks = dist.get_process_group_ranks(pg)
            coords = [self._unravel(r) for r in (ranks[0], *ranks[1:2], ranks[-1])] if len(ranks) > 1 else []
            # a group is a sub-grid: its axes are those along which its ranks' coordinates vary
            varying = set()
            for r in ranks[: min(len(ranks), 4096)]:
                c = self._unravel(r)
                varying |= {a for a, x, y in zip(self._names, c, coords[0]) if x != y}
            self._axes[name] = tuple(a for a in self._names if a in varying)
        return self._axes[name]

    def _unravel(self, r: int) -> tuple[int, ...]:
        out = []
        for d in reversed(self._shape):
            out.append(r % d)
            r //= d
        return tuple(reversed(out))

    def _device(self, func, args, kwargs):
        # a device query of the autograd engine, which only a fake tensor dispatches (FakeTensorMode, the
        # fallback): answered here, not counted (a real step's and a meta trace's op counts have none)
        return args[0].device

    def _call(self, func, args, kwargs):
        self.ops += 1
        kwargs = kwargs or {}
        if func is _SCALAR or func is _TO_COPY:  # a host read? (``_HostReads``)
            read = _host_read(func, args, kwargs)
            if read is not _NO_READ:
                return read
        kind = self._kinds.get(func, "")
        if kind == "":
            ns, name = func.namespace, func.__name__.split(".")[0]
            kind = self._kinds[func] = _C10D_KIND.get(name) if ns in ("c10d", "_c10d_functional") else None
        if kind is not None:
            self._count(kind, func.__name__.split(".")[0], args)
        return func(*args, **kwargs)

    def _count(self, kind: str, name: str, args) -> None:
        tensors = [a for a in optree.tree_leaves(list(args)) if isinstance(a, torch.Tensor)]
        pg = next((a for a in args if type(a).__name__ == "ScriptObject"), None)
        group = dist.ProcessGroup.unbox(pg) if pg is not None else None
        if group is None:
            gname = next((a for a in args if isinstance(a, str)), None)
            group = dist.distributed_c10d._resolve_process_group(gname) if gname else None
        if group is None or not tensors:
            return
        payload = {
            "all_gather": tensors[0],
            "reduce_scatter": tensors[-1]
            if name == "reduce_scatter_tensor"
            else (tensors[1] if len(tensors) > 1 else tensors[0]),
        }.get(kind)
        nbytes = (
            payload.numel() * payload.element_size()
            if payload is not None
            else sum(t.numel() * t.element_size() for t in tensors)
        )
        axes = self._axes_of(group)
        if axes == ("cp",) and kind in ("all_gather", "reduce_scatter") and payload is not None \
                and payload.dim() > 1:  # fmt: skip
            kind = "cp_" + kind  # attention's K/V (or their gradients), not a parameter bucket
        rec = self.comm[axes][kind]
        rec[0] += nbytes
        rec[1] += 1


@functools.cache
def _cpu_choice(rows: tuple, mask: tuple | None, dropout_p: float, causal: bool, scale, gqa: bool, enabled) -> int:
    """SDPA's kernel choice on CPU for operands of these shapes (one position each) and dtypes, outside every mode
    (``enabled``: the backends' switches, part of the cache's key)."""
    with _disable_current_modes():
        q, k, v = (torch.empty((*r[:-2], 1, r[-2]), dtype=r[-1]) for r in rows)
        m = None if mask is None else torch.empty((1,) * mask[0], dtype=mask[1])
        return _SDP_CHOICE(q, k, v, m, dropout_p, causal, scale=scale, enable_gqa=gqa)


class _OnMeta(DeviceContext):
    """Tensors made without a device are meta tensors (shapes, dtypes and storage sizes, no data), and attention
    takes the kernel it takes on CPU: SDPA picks its kernel by device, and on meta it takes the math path, which
    keeps the whole (seq x seq) score matrix where the fused kernel keeps a row statistic."""

    def __init__(self) -> None:
        super().__init__(torch.device("meta"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0] if args else kwargs.get("query")
            if isinstance(query, torch.Tensor) and query.device.type == "meta":
                return _fused_attention(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _fused_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (its signature) on meta tensors as CPU runs it: the fused kernel where
    CPU picks it (heads grouped natively, a boolean mask made additive in the query's dtype first, as CPU's
    ``convert_boolean_attn_mask``), else the math path."""
    ops = (query, key, value)
    rows = tuple((*t.shape[:-2], t.shape[-1], t.dtype) for t in ops)  # the choice reads no sequence length
    mask = None if attn_mask is None else (attn_mask.dim(), attn_mask.dtype)
    enabled = tuple(f() for f in _SDP_FLAGS)  # ``sdpa_kernel`` and ``enable_*_sdp`` steer the choice
    if _cpu_choice(rows, mask, dropout_p, is_causal, scale, enable_gqa, enabled) != _FLASH:
        return F.scaled_dot_product_attention(
            *ops, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero, minus = (torch.scalar_tensor(v, dtype=query.dtype, device=query.device) for v in (0.0, -math.inf))
        attn_mask = torch.where(attn_mask, zero, minus)
    return _FLASH_CPU(*ops, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A fake process group of ``world_size`` ranks in which this process is ``rank`` (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "the planner traces with its own fake process group; call it outside torch.distributed "
            "(this process already has a process group: call torch.distributed.destroy_process_group() first, or "
            "run `functitan plan` in its own process)"
        )
    # the traced step's tensors are meta tensors (``_trace_rank``): the fake backend serves that device too while
    # this world lives (a "cpu:fake,meta:fake" group works as well, but warns of an undefined backend at its end)
    devices = dist.Backend.backend_capability[dist.Backend.FAKE]
    dist.Backend.backend_capability[dist.Backend.FAKE] = [*devices, "meta"]
    try:
        dist.init_process_group(dist.Backend.FAKE, rank=rank, world_size=world_size, store=FakeStore())
        try:
            with _own_groups_only(rank):
                yield
        finally:
            dist.destroy_process_group()
    finally:
        dist.Backend.backend_capability[dist.Backend.FAKE] = devices


@contextlib.contextmanager
def _own_groups_only(rank: int) -> Iterator[None]:
    """``DeviceMesh`` makes every group of every axis, as real ranks must (``new_group`` is collective): 73,730 for
    a 405B candidate's mesh at 16,384 ranks (one-rank groups of its size-one axes included), 1.3 s. A fake world
    has no peers to agree with, so its meshes make only this rank's groups (0.3 s)."""
    import torch.distributed.device_mesh as device_mesh

    real = device_mesh.new_group  # type: ignore[attr-defined]

    def new_group(ranks=None, **kwargs):
        if ranks is not None and rank not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        return real(ranks=ranks, **kwargs)

    device_mesh.new_group = new_group  # type: ignore[attr-defined]
    try:
        yield
    finally:
        device_mesh.new_group = real  # type: ignore[attr-defined]


def _full_params(decl: Any, fake: bool, seed: int) -> Any:
    if fake:  # shapes only: no values, no memory
        return optree.tree_map(lambda p: torch.empty(p.shape), decl, is_leaf=lambda x: isinstance(x, Param))
    from ..model import init
    from ..random import fold_in, key

    return init(decl, fold_in(key(seed), "params"))


def build_step(cfg, model, model_cfg, mesh, *, fake: bool, stage_layers=None):
    """``(state, train_step, batch)`` of this rank, built by the trainer's own functions."""
    layout, rules = make_layout(cfg, mesh)
    rows, microbatches = local_batch(cfg, layout.dp_size)
    placed = place_model(
        cfg,
        model,
        model_cfg,
        _full_params(model.params(model_cfg), fake, cfg.training.seed),
        mesh,
        layout,
        rules,
        microbatches=microbatches,
        stage_layers=stage_layers,
    )
    optimizer, train_step = make_step(cfg, model, model_cfg, placed.grad_fn, placed.norm_across)
    state = TrainState(step=0, params=placed.params, opt_state=optimizer.init(placed.params), data_state=None, rng=0)
    g = torch.Generator().manual_seed(cfg.training.seed)
    tokens = (
        torch.randint(0, model_cfg.vocab_size, (rows, cfg.training.seq_len + 1), generator=g)
        if not fake
        else torch.zeros(rows, cfg.training.seq_len + 1, dtype=torch.long)
    )
    return state, train_step, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@contextlib.contextmanager
def young_heap() -> Iterator[None]:
    """Collect garbage once, then freeze what survives out of later collections until the block ends.

    Each measured or traced step collects garbage first (``step_peak``: its peak must not depend on when a
    collection comes). A process that imported torch holds millions of objects, and a full collection of them took
    0.2-0.5 s, two per prediction: a fifth of tests/test_plan.py's CPU. Inside this block a step's collection sees
    only what was made since (milliseconds); what was alive before is alive all along, so no peak changes. Blocks
    nest (a plan's predictions, a test's loop of them): the outermost freezes and unfreezes."""
    if gc.get_freeze_count():  # an enclosing block (or the caller's own gc.freeze) holds the heap frozen
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def step_peak(state, train_step, batch, *modes, warm_up: bool = True) -> tuple[int, Any]:
    """``(MemTracker peak bytes of one step, the new state)``; with ``warm_up`` a first step runs untracked, so
    what a real step allocates once (allocator caches, lazily built tables) is not counted. A traced step needs
    none: the tracked step starts from the same state either way, and whatever a first step builds lazily is
    counted in the tracked window instead of missed (the 9 layouts of tests/test_plan.py trace to the same peaks
    and op counts with and without it), at half the dispatches."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if warm_up:
        with contextlib.ExitStack() as stack:
            for m in modes[:1]:  # host reads answer on the warm-up step too
                stack.enter_context(m)
            train_step(state, batch)
    # garbage from setup and the warm-up, freed by a collection during the tracked step, moved its peak by up to
    # 7% between runs of the same code (FSDP 4, selective remat, bf16): collect it first
    gc.collect()
    mt = MemTracker()
    mt.track_external(*[x for x in optree.tree_leaves((state.params, state.opt_state)) if isinstance(x, torch.Tensor)])
    with contextlib.ExitStack() as stack:
        for m in modes:
            stack.enter_context(m)
        stack.enter_context(mt)
        new_state, _ = train_step(state, batch)
    snap = mt.get_tracker_snapshot("peak")
    return max(v["Total"] for v in snap.values()), new_state


@contextlib.contextmanager
def rank_mesh(par: Any, world: int, rank: int, worlds: Worlds | None = None) -> Iterator[Any]:
    """The fake world of ``world`` ranks as ``rank`` and its mesh for ``par``'s degrees, for one or more
    ``trace_rank`` calls: building a mesh is a loop over its axes (0.3 s at 16,384 ranks), and the
    traces of one candidate's rank at two block counts share it. With ``worlds`` (``fake_worlds``), the world and
    the mesh are kept for later candidates too."""
    with contextlib.ExitStack() as stack:
        if worlds is None:
            stack.enter_context(fake_world(world, rank))
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield _make_mesh(par) if worlds is None else worlds.mesh(par, world, rank)


def _make_mesh(par: Any) -> Any:
    return make_mesh(
        dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, device="cpu"
    )


class Worlds:
    """The fake world and the meshes of a plan's traces, kept from one candidate to the next (``fake_worlds``).

    Candidates with the same degrees (remat, microbatches, dtype apart) share one mesh here (a fake world makes
    only its rank's groups, ``_own_groups_only``: 0.3 s a mesh at 16,384 ranks). One rank's world at a time: a
    trace as another rank (a pipeline's last) starts that world afresh, and its meshes with it."""

    def __init__(self) -> None:
        self._at: tuple[int, int] | None = None  # (world, rank) of the open fake world
        self._world = contextlib.ExitStack()
        self._meshes: dict[tuple, Any] = {}

    def mesh(self, par: Any, world: int, rank: int) -> Any:
        if self._at != (world, rank):
            self.close()
            self._world.enter_context(fake_world(world, rank))
            self._at = (world, rank)
        key = (par.dp_replicate, par.dp_shard, par.tp, par.pp, par.cp, par.ep)
        if key not in self._meshes:
            self._meshes[key] = _make_mesh(par)
        return self._meshes[key]

    def close(self) -> None:
        self._meshes.clear()
        self._at = None
        self._world.close()


@contextlib.contextmanager
def fake_worlds() -> Iterator[Worlds]:
    """``Worlds`` for the traces of one plan; the fake process group is destroyed on exit."""
    worlds = Worlds()
    try:
        yield worlds
    finally:
        worlds.close()


def trace_rank(
    cfg,
    model,
    model_cfg,
    *,
    world: int,
    rank: int,
    stage_layers=None,
    mesh=None,
    backend: str | None = None,
    moe_load: float = 1.0,
) -> RankTrace:
    """Trace rank ``rank`` of ``world`` running ``cfg``'s step on meta tensors (see the module docstring);
    ``mesh``: one from ``rank_mesh`` of the same degrees, world and rank (else it is built here). ``backend``:
    "gloo" (CPU ranks) counts the buffers functitan's collectives allocate on gloo (the reduce-scatter's receive
    buffer, (world - 1) / world of a bucket); None: NCCL's, which allocate none the trace does not see.
    ``moe_load``: under expert parallelism, the routed rows this rank's experts receive as a multiple of the
    balanced share (a meta tensor has no values to route by; ``functitan.moe._dispatch.TRACED_LOAD``)."""
    from .._collectives import TRACED_BACKEND
    from ..moe._dispatch import TRACED_LOAD

    par = cfg.parallelism
    if mesh is None:
        with rank_mesh(par, world, rank) as own:
            return trace_rank(
                cfg,
                model,
                model_cfg,
                world=world,
                rank=rank,
                stage_layers=stage_layers,
                mesh=own,
                backend=backend,
                moe_load=moe_load,
            )
    token, load = TRACED_BACKEND.set(backend), TRACED_LOAD.set(moe_load)
    try:
        return _trace_rank(cfg, model, model_cfg, stage_layers=stage_layers, mesh=mesh)
    finally:
        TRACED_LOAD.reset(load)
        TRACED_BACKEND.reset(token)


def _trace_rank(cfg, model, model_cfg, *, stage_layers, mesh) -> RankTrace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    par = cfg.parallelism
    try:
        live, params, opt = _traced(_OnMeta(), cfg, model, model_cfg, stage_layers, mesh)
    except RuntimeError as e:
        if "meta" not in str(e) or "device" not in str(e):
            raise
        # the step made a tensor on an explicit device (``device="cpu"``) and met a meta one: FakeTensorMode
        # makes that one fake too (the same bytes, 2-3x the CPU)
        live, params, opt = _traced(FakeTensorMode(), cfg, model, model_cfg, stage_layers, mesh)
    after = (live.at_backward or 0) if par.pp == 1 else 0
    comm = {axes: {k: list(v) for k, v in kinds.items()} for axes, kinds in live.comm.items()}
    return RankTrace(
        peak=live.peak,
        params=params,
        opt_state=opt,
        grads=params,  # gradients mirror the params' local shards and dtype (``value_and_grad`` keeps placements)
        comm=comm,
        after_forward=after,
        ops=live.ops,
    )


def _traced(context: Any, cfg, model, model_cfg, stage_layers, mesh) -> tuple[Any, int, int]:
    """``(the LiveBytes of one traced step, params bytes, optimizer state bytes)`` of the step built and run in
    ``context`` (``_OnMeta``, or a ``FakeTensorMode``)."""
    from .. import rope

    mode = _StepMode(mesh)  # outside the context: it reads the mesh's values
    rope.clear_cache()  # a real step builds its tables in its first block: so does each trace
    with context:
        state, train_step, batch = build_step(cfg, model, model_cfg, mesh, fake=True, stage_layers=stage_layers)
        live = _live_step(state, train_step, batch, live=mode)
        return live, _nbytes(state.params), _nbytes(state.opt_state)


def _live_step(state, train_step, batch, *modes, live: Any = None) -> Any:
    """One traced step under ``modes`` and ``live`` (a ``LiveBytes``: MemTracker's count of live tensor bytes, a third
    faster; by default a new one), which is returned; ``step_peak``'s docstring says why no warm-up step runs and
    why garbage is collected first."""
    gc.collect()
    live = LiveBytes() if live is None else live
    live.track_external(
        *[x for x in optree.tree_leaves((state.params, state.opt_state)) if isinstance(x, torch.Tensor)]
    )
    with contextlib.ExitStack() as stack:
        for m in modes:
            stack.enter_context(m)
        stack.enter_context(live)
        train_step(state, batch)
    return live
