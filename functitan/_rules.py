"""Logical axis names -> mesh axes -> DTensor placements. One ordered rules table decides everything.

A *spec* is a tuple with one logical name (or None) per tensor dim, e.g. ``("heads", "embed")`` for a
``[n_heads * head_dim, dim]`` projection. A *rules table* is an ordered tuple of ``(logical_name, mesh_axes)``
pairs; ``mesh_axes`` is one mesh axis name, a tuple of them, or None (replicate).

Precedence (exactly flax's ``logical_to_mesh_axes``): the RULES are applied in order, so an earlier rule
wins. Each rule looks at the first dim carrying its logical name; it assigns its mesh axes there when that
dim has none yet and none of the axes is used by another dim of the same tensor. A dim that no rule assigned
is replicated.

Worked example, rules ``(("mlp", "tp"), ("embed", "tp"), ("embed", "dp_shard"))``:

- ``w_down`` with spec ``("embed", "mlp")``: rule 1 gives dim 1 ``tp``; rule 2 would give dim 0 ``tp``, which
  is taken; rule 3 gives dim 0 ``dp_shard``. Result ``(("dp_shard",), ("tp",))``: row-parallel plus FSDP, not
  ``(("tp",), ())`` as a left-to-right scan of the dims would give.
- ``w_norm`` with spec ``("embed",)``: rule 2 gives dim 0 ``tp``.
- ``w_sq`` with spec ``("mlp", "mlp")``: rule 1 gives dim 0 ``tp``; no rule reaches dim 1 (a rule looks at
  the first dim of its name only), so it is replicated: ``(("tp",), ())``.

A mesh axis of size 1 yields ``Replicate()``, so one table serves every layout: with ``tp=1`` the "tp"
rules shard nothing, and FSDP, HSDP, TP and their products are chosen by the mesh degrees alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = [
    "Rules",
    "Spec",
    "default_rules",
    "logical_to_mesh_axes",
    "spec_placements",
    "is_spec",
]

Spec = tuple  # tuple[str | None, ...]
Rules = tuple  # tuple[tuple[str, str | tuple[str, ...] | None], ...]


def default_rules(*, sequence_parallel: bool = False) -> Rules:
    """The rules table for transformer models (Llama and friends).

    Params: vocab, heads, kv_heads and mlp go to ``tp`` (Megatron: column-parallel q/k/v/gate/up and the
    vocab-parallel embedding and head, row-parallel o/down); the ``embed`` dim goes to ``dp_shard`` and ``cp``
    (FSDP over both, torchtitan's ``fsdp = dp_shard * cp``: a cp rank keeps no extra copy of the params);
    a MoE layer's ``experts`` go to ``ep`` (expert parallelism borrows its ranks from dp_shard). ``embed`` lists
    ``ep`` with the FSDP axes, so a dense param is sharded over the whole dp_shard degree as without ep; a routed
    expert's ``embed`` falls to the next rule, FSDP over what ep left (torchtitan's efsdp), since its ``experts``
    dim took ``ep``. ``layers`` goes to ``pp``. Activations: ``batch`` goes to both data-parallel axes, and with sequence
    parallelism the residual stream's ``seq`` goes to ``tp``.
    """
    rules: list[tuple[str, str | tuple[str, ...] | None]] = [
        ("batch", ("dp_replicate", "dp_shard")),
        ("vocab", "tp"),
        ("heads", "tp"),
        ("kv_heads", "tp"),
        ("mlp", "tp"),
        ("experts", "ep"),
        ("embed", ("dp_shard", "ep", "cp")),  # a dense param: FSDP over the whole dp_shard degree and cp
        ("embed", ("dp_shard", "cp")),  # a routed expert's (ep taken by its experts dim): FSDP over the rest
        ("q_lora", ("dp_shard", "ep", "cp")),  # multi-head latent attention's latents (DeepSeek-V3), as embed
        ("kv_lora", ("dp_shard", "ep", "cp")),
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


def logical_to_mesh_axes(
    spec: Spec, rules: Rules, *, mesh_axes: Iterable[str] | None = None
) -> tuple[tuple[str, ...], ...]:
    """Resolve a spec to the mesh axes of each dim with flax precedence (see the module docstring).

    >>> logical_to_mesh_axes(("embed", "mlp"), (("mlp", "tp"), ("embed", "tp"), ("embed", "dp_shard")))
    (('dp_shard',), ('tp',))
    """
    _check_rules(rules, mesh_axes)
    out: list[tuple[str, ...] | None] = [None] * len(spec)
    used: set[str] = set()
    for rule_name, axes in rules:
        axes_t = _axes_tuple(axes)
        if not axes_t or rule_name not in spec:
            continue
        pos = spec.index(rule_name)
        if out[pos] is None and not used.intersection(axes_t):
            out[pos] = axes_t
            used.update(axes_t)
    return tuple(a if a is not None else () for a in out)


def spec_placements(
    spec: Spec,
    rules: Rules,
    mesh: DeviceMesh,
    *,
    name: str = "tensor",
    ndim: int | None = None,
    shape: Sequence[int] | None = None,
) -> tuple[Placement, ...]:
    """The storage placements (one per mesh dim) of a tensor with logical ``spec`` on ``mesh``.

    Args:
        name: the dotted key path, used in errors.
        ndim: the tensor's rank; a spec of another length is an error naming ``name``.
        shape: the tensor's shape. A dim the rules split over several mesh axes (``embed`` over dp_shard and
            cp) is split over the first of them only when its size does not divide by their product: DTensor
            reassembles (``full_tensor``, ``redistribute``) unequal pieces of a dim split twice out of order.
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
    if shape is not None:
        sizes = {a: mesh.size(mi) for mi, a in enumerate(mesh_names)}
        dims_axes = tuple(_dividing(axes, size, sizes) for axes, size in zip(dims_axes, shape, strict=True))
    placements: list[Placement] = []
    for mi, axis in enumerate(mesh_names):
        tensor_dim = next((d for d, axes in enumerate(dims_axes) if axis in axes), None)
        if tensor_dim is None or mesh.size(mi) == 1:
            placements.append(Replicate())
        else:
            placements.append(Shard(tensor_dim))
    return tuple(placements)


def _dividing(axes: tuple[str, ...], size: int, sizes: dict[str, int]) -> tuple[str, ...]:
    """``axes`` (of size > 1), or its first one alone when ``size`` does not divide by their product."""
    split = tuple(a for a in axes if sizes.get(a, 1) > 1)
    if len(split) > 1 and size % math.prod(sizes[a] for a in split):
        return split[:1]
    return axes
