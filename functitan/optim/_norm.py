"""The global L2 norm of a tree whose leaves may be sharded DTensors, with one all-reduce per layout group.

A DTensor's true sum of squares is the sum over the ranks of the mesh dims where it is ``Shard``-ed; on
``Replicate`` dims every rank holds the same copy, so reducing over them would count it once per copy.
Leaves are grouped by (mesh, sharded mesh dims, device): each group sums its local squares with one
``torch._foreach_norm`` and reduces one scalar over only its sharded dims. Worked example on a
``(dp_shard=2, tp=2)`` mesh::

    w1 [Shard(0), Shard(1)]  \\  group A: sharded on (dp_shard, tp) -> one all-reduce over all 4 ranks
    w2 [Shard(1), Shard(0)]  /
    norm [Shard(0), Replicate()]  group B: sharded on (dp_shard,) -> one all-reduce over the dp_shard group
    bias [Replicate(), Replicate()]  group C: nothing sharded -> no collective
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from functitan.optim._local import Flat, flatten
from functitan.tree import flatten_with_names


def global_norm(tree: Any, *, across: dist.ProcessGroup | None = None) -> Tensor:
    """The L2 norm of all leaves of ``tree`` together, as a 0-d tensor (fp32, or fp64 if a leaf is fp64).

    Right for any mix of plain tensors and DTensors with ``Shard``/``Replicate`` placements on any mesh:
    every rank returns the same value, equal to the norm of the full (unsharded) tensors. Every rank of the
    meshes involved must call it (it runs collectives). Leaves with a ``Partial`` placement (unreduced
    gradients) raise a ValueError. Under pipeline parallelism each stage holds different leaves: pass the
    pp process group as ``across`` and the squared norms are summed over it too.

    >>> float(global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}))
    5.0
    """
    sumsq = _global_sumsq(flatten(tree, "tree"))
    if across is not None and dist.get_world_size(across) > 1:
        dist.all_reduce(sumsq, group=across)
    return torch.sqrt(sumsq)


def _global_sumsq(flat: Flat) -> Tensor:
    groups: dict[tuple, list[Tensor]] = {}
    for i, (local, spec) in enumerate(zip(flat.locals, flat.specs)):
        if spec is None:
            key: tuple = (None, (), local.device)
        else:
            if any(p.is_partial() for p in spec.placements):
                name = flatten_with_names(flat.tree)[0][i][0]
                raise ValueError(
                    f"leaf {name!r} has placements {tuple(spec.placements)}: a Partial value has no norm until it "
                    f"is reduced. Fix: redistribute it to Shard/Replicate placements first (gradients from "
                    f"functitan's value_and_grad already are)."
                )
            dims = tuple(d for d, p in enumerate(spec.placements) if p.is_shard() and spec.mesh.size(d) > 1)
            key = (spec.mesh if dims else None, dims, local.device)
        groups.setdefault(key, []).append(local)
    total: Tensor | None = None
    with torch.no_grad():
        for (mesh, dims, _device), locals_ in groups.items():
            acc = torch.float64 if any(t.dtype == torch.float64 for t in locals_) else torch.float32
            norms = torch._foreach_norm(locals_, 2, dtype=acc)
            sumsq = torch.stack(norms).square().sum()
            if dims:
                sumsq = _all_reduce_sum(sumsq, mesh, dims)
            if total is None:
                total = sumsq
            else:
                total = total.to(torch.promote_types(total.dtype, sumsq.dtype)) + sumsq.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float32)


def _all_reduce_sum(t: Tensor, mesh: DeviceMesh, dims: tuple[int, ...], *, allow_world: bool = True) -> Tensor:
    """Sum ``t`` over the ranks of ``mesh`` dims ``dims`` (size-1 dims already dropped).

    One collective on one dim's group; when the dims span every rank of the job, one collective on the
    default group; otherwise one per dim (e.g. HSDP+TP sharded on (dp_shard, tp) of (dp_replicate, dp_shard,
    tp)). ``allow_world=False`` forces the per-dim path (tests use it).
    """
    if len(dims) == 1:
        dist.all_reduce(t, group=mesh.get_group(dims[0]))
    elif allow_world and math.prod(mesh.size(d) for d in dims) == dist.get_world_size():
        dist.all_reduce(t)
    else:
        for d in dims:
            dist.all_reduce(t, group=mesh.get_group(d))
    return t
