"""The declaration of one MoE layer's parameters: each matrix once, with its logical names."""

from __future__ import annotations

from typing import Any

from ..model import Param
from ._balance import bias_param
from ._routing import Router

__all__ = ["expert_params"]


def expert_params(
    *, dim: int, ffn: int, router: Router, init: Any, shared_ffn: int = 0, bias: bool = False
) -> dict[str, Any]:
    """``{"router", "experts"[, "shared"][, "bias"]}`` of a MoE layer over ``dim``-wide tokens, each routed expert
    a SwiGLU of width ``ffn``; ``shared_ffn > 0`` adds the shared experts as one SwiGLU of that width; ``bias``
    the auxiliary-loss-free balancing bias (``bias_param``: updated from the load after each step, not by the
    optimizer).

    Names: the router's rows are ``router`` (every rank scores every expert); routed matrices lead with
    ``experts`` (as the optimizers name a stack of matrices; expert parallelism shards it) and keep their width
    as ``expert_mlp`` (no expert tensor parallelism: a fine-grained expert is too narrow to split); the shared
    SwiGLU is an MLP like any other (``mlp``: tensor parallel).
    """
    e = router.experts
    tree: dict[str, Any] = {
        "router": {"weight": Param((e, dim), ("router", "embed"), init)},
        "experts": {
            "w_gate": Param((e, ffn, dim), ("experts", "expert_mlp", "embed"), init),
            "w_up": Param((e, ffn, dim), ("experts", "expert_mlp", "embed"), init),
            "w_down": Param((e, dim, ffn), ("experts", "embed", "expert_mlp"), init),
        },
    }
    if shared_ffn:
        tree["shared"] = {
            "w_gate": Param((shared_ffn, dim), ("mlp", "embed"), init),
            "w_up": Param((shared_ffn, dim), ("mlp", "embed"), init),
            "w_down": Param((dim, shared_ffn), ("embed", "mlp"), init),
        }
    if bias:
        tree["bias"] = bias_param(router)
    return tree
