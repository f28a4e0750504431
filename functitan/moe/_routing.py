"""Routing: which experts each token goes to, with what weight, and the sequence-wise balance term.

Two families in one ``Router``:

- Qwen3-MoE / Mixtral (``score="softmax"``): a softmax over every expert, the top-k of it, optionally
  renormalised to sum to 1 (``norm_topk``).
- DeepSeek-V3 (``score="sigmoid"``): a sigmoid per expert; the choice adds a per-expert ``bias`` (the
  auxiliary-loss-free balancing bias, arXiv 2408.15664) and is group-limited (the ``n_group`` groups of
  experts ranked by the sum of their two best scores, the best ``topk_group`` kept, arXiv 2412.19437 §2.1.2);
  the weights are the unbiased scores of the chosen experts, renormalised and scaled by ``scale``.

The choice (top-k, groups, bias) has no gradient; the weights carry the router's gradient, as in both papers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._choices import MOE_SCORES

__all__ = ["Router", "route", "balance_per_token"]


@dataclass(frozen=True, kw_only=True)
class Router:
    """How tokens are routed to ``experts`` routed experts.

    Args:
        experts: routed experts (shared experts are not routed).
        top_k: experts per token.
        score: "softmax" (Qwen3-MoE, Mixtral) or "sigmoid" (DeepSeek-V3).
        norm_topk: renormalise the chosen weights to sum to 1 (HF's ``norm_topk_prob``).
        n_group, topk_group: group-limited routing: experts in ``n_group`` equal groups, a token's experts
            chosen from its ``topk_group`` best groups (DeepSeek-V3: 8 and 4); 1 and 1 is plain top-k.
        scale: the routed output's factor (DeepSeek-V3's ``routed_scaling_factor``, 2.5).
        balance: the sequence-wise balance loss's coefficient (DeepSeek-V3's alpha, 1e-4; 0: none).
    """

    experts: int
    top_k: int
    score: str = "softmax"
    norm_topk: bool = False
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0
    balance: float = 0.0

    def __post_init__(self) -> None:
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"router: top_k={self.top_k} must be in 1..experts ({self.experts})")
        if self.score not in MOE_SCORES:
            raise ValueError(f"router: score={self.score!r}; choose one of {MOE_SCORES}")
        if self.experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"router: n_group={self.n_group} must divide experts={self.experts} and topk_group={self.topk_group} "
                f"be in 1..n_group"
            )
        if self.n_group > 1 and self.top_k > self.topk_group * (self.experts // self.n_group):
            raise ValueError(
                f"router: top_k={self.top_k} experts cannot come from topk_group={self.topk_group} groups of "
                f"{self.experts // self.n_group}"
            )
        if self.balance < 0:
            raise ValueError(f"router: balance={self.balance} must be >= 0")


def route(logits: Tensor, router: Router, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(weights (tokens, k) fp32, experts (tokens, k) int64, scores (tokens, experts) fp32)`` for router
    ``logits (tokens, experts)``. ``scores`` are the per-expert affinities the balance term uses (softmax
    probabilities; sigmoid scores). ``bias (experts,)`` shifts the choice only."""
    z = logits.float()
    scores = z.softmax(-1) if router.score == "softmax" else z.sigmoid()
    with torch.no_grad():
        choice = scores if bias is None else scores + bias.float()
        if router.n_group > 1:
            t = choice.shape[0]
            grouped = choice.view(t, router.n_group, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (tokens, n_group)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(router.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)
        experts = choice.topk(router.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if router.norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if router.score == "sigmoid" else 0.0))
    if router.scale != 1.0:
        weights = weights * router.scale
    return weights, experts, scores


def balance_per_token(scores: Tensor, share: Tensor) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss, per token: ``sum_i f_i * s'_{t,i}``, where ``s'`` are the
    scores normalised per token and ``f_i = experts / (k * T) * (tokens of the sequence routed to i)`` is given
    (``share``, detached) by the caller. Its mean over a sequence's tokens is ``sum_i f_i P_i``.

    ``scores (batch, seq, experts)``, ``share (batch, experts)`` -> ``(batch, seq)``."""
    normed = scores / scores.sum(-1, keepdim=True)
    return (normed * share.unsqueeze(1)).sum(-1)
