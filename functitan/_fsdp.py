"""FSDP (and DDP) on local tensors: a parameter's storage placement -> its compute tensor, and the blocks runner.

``FSDP.param`` / ``params`` gather a DTensor parameter over the data-parallel mesh axes with explicit collectives
on local tensors (all-gather forward, reduce-scatter backward, bucketed per process group as FSDP2 does per
module; DDP's all-reduce for replicated ones). ``FSDP.blocks`` runs a model's blocks with each block's gather
inside its remat region, the next block's gather prefetched, and FSDP2's reshard-after-forward (``_Regather``).
The ``Layout`` composes one of these with the tensor-parallel part; a model never sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _collectives, _remat
from . import _dtensor as _dt
from .mesh import EP_SPAN, EXPERT_AXES, REPLICA_AXES

__all__ = ["FSDP", "FSDPPolicy"]


@dataclass(frozen=True)
class FSDPPolicy:
    """How parameters are gathered: ``param_dtype`` (compute dtype; shards are cast before the all-gather),
    ``reduce_dtype`` (gradients reduced in it: float32 keeps fp32 master gradients) and
    ``reshard_after_forward`` (free a block's gathered params after its forward and gather them again in
    backward: FSDP2's default; full and selective remat always reshard)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class FSDP:
    """The data-parallel part of a Layout. ``sharded``: the mesh has ``dp_shard > 1`` or ``cp > 1`` (prefetch and
    regather only then); ``tp_grad_sum(local, p, reduce_dtype)``: the tensor-parallel part's gradient sum of a parameter
    replicated over tp under sequence parallelism (None: no such sum)."""

    policy: FSDPPolicy = FSDPPolicy()
    sharded: bool = False
    tp_grad_sum: Callable[[Tensor, DTensor, torch.dtype | None], Tensor] | None = None
    # {(dp_shard or dp_shard_ep, cp): that pair flattened} where both are > 1 (functitan.mesh.fsdp_groups)
    flat_groups: Mapping[tuple[str, str], Any] = field(default_factory=dict)

    # -- parameters
    def param(self, p: Tensor) -> Tensor:
        """Storage -> compute: a differentiable local tensor, gathered over the data-parallel axes.

        Tensor-parallel shards stay local. Replicated data-parallel axes get DDP's gradient all-reduce;
        sharded ones FSDP's all-gather / reduce-scatter, in ``param_dtype`` / ``reduce_dtype``. ``tp_grad_sum``
        (the tensor-parallel part's, under sequence parallelism) adds its gradient sum over tp first.
        """
        local, shards, cast = self._prepare(p)
        for group, dim, full in shards:
            local = _collectives.all_gather(
                local,
                dim,
                full,
                group,
                compute_dtype=self.policy.param_dtype if cast else None,
                reduce_dtype=self.policy.reduce_dtype if cast else None,
            )
            cast = False
        return local.to(self.policy.param_dtype) if cast else local

    def params(self, tree: Any, pending: _Prefetched | None = None) -> Any:
        """``param`` over a tree, with the FSDP all-gathers of all leaves bucketed into one collective per
        process group (and one reduce-scatter in backward), as FSDP2 does per module. ``pending``: what
        ``prefetch(tree)`` returned; its gathers are waited on instead of issued, and its backward
        reduce-scatters run asynchronously (``_collectives.PendingReduce``)."""
        leaves, treedef, buckets = (
            (pending.leaves, pending.treedef, pending.buckets) if pending else self._buckets(tree)
        )
        out: list[Any] = list(leaves)
        bucketed = {i for items in buckets.values() for i, *_ in items}
        for i, leaf in enumerate(leaves):
            if i not in bucketed:
                out[i] = self.param(leaf)
        for bucket, items in buckets.items():
            group, cast = bucket
            gathered = _collectives.bucket_all_gather(
                [x for _, x, _, _ in items],
                [d for _, _, d, _ in items],
                [f for _, _, _, f in items],
                group,
                compute_dtype=self.policy.param_dtype if cast else None,
                reduce_dtype=self.policy.reduce_dtype if cast else None,
                pending=pending.gathers.get(bucket) if pending else None,
                reduce_box=pending.reduces.get(bucket) if pending else None,
            )
            for (i, *_), g in zip(items, gathered):
                out[i] = g
        return optree.tree_unflatten(treedef, out)

    def prefetch(self, tree: Any, *, gather: bool = True) -> _Prefetched | None:
        """Start the FSDP all-gathers of ``tree`` (the next block's params) now, asynchronously, so they
        overlap this block's compute; pass the result to ``params(tree, pending=...)``.

        With gradients on, the shards' autograd nodes (``_ToLocal``, the await of the bucket's reduce-scatter)
        are made here, before this block's compute, so autograd runs them after this block's backward: the
        next block's reduce-scatter overlaps it. ``gather=False``: only those nodes, for a checkpointed next
        block, which gathers inside its remat region (a prefetched gather would be kept for its backward)."""
        if not self.sharded or torch.compiler.is_compiling():
            return None  # compiled: the compiler schedules the collectives (an async handle breaks the graph)
        if not gather and not torch.is_grad_enabled():
            return None
        leaves, treedef, buckets = self._buckets(tree)
        gathers, reduces = {}, {}
        for bucket, items in buckets.items():
            if torch.is_grad_enabled():
                reduces[bucket] = _collectives.PendingReduce()
                shards = _collectives.await_reduce(reduces[bucket], [x for _, x, _, _ in items])
                items[:] = [(i, x, d, f) for (i, _, d, f), x in zip(items, shards)]
            if not gather:
                continue
            with torch.no_grad():
                gathers[bucket] = _collectives.start_bucket_gather(
                    [x for _, x, _, _ in items],
                    [d for _, _, d, _ in items],
                    [f for _, _, _, f in items],
                    bucket[0],
                    compute_dtype=self.policy.param_dtype if bucket[1] else None,
                )
        return _Prefetched(leaves, treedef, buckets, gathers, reduces)

    def _buckets(self, tree: Any) -> tuple[list, Any, dict]:
        """The leaves, treedef and {(group, cast): [(leaf index, local, dim, full)]} of one-axis FSDP shards."""
        leaves, treedef = optree.tree_flatten(tree)
        buckets: dict[Any, list[tuple[int, Tensor, int, int]]] = {}
        for i, p in enumerate(leaves):
            if isinstance(p, DTensor):
                local, shards, cast = self._prepare(p)
                if len(shards) == 1:
                    group, dim, full = shards[0]
                    buckets.setdefault((group, cast), []).append((i, local, dim, full))
        return leaves, treedef, buckets

    def _prepare(self, p: Tensor) -> tuple[Tensor, list[tuple[Any, int, int]], bool]:
        """(local tensor with DDP / SP grad all-reduces applied, [(group, dim, full)] to gather, cast pending)."""
        cast = self.policy.param_dtype is not None and p.dtype != self.policy.param_dtype
        if not isinstance(p, DTensor):
            return p, [], cast
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or ()
        local = p.to_local() if torch.compiler.is_compiling() else _ToLocal.apply(p)
        reduce_dtype = self.policy.reduce_dtype if cast else None
        if self.tp_grad_sum is not None:  # before the gathers: the shard's gradient is summed, not the whole's
            local = self.tp_grad_sum(local, p, reduce_dtype)
        levels: list[tuple[int, int, int]] = []  # (mesh dim, tensor dim, that dim's size before this split)
        sizes = list(p.shape)
        for mi, pl in enumerate(p.placements):
            if isinstance(pl, Shard):  # DTensor splits in mesh-dim order: track what each split sees
                full = sizes[pl.dim]
                sizes[pl.dim] = _collectives.chunk(full, mesh.size(mi), mesh.get_local_rank(mi))[1]
            if names[mi] not in REPLICA_AXES or mesh.size(mi) == 1:
                continue
            if names[mi] in EXPERT_AXES and isinstance(pl, Shard):  # expert parallel: this rank's experts, local
                # the all-to-all brought every rank's tokens of the experts' group to them, so their gradient is
                # the group's sum; data parallelism and cp mean over ranks, as the other axes' reductions do,
                # while tp's ranks (in the group where it spans tp) hold parts of one loss: summed
                local = _GradScale.apply(local, _expert_grad_scale(mesh, mi))
                continue
            if isinstance(pl, Replicate):  # before the gathers: its backward then runs after the reduce-scatter
                local = _collectives.grad_all_reduce(local, mesh.get_group(mi), reduce_dtype=reduce_dtype)
            elif isinstance(pl, Shard):
                _check_only_dp_on_dim(p, pl.dim)
                levels.append((mi, pl.dim, full))
            else:
                raise ValueError(
                    f"parameter placement {pl} on mesh axis {names[mi]!r} is not supported; use Shard or Replicate"
                )
        return local, self._gathers(mesh, levels), cast

    def _gathers(self, mesh: Any, levels: list[tuple[int, int, int]]) -> list[tuple[Any, int, int]]:
        """``[(group, dim, full)]`` in gather order: innermost split first. A dim split by dp_shard then cp into
        equal pieces is one gather over the flattened group (bucketed and prefetched like plain FSDP); unequal
        pieces (DTensor chunks each split in turn) are gathered one axis at a time."""
        names = mesh.mesh_dim_names
        if self.flat_groups and len(levels) >= 2:
            (mo, do, fo), (mi, di, _) = levels[-2], levels[-1]
            n = mesh.size(mo) * mesh.size(mi)
            flat = self.flat_groups.get((names[mo], names[mi]))
            if flat is not None and do == di and fo % n == 0:
                return [(flat, do, fo), *[(mesh.get_group(m), d, f) for m, d, f in reversed(levels[:-2])]]
        return [(mesh.get_group(m), d, f) for m, d, f in reversed(levels)]

    # -- blocks: the gathers inside remat regions, prefetch and reshard-after-forward
    def blocks(
        self,
        fn: Callable[..., Tensor],
        layers: Sequence[Any],
        x: Tensor,
        args: tuple,
        policies: Sequence[_remat.Policy],
    ) -> Any:
        """``x = fn(compute_params, x, *args)`` for each block's params in ``layers``, in order; blocks that
        return ``(x, aux)`` give ``(x, their aux trees added)``.

        Each block's params are gathered inside its remat region (``block``); under FSDP the next block's
        all-gather starts once this block's has, and overlaps its compute, unless the next block is
        checkpointed (it gathers inside its remat region). Each block's backward reduce-scatter, checkpointed
        or not, runs under the previous block's backward (``prefetch``). ``remat``: a policy per block (None
        entries: the layout's), e.g. ``["full"] * 4 + [None] * 12``.
        """
        pending, regather, aux = None, None, None
        if layers and policies[0].checkpoints:  # its reduce-scatter waits for block 1's (depth one)
            pending = self.prefetch(layers[0], gather=False)
        for i, p in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            gather_next = nxt is not None and not policies[i + 1].checkpoints
            out, pending, regather = self.block(fn, p, (x, *args), policies[i], pending, nxt, regather, gather_next)
            if isinstance(out, tuple):  # (x, aux): a block's side outputs, added over the blocks
                x, more = out
                aux = more if aux is None else optree.tree_map(torch.add, aux, more)
            else:
                x = out
        return x if aux is None else (x, aux)

    def block(
        self,
        fn: Callable[..., Tensor],
        params: Any,
        args: tuple,
        policy: _remat.Policy,
        pending: _Prefetched | None = None,
        nxt: Any = None,
        prev: _Regather | None = None,
        gather_next: bool = True,
    ) -> tuple[Tensor, _Prefetched | None, _Regather | None]:
        """One block: its output, the next block's prefetch and its ``_Regather`` (the next block's ``prev``).

        ``pending``: this block's prefetch (made by the previous block); ``nxt``: the next block's params, whose
        prefetch is made here (its gather only if ``gather_next``)."""

        def run(p: Any, *a: Any) -> Tensor:
            # ``pending`` holds this block's shards (outside the region) and its reduce-scatter box; its gather
            # is issued here, in the forward and again in the recompute
            return fn(self.params(p, pending), *a)

        if not torch.is_grad_enabled():
            return run(params, *args), None, None
        if not policy.checkpoints:
            regather = (
                _Regather(self, params, prev)
                if self.policy.reshard_after_forward and self.sharded and not torch.compiler.is_compiling()
                else None
            )
            hooks = (
                torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack)
                if regather
                else contextlib.nullcontext()
            )
            if policy.offload:
                hooks = _remat.offload_hooks(regather.pack if regather else None, regather.unpack if regather else None)
            with hooks:
                compute = self.params(params, pending)
                if regather is not None:
                    regather.track(optree.tree_leaves(compute))
                started = self.prefetch(nxt, gather=gather_next) if nxt is not None else None
                _chain(pending, started)
                return fn(compute, *args), started, regather
        # made before the region, so autograd runs the next block's await after this block's whole backward
        started = self.prefetch(nxt, gather=gather_next) if nxt is not None else None
        _chain(pending, started)
        return _remat.apply(policy, run, params, *args), started, None


