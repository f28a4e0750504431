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

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

from . import _collectives
from ._rules import Rules, Spec, compute_placements, default_rules, is_spec, logical_to_mesh_axes, spec_placements
from .mesh import DP_AXES
from .tree import map_with_names, tree_map

__all__ = [
    "Layout",
    "Rules",
    "Spec",
    "default_rules",
    "logical_to_mesh_axes",
    "spec_placements",
    "compute_placements",
    "place",
    "placements",
    "constrain",
    "is_spec",
]

REMAT_POLICIES = ("none", "full")


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

    A plain tensor is taken as this rank's full value and distributed without communication; a DTensor is
    redistributed (the collectives DTensor picks run forward and, dually, backward).
    """
    pl = spec_placements(spec, rules, mesh, name="activation", ndim=x.ndim)
    if isinstance(x, DTensor):
        return x.redistribute(mesh, pl)
    return distribute_tensor(x, mesh, pl, src_data_rank=None)


# ----------------------------------------------------------------------------------------------- Layout


@dataclass(frozen=True)
class Layout:
    """How a model computes on a mesh: the mesh, the rules, and the block-level remat policy.

    A model takes a Layout as an argument and routes four things through it: parameters (``param``), blocks
    (``block``, which gathers a block's params inside its remat region: FSDP's reshard-after-forward),
    contractions with parameters (``einsum``, named by logical axes) and the token embedding / loss. With
    ``Layout()`` (no mesh) every one of them is the plain single-device op.
    """

    mesh: DeviceMesh | None = None
    rules: Rules = field(default_factory=default_rules)
    remat: str = "none"

    def __post_init__(self) -> None:
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r} is not a policy; choose one of {REMAT_POLICIES}")

    # -- parameters
    def param(self, p: Tensor) -> Tensor:
        """Storage -> compute: a differentiable local tensor, gathered over the data-parallel axes."""
        if not isinstance(p, DTensor):
            return p
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or ()
        local = p.to_local()
        for mi, pl in enumerate(p.placements):
            if names[mi] not in DP_AXES or mesh.size(mi) == 1:
                continue
            group = mesh.get_group(mi)
            if isinstance(pl, Shard):
                _check_only_dp_on_dim(p, pl.dim)
                local = _collectives.all_gather(local, pl.dim, p.shape[pl.dim], group)
            elif isinstance(pl, Replicate):
                local = _collectives.grad_all_reduce(local, group)
            else:
                raise ValueError(f"parameter placement {pl} on mesh axis {names[mi]!r} is not supported")
        return local

    def params(self, tree: Any) -> Any:
        return tree_map(self.param, tree)

    # -- blocks
    def block(self, fn: Callable[..., Tensor], params: Any, *args: Any) -> Tensor:
        """``fn(compute_params, *args)`` with the params gathered inside the (optional) remat region."""

        def run(p: Any, *a: Any) -> Tensor:
            return fn(self.params(p), *a)

        if self.remat == "full" and torch.is_grad_enabled():
            return checkpoint(run, params, *args, use_reentrant=False)
        return run(params, *args)

    # -- activations
    def einsum(self, pattern: str, *operands: Tensor) -> Tensor:
        """A contraction written with logical axis names, e.g. ``"batch seq embed, heads embed -> batch seq heads"``.

        The names say which dims may be sharded, so a layout can insert the collectives a contraction needs;
        on one device (and under pure data parallelism) it is the plain op: ``F.linear`` for a projection,
        a broadcast multiply for a scale, ``torch.einsum`` otherwise.
        """
        return _plan(pattern, len(operands))(*operands)

    def embed(self, tokens: Tensor, table: Tensor) -> Tensor:
        """Token embedding lookup: ``tokens (batch, seq)``, ``table (vocab, embed)`` -> ``(batch, seq, embed)``."""
        return F.embedding(tokens, table)

    def cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy in fp32: ``logits (batch, seq, vocab)``, ``targets (batch, seq)``."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

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


def _check_only_dp_on_dim(p: DTensor, dim: int) -> None:
    names = p.device_mesh.mesh_dim_names or ()
    other = [names[i] for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == dim and names[i] not in DP_AXES and p.device_mesh.size(i) > 1]
    if other:
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} is sharded on dim {dim} by both a data-parallel axis and {other}; "
            f"give that dim's data-parallel rule a different logical name so FSDP shards another dim"
        )


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\.\.\.")


@functools.lru_cache(maxsize=256)
def _plan(pattern: str, n_operands: int) -> Callable[..., Tensor]:
    if "->" not in pattern:
        raise ValueError(f"einsum pattern {pattern!r} needs '->' (e.g. 'batch seq embed, heads embed -> batch seq heads')")
    lhs, out = pattern.split("->")
    inputs = [tuple(_NAME.findall(s)) for s in lhs.split(",")]
    output = tuple(_NAME.findall(out))
    if len(inputs) != n_operands:
        raise ValueError(f"einsum pattern {pattern!r} names {len(inputs)} operands but {n_operands} were given")
    if n_operands == 2:
        x, w = inputs
        # a projection: x (..., in) with w (out, in) -> (..., out)
        if len(w) == 2 and x and x[-1] == w[1] and output == (*x[:-1], w[0]) and w[0] not in x:
            return F.linear
        # a scale: w's names are x's trailing names and the output is x
        if output == x and len(w) <= len(x) and x[len(x) - len(w):] == w:
            return torch.mul
    letters: dict[str, str] = {}
    for name in (n for names in (*inputs, output) for n in names):
        if name == "...":
            continue
        if name not in letters:
            if len(letters) >= 52:
                raise ValueError(f"einsum pattern {pattern!r} uses more than 52 axis names")
            letters[name] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[len(letters)]
    to = lambda names: "".join("..." if n == "..." else letters[n] for n in names)  # noqa: E731
    eq = ",".join(to(i) for i in inputs) + "->" + to(output)
    return functools.partial(torch.einsum, eq)
