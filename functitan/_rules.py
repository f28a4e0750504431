"""Logical axis names -> mesh axes -> DTensor placements. One ordered rules table decides everything.

A *spec* is a tuple with one logical name (or None) per tensor dim, e.g. ``("heads", "embed")`` for a
``[n_heads * head_dim, dim]`` projection. A *rules table* is an ordered tuple of ``(logical_name, mesh_axes)``
pairs; ``mesh_axes`` is one mesh axis name, a tuple of them, or None (replicate).

Precedence (as in flax ``logical_to_mesh_axes``): the dims are resolved left to right; for each dim, the
rules are scanned in order, and the FIRST rule whose logical name matches the dim and none of whose mesh
axes is already used by an earlier dim of the same tensor wins. A dim with no winning rule is replicated.

Worked example, rules ``(("mlp", "tp"), ("embed", "dp_shard"), ("mlp", "dp_shard"))``:

- ``w_gate`` with spec ``("mlp", "embed")``: dim 0 "mlp" -> rule 1 gives ``tp``; dim 1 "embed" -> rule 2
  gives ``dp_shard``. Result ``(("tp",), ("dp_shard",))``: Megatron column-parallel plus FSDP.
- ``w_foo`` with spec ``("embed", "mlp")``: dim 0 "embed" -> ``dp_shard``; dim 1 "mlp" -> rule 1 ``tp``.
- ``w_bar`` with spec ``("mlp", "mlp")``: dim 0 -> ``tp``; dim 1: rule 1 is skipped (tp already used), rule 3
  gives ``dp_shard``. Result ``(("tp",), ("dp_shard",))``.

A mesh axis of size 1 yields ``Replicate()``, so one table serves every layout: with ``tp=1`` the "tp"
rules shard nothing, and FSDP, HSDP, TP and their products are chosen by the mesh degrees alone.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = [
    "Rules",
    "Spec",
    "default_rules",
    "logical_to_mesh_axes",
    "spec_placements",
    "compute_placements",
    "is_spec",
]

Spec = tuple  # tuple[str | None, ...]
Rules = tuple  # tuple[tuple[str, str | tuple[str, ...] | None], ...]


def default_rules(*, sequence_parallel: bool = False) -> Rules:
    """The rules table for transformer models (Llama and friends).

    Params: vocab, heads, kv_heads and mlp go to ``tp`` (Megatron: column-parallel q/k/v/gate/up and the
    vocab-parallel embedding and head, row-parallel o/down); the ``embed`` dim goes to ``dp_shard`` (FSDP);
    ``layers`` goes to ``pp``. Activations: ``batch`` goes to both data-parallel axes, and with sequence
    parallelism the residual stream's ``seq`` goes to ``tp``.
    """
    rules: list[tuple[str, str | tuple[str, ...] | None]] = [
        ("batch", ("dp_replicate", "dp_shard")),
        ("vocab", "tp"),
        ("heads", "tp"),
        ("kv_heads", "tp"),
        ("mlp", "tp"),
        ("embed", "dp_shard"),
        ("layers", "pp"),
    ]
    if sequence_parallel:
        rules.insert(1, ("seq", "tp"))
    return tuple(rules)


def is_spec(x: object) -> bool:
    """True for a spec leaf: a tuple of str/None (tuples are pytree nodes otherwise)."""
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def _axes_tuple(axes: str | Sequence[str] | None) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def _check_rules(rules: Rules, mesh_axes: Iterable[str] | None) -> None:
    known = set(mesh_axes) if mesh_axes is not None else None
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(f"rules[{i}] = {rule!r}: each rule is a (logical_name, mesh_axes) pair")
        for a in _axes_tuple(rule[1]):
            if known is not None and a not in known:
                raise ValueError(
                    f"rules[{i}] = {rule!r} names mesh axis {a!r}, which the mesh does not have; "
                    f"the mesh axes are {sorted(known)}"
                )


def logical_to_mesh_axes(spec: Spec, rules: Rules, *, mesh_axes: Iterable[str] | None = None) -> tuple[tuple[str, ...], ...]:
    """Resolve a spec to the mesh axes of each dim with flax precedence (see the module docstring).

    >>> logical_to_mesh_axes(("mlp", "mlp"), (("mlp", "tp"), ("embed", "dp_shard"), ("mlp", "dp_shard")))
    (('tp',), ('dp_shard',))
    """
    _check_rules(rules, mesh_axes)
    used: set[str] = set()
    out = []
    for name in spec:
        chosen: tuple[str, ...] = ()
        if name is not None:
            for rule_name, axes in rules:
                axes_t = _axes_tuple(axes)
                if rule_name == name and axes_t and not used.intersection(axes_t):
                    chosen = axes_t
                    break
        used.update(chosen)
        out.append(chosen)
    return tuple(out)


def spec_placements(spec: Spec, rules: Rules, mesh: DeviceMesh, *, name: str = "tensor", ndim: int | None = None) -> tuple[Placement, ...]:
    """The storage placements (one per mesh dim) of a tensor with logical ``spec`` on ``mesh``.

    Args:
        name: the dotted key path, used in errors.
        ndim: the tensor's rank; a spec of another length is an error naming ``name``.
    """
    if not is_spec(spec):
        raise TypeError(f"{name}: a spec is a tuple of logical names (str or None), got {spec!r}")
    if ndim is not None and len(spec) != ndim:
        raise ValueError(
            f"{name}: spec {spec!r} names {len(spec)} dims but the tensor has {ndim}; give one logical name "
            f"(or None) per dim"
        )
    mesh_names = tuple(mesh.mesh_dim_names or ())
    dims_axes = logical_to_mesh_axes(spec, rules, mesh_axes=mesh_names)
    placements: list[Placement] = []
    for mi, axis in enumerate(mesh_names):
        tensor_dim = next((d for d, axes in enumerate(dims_axes) if axis in axes), None)
        if tensor_dim is None or mesh.size(mi) == 1:
            placements.append(Replicate())
        else:
            placements.append(Shard(tensor_dim))
    return tuple(placements)


def compute_placements(placements: Sequence[Placement], mesh: DeviceMesh, gathered_axes: Iterable[str]) -> tuple[Placement, ...]:
    """Storage placements with the ``gathered_axes`` (the data-parallel axes for FSDP) set to Replicate.

    Keeping storage (sharded) and compute (gathered) placements apart is how FSDP is expressed: the same
    param is Shard on dp_shard at rest and Replicate on dp_shard while a block computes with it.
    """
    gathered = set(gathered_axes)
    names = tuple(mesh.mesh_dim_names or ())
    return tuple(Replicate() if names[i] in gathered else p for i, p in enumerate(placements))