def _chain(pending: _Prefetched | None, started: _Prefetched | None) -> None:
    """This block's reduce-scatters start only once the next block's (which backward runs first) finished:
    one bucket in flight, as FSDP2. Without remat autograd's order already ensures it (the next block's await
    runs before this block's gather node); a checkpointed block's gather is inside its region, so the await
    comes after it."""
    if pending is None or started is None:
        return
    for bucket, box in pending.reduces.items():
        box.behind = started.reduces.get(bucket)


class _Prefetched(NamedTuple):
    """``FSDP.prefetch``'s result: the tree's leaves and buckets (shards already through their autograd
    nodes), the started all-gather and, with gradients on, the reduce-scatter box of each bucket."""

    leaves: list
    treedef: Any
    buckets: dict  # (group, cast) -> [(leaf index, local shard, dim, full)]
    gathers: dict  # (group, cast) -> _collectives.PendingGather
    reduces: dict  # (group, cast) -> _collectives.PendingReduce


class _Regather:
    """FSDP's reshard-after-forward with saved-tensor hooks: a block's gathered params die after its forward
    and are all-gathered again (one bucketed collective) when its backward first needs one.

    Autograd saves a few tensors per op (a matmul's weight for the input gradient); one that lives in the
    storage of a gathered param is packed as ``(leaf index, size, stride, offset)`` instead of a reference.
    Cheaper than a selective-checkpoint policy, which intercepts every op of the block in Python
    (benchmarks/parallel_vs_torch.py measured FSDP 2 at 1.35x torch's FSDP2 with that, 1.12x with this).
    When this block's backward gathers, the previous block's (``prev``, the next backward) gather starts too,
    asynchronously, as FSDP2's backward prefetch: it overlaps this block's backward.
    """

    def __init__(self, fsdp: FSDP, params: Any, prev: _Regather | None = None) -> None:
        self.fsdp, self.params, self.prev = fsdp, params, prev
        self.where: dict[int, int] = {}  # storage address of a gathered leaf -> its index
        self.cache: list[Tensor] | None = None
        self.started: _Prefetched | None = None  # this block's gather, started by the next block's backward
        self.pending = 0

    def track(self, gathered: list[Tensor]) -> None:
        # keyed by the storage object (not its address: the meta tensors the planner traces, and fake ones, have none)
        self.where = {t.untyped_storage()._cdata: i for i, t in enumerate(gathered)}

    def pack(self, t: Tensor) -> Any:
        i = self.where.get(t.untyped_storage()._cdata) if type(t) is Tensor or type(t) is FakeTensor else None
        if i is None:
            return t
        self.pending += 1
        return (i, t.size(), t.stride(), t.storage_offset())

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        i, size, stride, offset = packed
        if self.cache is None:
            with torch.no_grad():
                self.cache = optree.tree_leaves(self.fsdp.params(self.params, self.started))
                self.started = None
                prev = self.prev
                if prev is not None and prev.pending and prev.cache is None and prev.started is None:
                    prev.started = self.fsdp.prefetch(prev.params)
        out = torch.as_strided(self.cache[i], size, stride, offset)
        self.pending -= 1
        if self.pending == 0:  # the block's backward took all it saved: free the re-gathered params
            self.cache = None
        return out


