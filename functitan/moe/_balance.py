"""Auxiliary-loss-free balancing (arXiv 2408.15664; DeepSeek-V3 §2.1.2): a per-expert bias moves the choice, and
after each step it moves by ``rate * sign(mean load - load)`` (centred over the experts, as torchtitan's
``load_balance_coeff`` update), from the load the step observed.

The load travels as the bias's gradient. The choice (top-k) has no gradient, so the layer gives the bias one of
its own: each expert's assignments in this forward (``count_load``). The step's own reductions then count
every routed token once, wherever it was routed: over microbatches (``accumulate``, the pipeline executor),
data-parallel, context-parallel and expert-parallel ranks (FSDP / DDP), the sequence pieces of sequence
parallelism (``Layout.param``'s tp sum), each layer's bias its own layer's, each pipeline stage its own layers;
a recomputed block counts once (only its backward emits). Every one of those reductions is a sum or a positive
scale (the step's ``1 / tokens``, a mean over ranks or microbatches), which the sign does not see. The step then
takes the bias leaves out of the optimizer, the gradient norm and clipping (``LoadBalance``).

Loads within ``TIE`` (relative) of the mean count as balanced: the sums above are exact integers only up to
their scale's rounding, and a tie must not flip sign with the layout. Under ``param_dtype=bfloat16`` a forward's
load is carried in the bias's compute dtype before the fp32 reduction: exact up to 256 assignments per expert
and microbatch on a rank, within 0.4% above, so an expert that close to the mean may move either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import _dtensor as _dt
from .._autograd import hand_grad
from ..errors import UserError
from ..model import Param, zeros
from ..tree import flatten_with_names
from ._routing import Router

__all__ = ["BIAS", "TIE", "bias_param", "count_load", "LoadBalance"]

BIAS = "expert_bias"  # the logical name of a balancing bias's one dim: how the trainer finds the leaves
TIE = 1e-5  # |mean - load| / mean below this: balanced (no move)


def bias_param(router: Router) -> Param:
    """The balancing bias of a layer routed by ``router``: ``(experts,)`` zeros, replicated (every rank routes its
    tokens over every expert), updated by the step's balance rule rather than the optimizer."""
    return Param((router.experts,), (BIAS,), zeros())


def count_load(out: Tensor, bias: Tensor, load: Tensor) -> Tensor:
    """``out`` unchanged; in backward, ``bias (experts,)`` gets ``load (experts,)``: this forward's assignments per
    expert. Outside autograd (evaluation, generation) nothing is recorded."""
    return hand_grad(out, bias, load)


def _move(load: Tensor, rate: float) -> Tensor:
    """``rate * sign(mean - load)`` centred over the experts, ties within ``TIE`` of the mean at 0; no tokens: 0."""
    load = load.float()
    mean = load.mean()
    rel = (mean - load) / mean.clamp_min(torch.finfo(torch.float32).tiny)
    step = torch.where(rel.abs() > TIE, rel.sign(), 0.0) * rate
    return torch.where(mean > 0, step - step.mean(), 0.0)


@dataclass(frozen=True)
class LoadBalance:
    """Which leaves of a params tree are balancing biases (by dotted name: a pipeline stage's sub-tree has the same
    names), and their update speed ``rate`` (0: kept as they are; DeepSeek-V3: 1e-3, then 0 for its last tokens).

    ``make_train_step(..., balance=LoadBalance.from_specs(specs(decl), rate))`` (the trainer does it).
    """

    names: frozenset[str]
    rate: float = 1e-3

    @classmethod
    def from_specs(cls, specs: Any, rate: float) -> LoadBalance | None:
        """The leaves whose spec is ``(BIAS,)``; None when there are none (a dense model)."""
        from .._rules import is_spec

        names = frozenset(n for n, s in flatten_with_names(specs, is_leaf=is_spec)[0] if tuple(s) == (BIAS,))
        return cls(names, rate) if names else None

    def take(self, grads: Any, params: Any) -> dict[str, Tensor]:
        """``{name: the bias after this step}`` from the loads in ``grads``, whose bias leaves are then zeroed (the
        optimizer and the gradient norm see none). Call before the optimizer changes anything."""
        out: dict[str, Tensor] = {}
        now = dict(flatten_with_names(params)[0])
        for name, g in flatten_with_names(grads)[0]:
            if name not in self.names or g is None:
                continue
            s = _dt.spec(g)
            if s is not None and not all(p.is_replicate() for p in s.placements):
                raise UserError(
                    f"param {name!r} (a MoE balancing bias, logical name {BIAS!r}) is sharded ({s.placements}); "
                    f"its update needs every expert's load: map {BIAS!r} to no mesh axis in the rules"
                )
            with torch.no_grad():
                load = _dt.local(g)
                bias = now[name]
                new = _dt.local(bias).float() + _move(load, self.rate)
                out[name] = _dt.wrap(new.to(bias.dtype), _dt.spec(bias), requires_grad=bias.requires_grad)
                load.zero_()
        return out

    def put(self, params: Any, new: Mapping[str, Tensor]) -> Any:
        """``params`` with the biases ``take`` computed in place of whatever the optimizer made of them."""
        if not new:
            return params
        named, treedef = flatten_with_names(params)
        return treedef.unflatten([new.get(n, leaf) for n, leaf in named])
