"""The named device mesh: one DeviceMesh whose axes are named after the parallelism they carry.

Axis order is fixed, outermost first: ``pp, dp_replicate, dp_shard, ep, cp, tp`` (tensor parallel innermost, so
its ranks are neighbours and its collectives stay on the fastest links; context parallel next to it, for its K/V
traffic; pipeline outermost, it only sends P2P), as torchtitan orders them.
Every axis is always present, possibly of size 1, so code can name any axis without checking whether it
exists; a size-1 axis means "replicated" everywhere.

Expert parallelism borrows its ranks from ``dp_shard x cp x tp`` as torchtitan does (``efsdp = dp_shard * cp *
tp / ep``): an ep group is ``ep`` consecutive ranks of that block, so it spans all of cp and tp and takes the rest
from dp_shard. The mesh's ``ep`` axis holds that rest: with ``parallelism.dp_shard=4, ep=2`` (no cp, tp) the mesh's
``dp_shard`` axis has 2 ranks and ``ep`` 2; with ``dp_shard=2, tp=2, ep=2`` ``ep`` has 1 and the experts' group is
tp's ranks. Where cp or tp is in it, ``make_mesh`` registers the group as one flattened axis, ``ep_cp_tp``
(``expert_axis``). The ``ep`` axis's ranks are data parallel for every param but the routed experts, whose
``experts`` dim the experts' group shards (``functitan.moe``). So that a dense param is FSDP-sharded over the whole
``dp_shard`` degree (as without ep), it lives on a mesh whose ``dp_shard`` and ``ep`` axes are one, ``dp_shard_ep``
(``storage_mesh(..., dense=True)``); a routed expert lives on ``storage_mesh(..., experts=True)``.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "AXES",
    "DEGREES",
    "DP_AXES",
    "EP_DENSE",
    "EP_SPAN",
    "EXPERT_AXES",
    "FSDP_AXES",
    "REPLICA_AXES",
    "make_mesh",
    "storage_mesh",
    "expert_axis",
    "fsdp_groups",
    "resolve_degrees",
    "check_ep",
    "default_device_type",
]

AXES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # whose product is the world size; ep borrows from these
DP_AXES = ("dp_replicate", "dp_shard", "ep")  # each rank its own batch slice
# the ranks that hold the same parameters and average their gradients: the data-parallel axes, and cp, whose
# ranks hold the same batch's different chunks of the sequence and the same (whole-sequence) loss. A param
# Shard-ed on an EXPERT_AXES axis (routed experts) is expert parallel there: each rank holds other experts,
# never gathered. ``dp_shard_ep``: dp_shard and ep flattened (rank ``i * ep + j``), the axis a dense param is
# FSDP-sharded on under ep: every rank of the dp_shard degree, ep's included (torchtitan's dense ``dp_shard_cp``
# mesh).
EP_DENSE = "dp_shard_ep"
# ``ep_cp_tp``: ep, cp and tp flattened (rank ``(i * cp + j) * tp + k``), the routed experts' group when expert
# parallelism spans cp or tp (``make_mesh`` registers it then; ``expert_axis``)
EP_SPAN = "ep_cp_tp"
_SPANNED = ("ep", "cp", "tp")
EXPERT_AXES = ("ep", EP_SPAN)  # the axes a routed expert's experts dim is split over (``expert_axis``)
REPLICA_AXES = ("dp_replicate", "dp_shard", "ep", EP_DENSE, EP_SPAN, "cp")
# the axes FSDP shards parameters over (torchtitan's ``fsdp = dp_shard * cp``): a cp rank holds no extra
# parameter memory. Both shard the same dim, dp_shard outer, so one all-gather over the flattened group
# (``fsdp_groups``) gathers what the two axes split; under ep a dense param's dp_shard is ``dp_shard_ep``.
FSDP_AXES = ("dp_shard", "cp")
_FLAT = {("dp_shard", "cp"): "dp_shard_cp", (EP_DENSE, "cp"): "dp_shard_ep_cp"}


def default_device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_degrees(world_size: int, **degrees: int) -> dict[str, int]:
    """Fill the one ``-1`` degree with the remaining ranks and check that the product equals ``world_size``.

    >>> resolve_degrees(8, pp=1, dp_replicate=2, dp_shard=-1, tp=2)
    {'pp': 1, 'dp_replicate': 2, 'dp_shard': 2, 'cp': 1, 'tp': 2}
    """
    unknown = set(degrees) - set(DEGREES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {list(DEGREES)}")
    out = {a: int(degrees.get(a, 1)) for a in DEGREES}
    for a, d in out.items():
        if d == 0 or d < -1:
            raise ValueError(f"parallelism.{a}={d}: a degree is a positive integer, or -1 for 'the remaining ranks'")
    fill = [a for a, d in out.items() if d == -1]
    if len(fill) > 1:
        raise ValueError(f"parallelism: only one degree may be -1, got -1 for {fill}; set all but one explicitly")
    fixed = math.prod(d for d in out.values() if d != -1)
    if fill:
        if world_size % fixed:
            raise ValueError(
                f"parallelism.{fill[0]}=-1: the other degrees multiply to {fixed}, which does not divide the world "
                f"size {world_size}; choose degrees whose product divides {world_size}"
            )
        out[fill[0]] = world_size // fixed
    product = math.prod(out.values())
    if product != world_size:
        shown = " x ".join(f"{a}={d}" for a, d in out.items())
        raise ValueError(
            f"parallelism: {shown} = {product} ranks, but the world size is {world_size}; make the product "
            f"{world_size} (for example set dp_shard=-1 to take the remaining ranks)"
        )
    return out


def make_mesh(
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    *,
    device: str | None = None,
) -> DeviceMesh:
    """A DeviceMesh with axes ``("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")`` over the current process
    group.

    Args:
        dp_replicate: data-parallel replicas (DDP; with dp_shard > 1, HSDP).
        dp_shard: data-parallel shards (FSDP). -1 takes the remaining ranks.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        cp: context-parallel degree (the sequence split over cp ranks).
        ep: expert-parallel degree, borrowed from ``dp_shard x cp x tp`` (``check_ep``): the mesh's ``ep`` axis
            has ``ep / (cp * tp)`` ranks and its ``dp_shard`` axis keeps the rest of dp_shard.
        device: ``"cpu"`` or ``"cuda"``; defaults to cuda when available.

    Without an initialised process group the mesh has one rank (world size 1).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    degrees = resolve_degrees(world, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)
    borrowed = check_ep(ep, degrees["dp_shard"], cp=degrees["cp"], tp=degrees["tp"])
    degrees = {**degrees, "dp_shard": degrees["dp_shard"] // borrowed, "ep": borrowed}
    device = device or default_device_type()
    if not dist.is_initialized():
        _init_single_process(device)
    mesh = init_device_mesh(device, tuple(degrees[a] for a in AXES), mesh_dim_names=AXES)
    fsdp_groups(mesh)  # the flattened axes' process groups are made now, on every rank at once (a collective)
    if ep > 1 and degrees["cp"] * degrees["tp"] > 1:
        _flatten(mesh, _SPANNED, EP_SPAN)  # the experts' group spans cp and tp (``expert_axis``)
    return mesh


def expert_axis(mesh: DeviceMesh | None) -> str | None:
    """The axis a routed expert's ``experts`` dim is sharded over: ``ep_cp_tp`` where ``make_mesh`` made expert
    parallelism span cp or tp, ``ep`` where it has ranks of dp_shard alone, else None (no expert parallelism)."""
    if mesh is None:
        return None
    if EP_SPAN in getattr(mesh._get_root_mesh(), "_flatten_mapping", {}):
        return EP_SPAN
    names = tuple(mesh.mesh_dim_names or ())
    return "ep" if "ep" in names and mesh.size(names.index("ep")) > 1 else None


def storage_mesh(mesh: DeviceMesh, *, dense: bool = False, experts: bool = False) -> DeviceMesh:
    """``mesh`` without its size-1 axes (its first axis alone when every axis has one rank): the mesh DTensor
    params and activations live on. ``dense``: for a param whose FSDP dim ep shards with dp_shard (the default
    rules' ``embed``), the mesh's ``dp_shard`` and ``ep`` as one axis, ``dp_shard_ep``: FSDP then gathers it over
    the whole dp_shard degree, and ``ep`` on a param's own mesh always means its experts (``functitan._fsdp``).

    DTensor's sharding propagation expands an op's strategies over every mesh dim, a size-1 dim included (torch's
    O(S^N) expansion), so a pointwise op's first call on a new shape costs about 6x more per dim: on one CPU
    process beside other work, ``x + y`` (two DTensors, 8 x 4) took ~0.02 s on a 2-dim mesh and ~120 s on the
    six-axis mesh, ``x.to(bf16)`` ~24 s. A size-1 axis carries nothing (every placement on it is Replicate), so
    dropping it changes no value. Slicing reuses the mesh's process groups: no collective, the same result on
    every rank.

    ``experts``: for a routed expert where expert parallelism spans cp or tp (``expert_axis``), the mesh's axes
    of more than one rank but ep, cp and tp, then ``ep_cp_tp``: its experts dim is split over that group, and
    FSDP shards it over what the group left of dp_shard (torchtitan's efsdp)."""
    names = tuple(mesh.mesh_dim_names or ())
    if experts:
        kept = tuple(a for i, a in enumerate(names) if a not in _SPANNED and mesh.size(i) > 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return mesh._get_root_mesh()[(*kept, EP_SPAN)]
    size = _sizes(mesh) if dense else {a: mesh.size(i) for i, a in enumerate(names)}
    if EP_DENSE in size:
        merged = (EP_DENSE if a == "ep" else a for a in names if a != "dp_shard")
        with warnings.catch_warnings():  # "slicing a flattened dim from root mesh will be deprecated" (torch 2.13)
            warnings.simplefilter("ignore", UserWarning)
            # a flattened axis is sliced from the root mesh: the same ranks for a stage's mesh
            return mesh._get_root_mesh()[tuple(a for a in merged if size[a] > 1)]
    kept = tuple(a for a in names if size[a] > 1) or names[:1]
    return mesh if kept == names else mesh[kept]


def fsdp_groups(mesh: DeviceMesh) -> dict[tuple[str, str], dist.ProcessGroup]:
    """The process groups of ``dp_shard x cp`` flattened (rank ``i * cp + j`` for dp_shard ``i``, cp ``j``: the
    order DTensor chunks a dim sharded on both), and under ep of ``dp_shard_ep x cp``, by their axes: those whose
    axes both have more than one rank. ``dp_shard_ep`` itself is made where ep > 1.

    ``make_mesh`` creates them on every rank; later calls (on the mesh or any submesh holding the axes, such as a
    pipeline stage's) find the same groups in torch's cache without a collective."""
    size = _sizes(mesh)
    both = [(axes, flat) for axes, flat in _FLAT.items() if all(size.get(a, 1) > 1 for a in axes)]
    return {axes: _flatten(mesh, axes, flat).get_group() for axes, flat in both}


def _sizes(mesh: DeviceMesh) -> dict[str, int]:
    """Each axis's size by name, with ``dp_shard_ep``'s where ep > 1 (made then: a collective the first time)."""
    size = {a: mesh.size(i) for i, a in enumerate(mesh.mesh_dim_names or ())}
    if size.get("ep", 1) > 1:
        _flatten(mesh, ("dp_shard", "ep"), EP_DENSE)
        size[EP_DENSE] = size.get("dp_shard", 1) * size["ep"]
    return size


def _flatten(mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> DeviceMesh:
    """``axes`` of ``mesh`` as one axis ``name``, registered on the root mesh (made once: a collective)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return mesh._get_root_mesh()[axes]._flatten(name)


def check_ep(ep: int, dp_shard: int, *, cp: int = 1, tp: int = 1) -> int:
    """Expert parallelism borrows its ranks from dp_shard x cp x tp: ``ep`` is 1, or spans all of cp x tp and
    takes a divisor of dp_shard for the rest (one line naming the degrees that work). Returns that divisor: the
    mesh's ``ep`` axis."""
    span = cp * tp
    ok = [1] + [span * d for d in range(1, dp_shard + 1) if dp_shard % d == 0 and span * d > 1]
    if ep not in ok:
        what = f"parallelism.dp_shard={dp_shard}" + (f" x cp={cp} x tp={tp}" if span > 1 else "")
        rule = f"be a multiple of cp x tp = {span} that divides it" if span > 1 else "divide it"
        raise ValueError(
            f"parallelism.ep={ep}: expert parallelism borrows its ranks from {what}, so ep must {rule}; "
            f"choose ep among {ok} (or raise dp_shard)"
        )
    return ep // span if ep > 1 else 1


def _init_single_process(device: str) -> None:
    """A one-rank process group in memory, so a single process runs the same code path as N."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
