"""One declaration per parameter: shape, logical axis names and initializer together.

A model declares its parameters once, as a tree of ``Param`` leaves mirroring the tree ``init`` returns::

    def params(cfg):
        return {"wte": Param((cfg.vocab_size, cfg.dim), ("vocab", "embed"), normal(0.02)),
                "ln_f": {"weight": Param((cfg.dim,), ("embed",), ones()), "bias": Param((cfg.dim,), ("embed",), zeros())}}

Everything else derives from that tree: ``init`` (the values), ``specs`` (the logical names the rules table
maps onto mesh axes), ``shapes``, ``count`` and meta-device init, and the name check of every contraction
(``functitan.model.check_names``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..random import PRNGKey, fold_in, generator
from ..tree import flatten_with_names, map_with_names

__all__ = [
    "Param",
    "normal",
    "zeros",
    "ones",
    "constant",
    "uniform",
    "is_param",
    "init",
    "specs",
    "shapes",
    "count",
    "expert_count",
]


@dataclass(frozen=True)
class normal:  # noqa: N801 - an initializer reads like the function optax/flax users know
    """Gaussian ``N(mean, std^2)``, drawn in fp32 on the CPU (bit-identical on every device and mesh)."""

    std: float = 0.02
    mean: float = 0.0

    def __call__(self, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
        x = torch.randn(shape, generator=gen, dtype=torch.float32) * self.std
        return x + self.mean if self.mean else x


@dataclass(frozen=True)
class uniform:  # noqa: N801
    """Uniform on ``[low, high)``."""

    low: float = -1.0
    high: float = 1.0

    def __call__(self, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (self.high - self.low) + self.low


@dataclass(frozen=True)
class constant:  # noqa: N801
    """Every element ``value`` (norm weights: ``ones()``, biases: ``zeros()``)."""

    value: float = 0.0

    def __call__(self, shape: tuple[int, ...], gen: torch.Generator | None = None) -> Tensor:
        return torch.full(shape, self.value, dtype=torch.float32)


def zeros() -> constant:
    return constant(0.0)


def ones() -> constant:
    return constant(1.0)


Initializer = Callable[[tuple[int, ...], torch.Generator], Tensor]


@dataclass(frozen=True)
class Param:
    """A parameter's declaration: ``shape``, one logical axis name per dim, and its initializer.

    ``names`` are what the rules table maps to mesh axes (``("heads", "embed")``: FSDP shards ``embed`` over
    ``dp_shard`` and TP shards ``heads`` over ``tp`` with the default rules), and what every contraction with
    this parameter must call its dims (checked by ``functitan.model.check_names``).
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]
    init: Initializer = normal(0.02)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "names", tuple(self.names))
        if len(self.shape) != len(self.names):
            raise ValueError(
                f"Param shape {self.shape} has {len(self.shape)} dims but names {self.names} has "
                f"{len(self.names)}; give one logical name per dim"
            )
        if any(s <= 0 for s in self.shape):
            raise ValueError(f"Param shape {self.shape} (names {self.names}) has a non-positive dim")
        if not all(isinstance(n, str) and n for n in self.names):
            raise TypeError(f"Param names {self.names!r} must be non-empty strings, one per dim")


def is_param(x: object) -> bool:
    return isinstance(x, Param)


def _declared(name: str, p: Any) -> Param:
    """``p``, a leaf of a declaration tree, checked: a tensor or a number there is the usual slip."""
    if not isinstance(p, Param):
        raise TypeError(
            f"declaration leaf {name!r} is a {type(p).__name__}, not a functitan.model.Param: a model's params(cfg) "
            f"declares each parameter as Param(shape, names, init), e.g. Param((vocab, dim), ('vocab', 'embed'), "
            f"normal(0.02)); init(decl, key) makes the tensors"
        )
    return p


def init(decl: Any, key: PRNGKey, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """Fresh values for a declaration tree. Each leaf is drawn on the CPU from ``fold_in(key, its dotted
    name)``, so values are bit-identical whatever the device, mesh or creation order; on ``device="meta"``
    nothing is allocated (a 405B model is planned this way)."""
    device = torch.device(device)

    def one(name: str, p: Param) -> Tensor:
        p = _declared(name, p)
        if device.type == "meta":
            return torch.empty(p.shape, device=device, dtype=dtype)
        if isinstance(p.init, constant):
            return torch.full(p.shape, p.init.value, dtype=dtype, device=device)
        return p.init(p.shape, generator(fold_in(key, name))).to(device=device, dtype=dtype)

    return map_with_names(one, decl, is_leaf=is_param)


def specs(decl: Any) -> Any:
    """The spec tree (logical names per dim) of a declaration tree, for ``sharding.place`` and the planner."""
    return map_with_names(lambda name, p: _declared(name, p).names, decl, is_leaf=is_param)


def shapes(decl: Any) -> Any:
    """The shape tree of a declaration tree (or of a tree of tensors)."""
    return map_with_names(lambda name, p: _shape(name, p), decl, is_leaf=is_param)


def count(decl: Any, *, exclude: Callable[[str, Param], bool] | None = None) -> int:
    """Number of parameters of a declaration tree (or of a tree of tensors), leaving out the leaves
    ``exclude(name, param)`` picks (e.g. embedding tables)."""
    named, _ = flatten_with_names(decl, is_leaf=is_param)
    return sum(math.prod(_shape(name, p)) for name, p in named if exclude is None or not exclude(name, p))


def expert_count(decl: Any) -> int:
    """The routed experts of a declaration's MoE layers (the size of the first ``experts`` dim), 0 for a dense
    one: what expert parallelism splits, and the mark of blocks that return aux outputs."""
    for _, p in flatten_with_names(decl, is_leaf=is_param)[0]:
        if "experts" in p.names:
            return p.shape[p.names.index("experts")]
    return 0


def _shape(name: str, p: Any) -> tuple[int, ...]:
    return tuple(p.shape) if isinstance(p, Tensor) else _declared(name, p).shape
