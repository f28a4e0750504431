"""Train an existing ``nn.Module`` functionally: ``(apply, params, specs)`` from the module.

``from_module(module, rules)`` copies the module's parameters into a flat tree ``{dotted name: tensor}``,
names each parameter's dims by the first regex rule that matches its name (flax / MaxText's logical
partitioning by rules on names), and returns ``apply(params, *args, layout=...)``, which runs the module's own
``forward`` on those params through ``torch.func.functional_call``. Place the params with
``functitan.sharding.place(params, specs, ...)`` and train them like any functitan model::

    apply, params, specs = from_module(model, [(r"embed_tokens\\.weight$", ("vocab", "embed")),
                                               (r"_proj\\.weight$", (None, "embed")), (r"norm\\.weight$", ("embed",))])
    params = place(params, specs, rules, mesh)                      # FSDP / DDP storage placements
    loss = lambda p, b: cross_entropy(apply(p, b["inputs"], layout=layout).logits, b["targets"])

``apply`` hands the module the *local compute tensors* ``layout.params`` gathers (FSDP all-gathers in
forward, reduce-scatters in backward), never DTensors: the module's ops would otherwise meet a DTensor
weight and a plain activation ("mixed torch.Tensor and DTensor"). Data parallelism (DDP, FSDP, HSDP) works
for any module. Tensor parallelism does not: the module's own ``F.linear`` cannot split heads or insert the
collectives, so a layout that maps a parameter dim to ``tp`` is refused with ``TensorParallelBridgeError``;
write the model with ``layout.einsum`` (as ``models/llama.py`` does) for TP.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._rules import Spec, logical_to_mesh_axes
from .errors import UserError
from .sharding import Layout

__all__ = ["from_module", "specs_from_rules", "TensorParallelBridgeError"]

_ONE_DEVICE = Layout()
NameRules = Sequence[tuple[str, Spec]]  # (regex searched in the dotted parameter name, logical spec)


class TensorParallelBridgeError(UserError):
    """A layout would split a bridged module's parameter over ``tp``, which functional_call cannot compute."""


def specs_from_rules(named: Mapping[str, Tensor], rules: NameRules) -> dict[str, Spec]:
    """The spec of each parameter: the first rule whose regex is found in its name (``re.search``).

    A parameter no rule matches, or a spec whose length is not the parameter's ndim, is an error naming it.

    >>> specs_from_rules({"lm_head.weight": torch.zeros(8, 4)}, [(r"lm_head", ("vocab", "embed"))])
    {'lm_head.weight': ('vocab', 'embed')}
    """
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]
    out: dict[str, Spec] = {}
    for name, p in named.items():
        spec = next((s for rx, s in compiled if rx.search(name)), None)
        if spec is None:
            raise ValueError(
                f"no rule matches the parameter {name!r} of shape {tuple(p.shape)}; add a (regex, spec) rule for it, "
                f"e.g. ({re.escape(name.rsplit('.', 1)[0])!r}, {tuple([None] * p.ndim)}) to replicate it"
            )
        if len(spec) != p.ndim:
            raise ValueError(
                f"the rule for {name!r} gives the spec {spec} ({len(spec)} names) to a parameter of shape "
                f"{tuple(p.shape)}; give one logical name (or None) per dim"
            )
        out[name] = tuple(spec)
    return out


def _check_no_tp(specs: dict[str, Spec], layout: Layout) -> None:
    mesh = layout.mesh
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" not in names or mesh is None or mesh["tp"].size() == 1:
        return
    for name, spec in specs.items():
        axes = logical_to_mesh_axes(spec, layout.rules, mesh_axes=names)
        if any("tp" in a for a in axes):
            raise TensorParallelBridgeError(
                f"parameter {name!r} (spec {spec}) would be split over tp={mesh['tp'].size()}, but a bridged "
                f"nn.Module computes with its own layers (e.g. nn.Linear), which cannot run on a tensor-parallel "
                f"shard; use parallelism.tp=1 with dp_shard/dp_replicate, or write the model with layout.einsum"
            )


def from_module(
    module: nn.Module, rules: NameRules, *, dtype: torch.dtype | None = None
) -> tuple[Callable[..., Any], dict[str, Tensor], dict[str, Spec]]:
    """``(apply, params, specs)`` for ``module`` (see the module docstring).

    Args:
        module: the model; it is not modified (its params are copied, its buffers used as they are).
        rules: ``[(regex, spec), ...]``, first match wins; ``spec`` names each dim of the parameter.
        dtype: cast the copied params (e.g. ``torch.float32`` master weights).

    Returns:
        ``apply(params, *args, layout=Layout(), **kwargs)`` -> the module's output; ``params`` a flat dict of
        detached copies; ``specs`` the same keys with logical specs.
    """
    named = dict(module.named_parameters())
    specs = specs_from_rules(named, rules)
    params = {n: p.detach().clone().to(dtype or p.dtype) for n, p in named.items()}
    checked: set[int] = set()

    def apply(params: dict[str, Tensor], *args: Any, layout: Layout | None = None, **kwargs: Any) -> Any:
        layout = layout if layout is not None else _ONE_DEVICE
        if id(layout) not in checked:
            _check_no_tp(specs, layout)
            checked.add(id(layout))
        compute = layout.params(params)  # local tensors: FSDP gathered, DDP all-reduced in backward
        return functional_call(module, compute, args, kwargs, strict=False)

    return apply, params, specs
