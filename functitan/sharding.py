"""Named sharding: specs + one rules table + a named mesh -> DTensor params, and the Layout that computes with them.

Data flow::

    params (full tensors)  +  specs (logical names)  --place(rules, mesh)-->  DTensor params (storage placement)
    DTensor params  --Layout.param-->  local compute tensors (gathered on the data-parallel axes)

Storage placement is what the rules say (FSDP: Shard on ``dp_shard``). Compute placement is storage with the
data-parallel axes gathered. ``Layout.param`` makes that switch with explicit collectives on local tensors
(all-gather forward, reduce-scatter backward; DDP's all-reduce for replicated params), so the model itself
runs on plain tensors: eager DTensor dispatch costs 15-60 us per op, which dominates small models.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from . import _collectives, _loss, _remat
from . import _dtensor as _dt
from ._loss import IGNORE_INDEX, TokenLoss
from ._names import NameTable
from ._rules import Rules, Spec, default_rules, is_spec, logical_to_mesh_axes, spec_placements
from ._tp import TPContext, parse_einsum
from .mesh import DP_AXES
from .tree import map_with_names, tree_map

__all__ = [
    "Layout",
    "TokenLoss",
    "Rules",
    "Spec",
    "default_rules",
    "logical_to_mesh_axes",
    "spec_placements",
    "place",
    "placements",
    "constrain",
    "is_spec",
]


def place(params: Any, specs: Any, rules: Rules, mesh: DeviceMesh, *, requires_grad: bool = True) -> Any:
    """Distribute a tree of full tensors onto ``mesh`` with the storage placements the rules give.

    Every rank must hold the same full values (``init`` guarantees it); each keeps only its shard, so no
    communication happens. Floating-point leaves come back as DTensor leaves with ``requires_grad`` set.
    """

    def one(name: str, x: Any, spec: Spec) -> Any:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: place() takes a tree of tensors, found {type(x).__name__}")
        pl = spec_placements(spec, rules, mesh, name=name, ndim=x.ndim)
        out = distribute_tensor(x.detach(), mesh, pl, src_data_rank=None)
        return out.requires_grad_(requires_grad and x.is_floating_point())

    return map_with_names(one, params, specs, is_leaf=is_spec, what=("params", "specs"))


def placements(params: Any) -> Any:
    """The placements of every DTensor leaf (``None`` for plain tensors): handy to print a layout."""
    return tree_map(lambda x: tuple(x.placements) if isinstance(x, DTensor) else None, params)


def constrain(x: Tensor, spec: Spec, rules: Rules, mesh: DeviceMesh) -> DTensor:
    """Lay out an activation as ``spec`` says (``jax.lax.with_sharding_constraint`` for DTensor values).

    Differentiable, so it works on any activation inside a forward. A DTensor is redistributed (the
    collectives DTensor picks run forward and, dually, backward). A plain tensor is taken as this rank's full
    value (the same on every rank): each rank keeps its slice without communication, and the backward
    all-gathers the slices' gradients as DTensor's ``from_local`` defines.
    """
    pl = spec_placements(spec, rules, mesh, name="activation", ndim=x.ndim)
    if isinstance(x, DTensor):
        return x.redistribute(mesh, pl)
    local = x
    for mi, p in enumerate(pl):  # DTensor's nesting: earlier mesh axes split first, torch.chunk sizes
        if isinstance(p, Shard):
            n, r = mesh.size(mi), mesh.get_local_rank(mi)
            sizes = _collectives.chunk_sizes(local.shape[p.dim], n)
            local = local.narrow(p.dim, sum(sizes[:r]), sizes[r])
    return DTensor.from_local(local, mesh, pl, run_check=False, shape=x.shape, stride=x.stride())


# ----------------------------------------------------------------------------------------------- Layout


@dataclass(frozen=True)
class Layout:
    """How a model computes on a mesh: the mesh, the rules, remat, precision and compilation.

    A model takes a Layout as an argument and routes five things through it: parameters (``param``), blocks
    (``blocks``: a block's params are gathered inside its remat region, FSDP's reshard-after-forward, and the
    next block's gather is prefetched), contractions with parameters (``einsum``, named by logical axes: the
    names decide the tensor-parallel collectives), the token embedding and the loss. With ``Layout()`` (no
    mesh) each is the plain single-device op, so the model reads as single-device code.

    A Layout is configuration only: it holds no per-step state, so one instance (or a default argument) can be
    shared by any number of steps, threads and models.

    Args:
        mesh: the named mesh (``functitan.mesh.make_mesh``); None for one device without a process group.
        rules: the rules table (``default_rules(sequence_parallel=...)``).
        remat: activation checkpointing per block: a ``functitan._remat.Policy`` or its config spelling,
            "none", "full", "selective" (save matmul and attention outputs, recompute elementwise ops) or
            "offload" (saved activations in host memory); ``block(..., remat=)`` overrides it per block.
        param_dtype: compute dtype of params (e.g. bfloat16); shards are cast before the all-gather.
        reduce_dtype: dtype in which gradients are reduced (float32 keeps fp32 master gradients).
        compile: ``torch.compile`` each block function (dynamo caches per function).
        reshard_after_forward: free a block's gathered params after its forward and all-gather them again in
            backward (FSDP2's default; saves the memory of the gathered params for the cost of one more
            all-gather; see ``_Regather``). Only matters with ``dp_shard > 1``; full and selective remat
            always reshard.
        names: check mode (``functitan.model.check_names``): the declared names of each parameter tensor; every
            contraction compares its pattern with them and raises on a mismatch.
    """

    mesh: DeviceMesh | None = None
    rules: Rules = field(default_factory=default_rules)
    remat: str | _remat.Policy = "none"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    compile: bool = False
    reshard_after_forward: bool = True
    names: NameTable | None = None
    # derived in __post_init__ from the (immutable) mesh and rules: not arguments, not compared, not state
    _tp: TPContext | None = field(default=None, init=False, repr=False, compare=False)
    _fsdp: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _remat.as_policy(self.remat)  # an unknown spelling fails here
        mesh = self.mesh
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        on = lambda axis: mesh is not None and axis in names and mesh[axis].size() > 1  # noqa: E731
        object.__setattr__(self, "_tp", TPContext(mesh, self.rules) if on("tp") and mesh is not None else None)
        object.__setattr__(self, "_fsdp", on("dp_shard"))

    @property
    def sequence_parallel(self) -> bool:
        return self._tp is not None and self._tp.sequence_parallel

    @property
    def seq_shards(self) -> int:
        """Into how many pieces the residual stream is split along the sequence (tp under sequence parallel)."""
        return self._tp.size if self._tp is not None and self._tp.sequence_parallel else 1

    def seq_range(self, seq_len: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's positions in a sequence of ``seq_len``: its piece of the residual
        stream under sequence parallelism, else the whole sequence. Learned position tables index with it."""
        tp = self._tp
        if tp is None or not tp.sequence_parallel:
            return 0, seq_len
        if seq_len % tp.size:
            raise ValueError(
                f"sequence parallelism over tp={tp.size} needs the sequence length divisible by "
                f"{tp.size}, got {seq_len}; change training.seq_len or set parallelism.sequence_parallel=false"
            )
        n = seq_len // tp.size
        return tp.rank * n, (tp.rank + 1) * n

    def positions(self, seq_len: int, device: torch.device | str = "cpu") -> Tensor:
        """This rank's position ids ``(local_seq,)`` (see ``seq_range``)."""
        return torch.arange(*self.seq_range(seq_len), device=device)

    @property
    def single_backward(self) -> bool:
        """True when a block may be backpropagated through only once (selective remat's checkpointing).
        Zero-bubble pipeline schedules (separate input- and weight-gradient passes) need False."""
        return _remat.as_policy(self.remat).single_backward

    # -- parameters
    def param(self, p: Tensor) -> Tensor:
        """Storage -> compute: a differentiable local tensor, gathered over the data-parallel axes.

        Tensor-parallel shards stay local. Replicated data-parallel axes get DDP's gradient all-reduce;
        sharded ones FSDP's all-gather / reduce-scatter, in ``param_dtype`` / ``reduce_dtype``. Under sequence
        parallelism a param replicated over tp gets a gradient sum over tp: every activation is then split
        over tp (by sequence or by feature), so each rank holds a part of its gradient, however the model uses it
        (``x + bias``, a norm weight, a position table).
        """
        local, shards, cast = self._prepare(p)
        for group, dim, full in shards:
            local = _collectives.all_gather(
                local,
                dim,
                full,
                group,
                compute_dtype=self.param_dtype if cast else None,
                reduce_dtype=self.reduce_dtype if cast else None,
            )
            cast = False
        return local.to(self.param_dtype) if cast else local

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
                compute_dtype=self.param_dtype if cast else None,
                reduce_dtype=self.reduce_dtype if cast else None,
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
        if not self._fsdp or torch.compiler.is_compiling():
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
                    compute_dtype=self.param_dtype if bucket[1] else None,
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
        cast = self.param_dtype is not None and p.dtype != self.param_dtype
        if not isinstance(p, DTensor):
            return p, [], cast
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or ()
        local = p.to_local() if torch.compiler.is_compiling() else _ToLocal.apply(p)
        reduce_dtype = self.reduce_dtype if cast else None
        if self.sequence_parallel and "tp" in names:
            ti = names.index("tp")
            if not isinstance(p.placements[ti], Shard):  # before the gathers: reduce the shard, not the whole
                local = _collectives.grad_all_reduce(local, mesh.get_group(ti), reduce="sum", reduce_dtype=reduce_dtype)
        shards = []
        for mi, pl in enumerate(p.placements):
            if names[mi] not in DP_AXES or mesh.size(mi) == 1:
                continue
            if isinstance(pl, Replicate):  # before the gathers: its backward then runs after the reduce-scatter
                local = _collectives.grad_all_reduce(local, mesh.get_group(mi), reduce_dtype=reduce_dtype)
            elif isinstance(pl, Shard):
                _check_only_dp_on_dim(p, pl.dim)
                shards.append((mesh.get_group(mi), pl.dim, p.shape[pl.dim]))
            else:
                raise ValueError(
                    f"parameter placement {pl} on mesh axis {names[mi]!r} is not supported; use Shard or Replicate"
                )
        return local, shards, cast

    # -- blocks
    def blocks(
        self,
        fn: Callable[..., Tensor],
        layers: Sequence[Any],
        x: Tensor,
        *args: Any,
        remat: Sequence[str | _remat.Policy | None] | None = None,
    ) -> Tensor:
        """``x = fn(compute_params, x, *args)`` for each block's params in ``layers``, in order.

        Each block's params are gathered inside its remat region (``block``); under FSDP the next block's
        all-gather starts once this block's has, and overlaps its compute, unless the next block is
        checkpointed (it gathers inside its remat region). Each block's backward reduce-scatter, checkpointed
        or not, runs under the previous block's backward (``prefetch``). ``remat``: a policy per block (None
        entries: the layout's), e.g. ``["full"] * 4 + [None] * 12``.
        """
        pending, regather = None, None
        if layers and self._policy(remat, 0).checkpoints:  # its reduce-scatter waits for block 1's (depth one)
            pending = self.prefetch(layers[0], gather=False)
        for i, p in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            gather_next = nxt is not None and not self._policy(remat, i + 1).checkpoints
            x, pending, regather = self._block(
                fn, p, (x, *args), pending, nxt, remat[i] if remat is not None else None, regather, gather_next
            )
        return x

    def _policy(self, remat: Sequence[str | _remat.Policy | None] | None, i: int) -> _remat.Policy:
        """Block ``i``'s remat policy: its entry in ``remat``, else the layout's."""
        own = remat[i] if remat is not None else None
        return _remat.as_policy(self.remat if own is None else own)

    def block(
        self, fn: Callable[..., Tensor], params: Any, *args: Any, remat: str | _remat.Policy | None = None
    ) -> Tensor:
        """``fn(compute_params, *args)`` with the params gathered inside the block's remat region; ``remat``:
        this block's policy instead of the layout's."""
        return self._block(fn, params, args, None, None, remat)[0]

    def _block(
        self,
        fn: Callable[..., Tensor],
        params: Any,
        args: tuple,
        pending: _Prefetched | None,
        nxt: Any,
        remat: str | _remat.Policy | None = None,
        prev: _Regather | None = None,
        gather_next: bool = True,
    ) -> tuple[Tensor, _Prefetched | None, _Regather | None]:
        """One block: its output, the next block's prefetch and its ``_Regather`` (the next block's ``prev``).

        ``pending``: this block's prefetch (made by the previous block); ``nxt``: the next block's params, whose
        prefetch is made here (its gather only if ``gather_next``)."""
        policy = _remat.as_policy(self.remat if remat is None else remat)
        if self.compile:
            fn = torch.compile(fn)  # dynamo's cache lives with fn's code: compiled once, whatever the wrapper

        def run(p: Any, *a: Any) -> Tensor:
            # ``pending`` holds this block's shards (outside the region) and its reduce-scatter box; its gather
            # is issued here, in the forward and again in the recompute
            return fn(self.params(p, pending), *a)

        if not torch.is_grad_enabled():
            return run(params, *args), None, None
        if not policy.checkpoints:
            regather = (
                _Regather(self, params, prev)
                if self.reshard_after_forward and self._fsdp and not torch.compiler.is_compiling()
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

    # -- activations
    def einsum(self, pattern: str, *operands: Tensor) -> Tensor:
        """A contraction written with logical axis names, e.g. ``"batch seq embed, heads embed -> batch seq heads"``.

        The last operand is a (compute) parameter, and its names in the pattern must be its declared names
        (``functitan.model.check_names`` checks every call). The names decide the tensor-parallel collectives
        (see functitan._tp); on one device or under pure data parallelism it is the plain op: ``F.linear`` for a
        projection, a broadcast multiply for a scale, ``torch.einsum`` otherwise.
        """
        if self.names is not None:
            self.names.check_einsum(pattern, operands[-1], sys._getframe(1))
            return self._named(pattern, *operands)
        if self._tp is not None and len(operands) == 2:
            return self._tp.einsum(pattern, *operands)
        return parse_einsum(pattern, len(operands))[2](*operands)

    def _named(self, pattern: str, *operands: Tensor) -> Tensor:
        """Check mode's contraction: the plain op, its output's names recorded for the bias check."""
        _, out_names, op = parse_einsum(pattern, len(operands))
        out = op(*operands)
        if self.names is not None:
            self.names.name_activation(out, out_names)
        return out

    def einsums(self, x: Tensor, pairs: list[tuple[str, Tensor]]) -> list[Tensor]:
        """``[einsum(pattern, x, w) for pattern, w in pairs]``: contractions that share their input ``x``
        (q, k and v; gate and up). Under tensor parallelism the shared input is gathered along the sequence
        (sequence parallel) or gradient-reduced once for all of them instead of once each, and backward runs
        one reduce-scatter / all-reduce of the summed input gradient."""
        if self.names is not None:
            caller = sys._getframe(1)
            for pattern, w in pairs:
                self.names.check_einsum(pattern, w, caller)
            return [self._named(pattern, x, w) for pattern, w in pairs]
        if self._tp is not None:
            return self._tp.einsums(x, pairs)
        return [parse_einsum(pattern, 2)[2](x, w) for pattern, w in pairs]

    def embed(self, tokens: Tensor, table: Tensor, num_rows: int) -> Tensor:
        """Row lookup: ``tokens (batch, seq)`` ids into ``table (num_rows, embed)`` -> ``(batch, seq, embed)``.

        Token embeddings and learned position tables alike: a table whose local rows are fewer than
        ``num_rows`` is vocab-parallel (sharded over tp), any other is replicated; the result is in the
        residual layout (this rank's sequence piece under sequence parallelism).
        """
        if self.names is not None:
            self.names.check_rows(table, num_rows, sys._getframe(1))
            out = F.embedding(tokens, table)
            self.names.name_activation(out, ("batch", "seq", "embed"))
            return out
        if self._tp is not None:
            return self._tp.embed(tokens, table, num_rows)
        return F.embedding(tokens, table)

    def cross_entropy(
        self,
        logits: Tensor,
        targets: Tensor,
        vocab_size: int,
        *,
        ignore_index: int = IGNORE_INDEX,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        reduction: str = "mean",
    ) -> Any:
        """Next-token cross-entropy in fp32: ``logits (batch, seq, vocab)``, ``targets (batch, seq)``.

        A target equal to ``ignore_index`` is no token of the loss (masked-LM positions left alone, an SFT
        prompt, padding), on every path: one device, vocab-parallel (fewer than ``vocab_size`` local columns:
        loss parallel, the full logits are never gathered), and logits of this rank's sequence piece (a
        replicated head under sequence parallelism). ``label_smoothing`` as ``F.cross_entropy``; ``z_loss``
        adds PaLM's ``z_loss * logsumexp(logits) ** 2`` per valid token (1e-4 in PaLM).

        ``reduction="mean"``: the mean over this rank's valid tokens (NaN when there is none, as torch).
        ``reduction="tokens"``: ``TokenLoss(sum, count)``, which the trainer normalises by the count of valid
        tokens over the whole step (every microbatch and data-parallel rank): exact under a mask whose count
        varies by row, where a mean of per-rank means is not.
        """
        _loss.check_options(reduction, label_smoothing, z_loss)
        if self._tp is None and reduction == "mean" and not z_loss:
            z = logits.flatten(0, 1).float()
            return F.cross_entropy(z, targets.flatten(), ignore_index=ignore_index, label_smoothing=label_smoothing)
        opts: dict[str, Any] = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss)
        if self._tp is not None:
            total, count = self._tp.cross_entropy(logits, targets, vocab_size, **opts)
        else:
            total, count = _loss.dense_cross_entropy(logits, targets, **opts)
        return TokenLoss(total, count) if reduction == "tokens" else total / count

    def token_sum(self, values: Tensor, mask: Tensor | None = None) -> Tensor:
        """The sum over this rank's tokens (dims 0 and 1: batch, sequence) of a per-token quantity; trailing
        dims are kept (per-expert router probabilities for a load-balancing loss: ``(experts,)``).

        ``values (batch, seq_piece, ...)``: under sequence parallelism, computed from this rank's piece of the
        residual stream; the pieces are summed over tp (backward: the identity), so every tp rank holds the
        whole sum and each token's gradient is counted once (a local mean per rank would count it tp times
        once the replicated params' gradients are summed over tp). Values over the whole sequence on every tp
        rank (computed on gathered activations) are cut to this rank's piece first, for the same reason.
        ``mask (batch, seq)``: bool or 0/1 per token, over the whole sequence as the batch holds it.
        """
        v = values.float()
        tp = self._tp
        if tp is not None and tp.sequence_parallel:
            if mask is not None and mask.shape[1] == v.shape[1] * tp.size:
                mask = mask[:, tp.rank * v.shape[1] : (tp.rank + 1) * v.shape[1]]
            elif mask is not None and mask.shape[1] == v.shape[1]:  # whole-sequence values on every rank
                lo, hi = self.seq_range(v.shape[1])
                v, mask = v[:, lo:hi], mask[:, lo:hi]
        if mask is not None:
            v = v * mask.reshape(*mask.shape, *([1] * (v.dim() - 2))).to(v.dtype)
        total = v.sum((0, 1))
        if tp is not None and tp.sequence_parallel:
            total = _collectives.all_reduce(total, tp.group)
        return total

    def token_mean(self, values: Tensor, mask: Tensor | None = None) -> TokenLoss:
        """``TokenLoss(sum, count)`` of a per-token quantity (``values (batch, seq_piece, ...)``, trailing dims
        summed) over this rank's tokens, ``mask (batch, seq)`` selecting them: the mean over the step's tokens
        once the trainer divides (see ``cross_entropy(reduction="tokens")``). A z-loss on router logits:
        ``layout.token_mean(torch.logsumexp(router_logits, -1) ** 2)``. Sequence pieces as ``token_sum``."""
        total = self.token_sum(values.float().flatten(2).sum(-1) if values.dim() > 2 else values, mask)
        if mask is not None:
            count = mask.float().sum()  # the whole sequence's: the same on every tp rank
        else:
            count = torch.tensor(float(values.shape[0] * values.shape[1] * self.seq_shards), device=values.device)
        return TokenLoss(total, count)

    # -- data parallel coordinates
    @property
    def dp_size(self) -> int:
        if self.mesh is None:
            return 1
        names = self.mesh.mesh_dim_names or ()
        return math.prod(self.mesh.size(names.index(a)) for a in DP_AXES if a in names)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (row-major over ``dp_replicate, dp_shard``)."""
        if self.mesh is None:
            return 0
        names = self.mesh.mesh_dim_names or ()
        rank = 0
        for a in DP_AXES:
            if a in names:
                i = names.index(a)
                rank = rank * self.mesh.size(i) + self.mesh.get_local_rank(i)
        return rank


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
    """``Layout.prefetch``'s result: the tree's leaves and buckets (shards already through their autograd
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

    def __init__(self, layout: Layout, params: Any, prev: _Regather | None = None) -> None:
        self.layout, self.params, self.prev = layout, params, prev
        self.where: dict[int, int] = {}  # storage address of a gathered leaf -> its index
        self.cache: list[Tensor] | None = None
        self.started: _Prefetched | None = None  # this block's gather, started by the next block's backward
        self.pending = 0

    def track(self, gathered: list[Tensor]) -> None:
        # keyed by the storage object (not its address: fake tensors, which the planner traces, have none)
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
                self.cache = optree.tree_leaves(self.layout.params(self.params, self.started))
                self.started = None
                prev = self.prev
                if prev is not None and prev.pending and prev.cache is None and prev.started is None:
                    prev.started = self.layout.prefetch(prev.params)
        out = torch.as_strided(self.cache[i], size, stride, offset)
        self.pending -= 1
        if self.pending == 0:  # the block's backward took all it saved: free the re-gathered params
            self.cache = None
        return out


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
        if isinstance(pl, Shard) and pl.dim == dim and names[i] not in DP_AXES and p.device_mesh.size(i) > 1
    ]
    if other:
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} is sharded on dim {dim} by both a data-parallel axis and {other}; "
            f"give that dim's data-parallel rule a different logical name so FSDP shards another dim"
        )
