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

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from . import _attention, _collectives, _loss, _remat, rope
from ._cp import CPContext
from ._fsdp import FSDP, FSDPPolicy
from ._loss import IGNORE_INDEX, TokenLoss
from ._names import NameTable
from ._rules import Rules, Spec, default_rules, is_spec, logical_to_mesh_axes, spec_placements
from ._seq import WHOLE, SequenceSplit
from ._tp import TPContext, parse_einsum
from .mesh import DP_AXES, EP_DENSE, EP_SPAN, expert_axis, fsdp_groups, storage_mesh
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
    communication happens. Floating-point leaves come back as DTensor leaves with ``requires_grad`` set, on
    ``storage_mesh(mesh)``: the mesh's axes of more than one rank (a size-1 axis carries nothing and makes every
    DTensor op slower). Under expert parallelism a dense param's dp_shard and ep are one axis there, ``dp_shard_ep``
    (FSDP over the whole dp_shard degree; ``ep`` on a param's mesh then always shards its experts).
    """
    storage = storage_mesh(mesh)
    span = expert_axis(mesh) == EP_SPAN
    made: dict[str, DeviceMesh] = {}  # storage_mesh(mesh, dense=True / experts=True), made at first use

    def one(name: str, x: Any, spec: Spec) -> Any:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: place() takes a tree of tensors, found {type(x).__name__}")
        on_mesh = spec_placements(spec, rules, mesh, name=name, ndim=x.ndim, shape=x.shape)
        where = storage
        experts = _experts_dim(spec, rules, mesh) if span else None
        if experts is not None:  # a routed expert: its experts dim over ep x cp x tp, FSDP over the rest
            where = made["experts"] = made.get("experts") or storage_mesh(mesh, experts=True)
            names = list(mesh.mesh_dim_names or ())
            pl = tuple(Shard(experts) if a == EP_SPAN else on_mesh[names.index(a)] for a in where.mesh_dim_names or ())
        else:
            if _ep_shards_data(spec, rules, mesh, on_mesh):
                where = made["dense"] = made.get("dense") or storage_mesh(mesh, dense=True)
            pl = _on(where, mesh, on_mesh)
        full = x.detach()
        # distribute_tensor(src_data_rank=None) cuts every rank's chunk to keep one: 8192 fake tensors per
        # leaf at FSDP 8192, most of a planner trace's time. This rank's slice, cloned, is the same DTensor.
        local = _local_slice(full, where, pl).clone(memory_format=torch.contiguous_format)
        out = DTensor.from_local(local, where, pl, run_check=False, shape=full.shape, stride=full.stride())
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
    storage = storage_mesh(mesh)
    pl = _on(storage, mesh, spec_placements(spec, rules, mesh, name="activation", ndim=x.ndim))
    if isinstance(x, DTensor):
        return x.redistribute(storage, pl)
    local = _local_slice(x, storage, pl)
    return DTensor.from_local(local, storage, pl, run_check=False, shape=x.shape, stride=x.stride())


def _on(storage: DeviceMesh, mesh: DeviceMesh, pl: Sequence[Any]) -> tuple[Any, ...]:
    """Placements ``pl`` (one per dim of ``mesh``) for the dims ``storage_mesh(mesh)`` keeps (``dp_shard_ep``:
    ep's, which shards the same dim as dp_shard or is all of it)."""
    names = list(mesh.mesh_dim_names or ())
    return tuple(pl[names.index("ep" if a == EP_DENSE else a)] for a in storage.mesh_dim_names or ())


def _ep_shards_data(spec: Spec, rules: Rules, mesh: DeviceMesh, pl: Sequence[Any]) -> bool:
    """Whether ``ep`` shards this param as a data-parallel axis: its rule lists ep with other axes (the default
    rules' ``embed``: FSDP over the whole dp_shard degree), not alone (``experts``: expert parallelism)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "ep" not in names or not isinstance(pl[names.index("ep")], Shard):
        return False
    return len(logical_to_mesh_axes(spec, rules, mesh_axes=names)[pl[names.index("ep")].dim]) > 1


def _experts_dim(spec: Spec, rules: Rules, mesh: DeviceMesh) -> int | None:
    """The dim the rules give ``ep`` alone (a routed expert's ``experts``), or None."""
    axes = logical_to_mesh_axes(spec, rules, mesh_axes=tuple(mesh.mesh_dim_names or ()))
    return next((d for d, a in enumerate(axes) if a == ("ep",)), None)


def _local_slice(x: Tensor, mesh: DeviceMesh, pl: Sequence[Any]) -> Tensor:
    """This rank's view of full ``x`` under placements ``pl`` (Shard or Replicate), as DTensor cuts it:
    earlier mesh axes split first, ``torch.chunk`` sizes (the last ranks' chunks may be short or empty)."""
    local = x
    for mi, p in enumerate(pl):
        if isinstance(p, Shard):
            n, r = mesh.size(mi), mesh.get_local_rank(mi)
            local = local.narrow(p.dim, *_collectives.chunk(local.shape[p.dim], n, r))
    return local


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
        cp_attention: with ``cp > 1`` on the mesh, how attention spans the sequence chunks: "allgather",
            "ring" or "ulysses" (``functitan._cp``).
    """

    mesh: DeviceMesh | None = None
    rules: Rules = field(default_factory=default_rules)
    remat: str | _remat.Policy = "none"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    compile: bool = False
    reshard_after_forward: bool = True
    names: NameTable | None = None
    cp_attention: str = "allgather"
    # derived in __post_init__ from the (immutable) mesh and rules: not arguments, not compared, not state
    _tp: TPContext | None = field(default=None, init=False, repr=False, compare=False)
    _fsdp: FSDP = field(default=FSDP(), init=False, repr=False, compare=False)
    _seq: SequenceSplit = field(default=WHOLE, init=False, repr=False, compare=False)
    _cp: CPContext | None = field(default=None, init=False, repr=False, compare=False)
    _ep: Any = field(default=None, init=False, repr=False, compare=False)  # functitan.moe's ExpertParallel

    def __post_init__(self) -> None:
        _remat.as_policy(self.remat)  # an unknown spelling fails here
        mesh = self.mesh
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        on = lambda axis: mesh is not None and axis in names and mesh[axis].size() > 1  # noqa: E731
        tp = TPContext(mesh, self.rules) if on("tp") and mesh is not None else None
        policy = FSDPPolicy(self.param_dtype, self.reduce_dtype, self.reshard_after_forward)
        fsdp = FSDP(
            policy,
            on("dp_shard") or on("ep") or on("cp"),  # FSDP shards over dp_shard (ep's ranks too) x cp
            tp.grad_sum if tp is not None and tp.sequence_parallel else None,
            fsdp_groups(mesh) if mesh is not None else {},
        )
        cp = CPContext(mesh, self.cp_attention) if on("cp") and mesh is not None else None
        object.__setattr__(self, "_tp", tp)
        object.__setattr__(self, "_fsdp", fsdp)
        object.__setattr__(self, "_cp", cp)
        axis = expert_axis(mesh)
        if axis is not None and mesh is not None:
            from .moe._dispatch import ExpertParallel

            # tp in the experts' group without sequence parallelism: its ranks hold the same tokens
            spans_tp = axis == EP_SPAN and tp is not None and not tp.sequence_parallel
            object.__setattr__(self, "_ep", ExpertParallel.of(mesh, axis, tp.group if spans_tp and tp else None))
        seq = cp.split if cp is not None else WHOLE
        if tp is not None and tp.sequence_parallel:  # SP cuts what cp leaves
            by, fix = (
                f"sequence parallelism over tp={tp.size}",
                "change training.seq_len or set parallelism.sequence_parallel=false",
            )
            seq = SequenceSplit(tp.size, tp.rank, by, fix, outer=cp.split if cp is not None else None)
        object.__setattr__(self, "_seq", seq)

    @property
    def sequence_parallel(self) -> bool:
        return self._tp is not None and self._tp.sequence_parallel

    @property
    def seq(self) -> SequenceSplit:
        """How the residual stream is split along the sequence (``functitan._seq``): over cp (two balanced chunks
        per rank) under context parallelism, then over tp under sequence parallelism, else not at all."""
        return self._seq

    @property
    def seq_shards(self) -> int:
        """Into how many pieces the residual stream is split along the sequence (``cp x tp`` under both)."""
        return self._seq.total

    def seq_range(self, seq_len: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's positions in a sequence of ``seq_len``: its piece of the residual
        stream (``seq.range``), when that is one range (not under context parallelism: use ``positions``)."""
        return self._seq.range(seq_len)

    def positions(self, seq_len: int, device: torch.device | str = "cpu") -> Tensor:
        """This rank's position ids ``(local_seq,)`` in a sequence of ``seq_len``: its piece of the residual
        stream."""
        return self._seq.positions(seq_len, device)

    def rotary(
        self,
        head_dim: int,
        theta: float,
        seq_len: int,
        *,
        scaling: Any = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> tuple[Tensor, Tensor]:
        """RoPE's ``cos, sin (seq_len, head_dim)`` for the ``seq_len`` tokens attention sees here, at their
        positions: after ``past_len`` kept tokens (a KV cache), and under context parallelism this rank's
        chunks of the whole sequence. One cache for every model (``functitan.rope``)."""
        past, cp, device = self.past_len, self._cp, torch.device(device)
        if cp is None:
            cos, sin = rope.cached_tables(head_dim, theta, past + seq_len, scaling=scaling, device=device, dtype=dtype)
            return cos[past:], sin[past:]
        whole = seq_len * cp.size
        cos, sin = rope.cached_tables(head_dim, theta, whole, scaling=scaling, device=device, dtype=dtype)
        at = cp.split.positions(whole, cos.device)
        return cos[at], sin[at]

    @property
    def past_len(self) -> int:
        """Positions before this forward's tokens: 0 in training; when generating with a KV cache
        (``functitan.generate``), the tokens it holds. A model offsets its positions by it (RoPE tables, a position
        table), so that a forward over the new tokens alone sees them where they are."""
        return 0

    # -- parameters and blocks: the data-parallel part (functitan/_fsdp.py)
    def param(self, p: Tensor) -> Tensor:
        """Storage -> compute: a differentiable local tensor, gathered over the data-parallel axes (FSDP's
        all-gather / reduce-scatter, DDP's all-reduce) in ``param_dtype`` / ``reduce_dtype``; tensor-parallel
        shards stay local. Under sequence parallelism a param replicated over tp gets a gradient sum over tp:
        every activation is then split over tp (by sequence or by feature), so each rank holds a part of its
        gradient, however the model uses it (``x + bias``, a norm weight, a position table)."""
        return self._fsdp.param(p)

    def params(self, tree: Any) -> Any:
        """``param`` over a tree, the FSDP all-gathers of all leaves bucketed into one collective per process
        group (and one reduce-scatter in backward), as FSDP2 does per module."""
        return self._fsdp.params(tree)

    def blocks(
        self,
        fn: Callable[..., Tensor],
        layers: Sequence[Any],
        x: Tensor,
        *args: Any,
        remat: Sequence[str | _remat.Policy | None] | None = None,
    ) -> Any:
        """``x = fn(compute_params, x, *args)`` for each block's params in ``layers``, in order. A block may
        return ``(x, aux)``, aux a tree of tensors (a MoE layer's load and balance terms): the result is then
        ``(x, the aux trees added over the blocks)``.

        Each block's params are gathered inside its remat region; under FSDP the next block's all-gather
        overlaps this block's compute (unless the next block is checkpointed: it gathers inside its region),
        and each block's backward reduce-scatter runs under the previous block's backward. ``remat``: a policy
        per block (None entries: the layout's), e.g. ``["full"] * 4 + [None] * 12``.
        """
        policies = [_policy(self, remat[i] if remat is not None else None) for i in range(len(layers))]
        return self._fsdp.blocks(_compiled(self, fn), layers, x, args, policies)

    def block(
        self, fn: Callable[..., Tensor], params: Any, *args: Any, remat: str | _remat.Policy | None = None
    ) -> Tensor:
        """``fn(compute_params, *args)`` with the params gathered inside the block's remat region; ``remat``:
        this block's policy instead of the layout's."""
        return self._fsdp.block(_compiled(self, fn), params, args, _policy(self, remat))[0]

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
            return _named(self.names, pattern, *operands)
        if self._tp is not None and len(operands) == 2:
            return self._tp.einsum(pattern, *operands)
        return parse_einsum(pattern, len(operands))[2](*operands)

    def einsums(self, x: Tensor, pairs: list[tuple[str, Tensor]]) -> list[Tensor]:
        """``[einsum(pattern, x, w) for pattern, w in pairs]``: contractions that share their input ``x``
        (q, k and v; gate and up). Under tensor parallelism the shared input is gathered along the sequence
        (sequence parallel) or gradient-reduced once for all of them instead of once each, and backward runs
        one reduce-scatter / all-reduce of the summed input gradient."""
        if self.names is not None:
            caller = sys._getframe(1)
            for pattern, w in pairs:
                self.names.check_einsum(pattern, w, caller)
            return [_named(self.names, pattern, x, w) for pattern, w in pairs]
        if self._tp is not None:
            return self._tp.einsums(x, pairs)
        return [parse_einsum(pattern, 2)[2](x, w) for pattern, w in pairs]

    def whole_over_tp(self, x: Tensor, names: str) -> Tensor:
        """An activation every tensor-parallel rank uses whole outside a contraction with a tp-sharded param (MLA's
        rotary key, which all heads share), named by its logical dims (``"batch seq kv_a"``): gathered along
        ``seq`` under sequence parallelism; without it, itself, with its gradient (each rank's heads give a
        part) summed over tp. The plain value without tensor parallelism."""
        if self._tp is None or self.names is not None:
            return x
        return self._tp.whole(x, tuple(names.split()))

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        segment_ids: Tensor | None = None,
        scale: float | None = None,
    ) -> Tensor:
        """Attention of this rank's heads over the whole sequence: ``q (batch, heads, seq, head_dim)``,
        ``k``/``v (batch, kv_heads, seq, head_dim)`` (grouped-query when fewer). ``segment_ids (batch, seq)``:
        packed documents attend only within themselves. The one entry every model uses, so that a parallelism
        that splits the sequence changes how attention runs, not the model (``functitan._attention``). Under
        context parallelism the sequence dim is this rank's chunks, ``segment_ids`` the whole sequence's, and
        the keys of every chunk are reached as ``cp_attention`` says (``functitan._cp``)."""
        if self._cp is not None:
            return self._cp.attention(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale)
        if self.names is not None:  # the check before step 1 (functitan.model.check_names)
            self.names.attention(q, k)
        return _attention.attention(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale)

    @property
    def expert_parallel(self) -> Any:
        """The routed experts' group (``functitan.moe``'s ExpertParallel: the ``ep`` axis, or ep x cp x tp
        flattened where expert parallelism spans them) when it has more than one rank, else None: a MoE layer's
        routed experts are then this rank's share, and their tokens travel by all-to-all."""
        return self._ep

    def moe(self, x: Tensor, p: Any, router: Any) -> tuple[Tensor, dict[str, Any]]:
        """The mixture-of-experts layer (``functitan.moe``): ``x (batch, seq piece, embed)`` in the residual
        layout -> ``(out, aux)``. The one entry every model uses, so that a parallelism that places experts on
        other ranks changes how it runs, not the model. Return ``aux`` from the block beside ``x``:
        ``blocks`` adds it over the blocks."""
        from .moe import moe

        return moe(x, p, router, self)

    def embed(self, tokens: Tensor, table: Tensor, num_rows: int) -> Tensor:
        """Row lookup: ``tokens (batch, seq)`` ids into ``table (num_rows, embed)`` -> ``(batch, seq, embed)``.

        Token embeddings and learned position tables alike: a table whose local rows are fewer than
        ``num_rows`` is vocab-parallel (sharded over tp), any other is replicated; the result is in the
        residual layout (this rank's sequence piece under sequence and context parallelism: ``tokens`` are the
        whole sequence, each rank looks up its piece).
        """
        if self._cp is not None:
            tokens = self._cp.split.cut(tokens)
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
        cp = self._cp
        if cp is not None:  # this rank's chunks; the sums below are summed over cp
            targets = cp.split.cut(targets)
        if self._tp is None and cp is None and reduction == "mean" and not z_loss:
            z = logits.flatten(0, 1).float()
            return F.cross_entropy(z, targets.flatten(), ignore_index=ignore_index, label_smoothing=label_smoothing)
        opts: dict[str, Any] = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss)
        if self._tp is not None:
            total, count = self._tp.cross_entropy(logits, targets, vocab_size, **opts)
        else:
            total, count = _loss.dense_cross_entropy(logits, targets, **opts)
        if cp is not None:
            total, count = cp.whole(total), cp.whole(count.detach())
        return TokenLoss(total, count) if reduction == "tokens" else total / count

    def token_sum(self, values: Tensor, mask: Tensor | None = None, *, per_sequence: bool = False) -> Tensor:
        """The sum over this rank's tokens (dims 0 and 1: batch, sequence) of a per-token quantity; trailing
        dims are kept (per-expert router probabilities for a load-balancing loss: ``(experts,)``);
        ``per_sequence``: over the sequence only, one sum per row (``(batch, ...)``: a sequence-wise term).

        ``values (batch, seq_piece, ...)``: under sequence parallelism, computed from this rank's piece of the
        residual stream; the pieces are summed over tp (backward: the identity), so every tp rank holds the
        whole sum and each token's gradient is counted once (a local mean per rank would count it tp times
        once the replicated params' gradients are summed over tp). Values over the whole sequence on every tp
        rank (computed on gathered activations) are cut to this rank's piece first, for the same reason.
        ``mask (batch, seq)``: bool or 0/1 per token, over the whole sequence as the batch holds it.
        """
        v = values.float()
        if mask is not None and self._cp is not None:  # the cp chunks: what this rank's values cover at most
            mask = self._cp.split.cut(mask)
        seq = dataclasses.replace(self._seq, outer=None) if self._cp is not None else self._seq  # SP's part
        if seq.shards > 1 and not seq.balanced:
            if mask is not None and mask.shape[1] == v.shape[1] * seq.shards:
                mask = mask[:, seq.index * v.shape[1] : (seq.index + 1) * v.shape[1]]
            elif mask is not None and mask.shape[1] == v.shape[1]:  # whole-sequence values on every rank
                lo, hi = seq.range(v.shape[1])
                v, mask = v[:, lo:hi], mask[:, lo:hi]
        if mask is not None:
            v = v * mask.reshape(*mask.shape, *([1] * (v.dim() - 2))).to(v.dtype)
        total = v.sum(1) if per_sequence else v.sum((0, 1))
        if self._tp is not None and self._tp.sequence_parallel:  # the pieces are tp's: summed over tp
            total = _collectives.all_reduce(total, self._tp.group)
        if self._cp is not None:  # the chunks are cp's: summed over cp (backward: the gradient all-reduced)
            total = self._cp.whole(total)
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
            count = values.new_full((), float(values.shape[0] * values.shape[1] * self.seq_shards), dtype=torch.float32)
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


def _policy(layout: Layout, remat: str | _remat.Policy | None) -> _remat.Policy:
    """A block's remat policy: its own, else the layout's."""
    return _remat.as_policy(layout.remat if remat is None else remat)


def _compiled(layout: Layout, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    # dynamo's cache lives with fn's code: compiled once, whatever the wrapper
    return torch.compile(fn) if layout.compile else fn


def _named(names: NameTable, pattern: str, *operands: Tensor) -> Tensor:
    """Check mode's contraction: the plain op, its output's names recorded for the bias check."""
    _, out_names, op = parse_einsum(pattern, len(operands))
    out = op(*operands)
    names.name_activation(out, out_names)
    return out
