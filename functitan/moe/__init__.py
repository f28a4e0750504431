"""Mixture of experts: a router, dropless routed experts on grouped GEMM, shared experts, balance terms.

A model calls the layer through its Layout, as it calls ``einsum`` and ``attention``, so that a parallelism
that moves experts between ranks changes how it runs, not the model::

    from functitan.moe import Router, expert_params

    ROUTER = Router(experts=8, top_k=2, norm_topk=True)
    params = {"moe": expert_params(dim=64, ffn=32, router=ROUTER, init=normal(0.02))}
    out, aux = layout.moe(x, p["moe"], ROUTER)   # x (batch, seq piece, embed); Layout.blocks adds aux over blocks

Routed expert weights are one ``Param`` per matrix with a leading ``experts`` dim (``(experts, expert_mlp,
embed)``); ``aux`` carries each expert's share of the routed tokens and, with ``Router(balance=...)``, the
sequence-wise balance loss per sequence (docs/moe.md). ``expert_params(..., bias=True)`` adds the
auxiliary-loss-free balancing bias: the step moves it from the observed load (``LoadBalance``), not the optimizer.
"""

from ._balance import BIAS, LoadBalance, bias_param, count_load
from ._layer import grouped_mm, moe, routed_experts
from ._params import expert_params
from ._routing import Router, balance_per_token, route

__all__ = [
    "Router",
    "route",
    "balance_per_token",
    "moe",
    "routed_experts",
    "grouped_mm",
    "expert_params",
    "BIAS",
    "LoadBalance",
    "bias_param",
    "count_load",
]