def _expert_grad_scale(mesh: Any, mi: int) -> float:
    """The factor on an expert's gradient, the sum over its group's ranks (mesh dim ``mi``): one over the group's
    data-parallel and cp ranks, which is its size over tp's where the group spans tp (``ep_cp_tp``)."""
    if mesh.mesh_dim_names[mi] != EP_SPAN:
        return 1.0 / mesh.size(mi)
    root = mesh._get_root_mesh()
    return root.size(root.mesh_dim_names.index("tp")) / mesh.size(mi)


class _GradScale(torch.autograd.Function):
    """The identity, whose gradient is multiplied by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g * ctx.scale, None


class _ToLocal(torch.autograd.Function):
    """``DTensor.to_local()`` without its backward's ``DTensor.from_local`` (~170 us a param, measured by
    benchmarks/step_overhead.py): the gradient is wrapped with the param's own spec directly."""

    @staticmethod
    def forward(ctx: Any, p: DTensor) -> Tensor:
        ctx.spec = _dt.spec(p)
        local = _dt.local(p)
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # a DTensor with the param's spec
        return _dt.wrap(g.contiguous(), ctx.spec)


def _check_only_dp_on_dim(p: DTensor, dim: int) -> None:
    names = p.device_mesh.mesh_dim_names or ()
    other = [
        names[i]
        for i, pl in enumerate(p.placements)
        if isinstance(pl, Shard) and pl.dim == dim and names[i] not in REPLICA_AXES and p.device_mesh.size(i) > 1
    ]
    if other:
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} is sharded on dim {dim} by both a data-parallel axis and {other}; "
            f"give that dim's data-parallel rule a different logical name so FSDP shards another dim"
        )
