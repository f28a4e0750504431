"""The MoE layer on local tensors: route, dispatch dropless, grouped GEMM per expert, combine; shared experts.

Dispatch sorts the ``tokens x top_k`` assignments by expert (stable, so a token's slots keep their order), runs
every expert's SwiGLU on its rows with one ``torch._grouped_mm`` per matrix (the offsets are the cumulative
rows per expert; no capacity, no padding, no token dropped), scales each row by its routing weight and adds
the rows back into their tokens (``index_add``). An expert no token chose contributes an empty group and a
zero gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._loss import TokenLoss
from .._valueless import valueless
from ._balance import count_load
from ._dispatch import ExpertParallel
from ._routing import Router, balance_per_token, route

__all__ = ["moe", "grouped_mm", "routed_experts"]


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """``x (rows, in)`` sorted by group, ``w (groups, out, in)``, ``counts (groups,)`` rows per group ->
    ``(rows, out)``: row r of group g is ``x[r] @ w[g].T``.

    ``torch._grouped_mm`` where its kernel takes the operands (rows of a multiple of 16 bytes; on CUDA bf16
    only); else one matmul per group (what a dtype or width the kernel refuses needs). On tensors without data (the name check's meta
    tensors, the planner's fake ones), whose grouped-GEMM rule is CUDA's (bf16 only), one group's matmul stands
    in: the same output, saved operands and gradient shapes."""
    if valueless(x):
        return x @ w.select(0, 0).T
    itemsize = x.dtype.itemsize
    aligned = (x.shape[1] * itemsize) % 16 == 0 and (w.shape[1] * itemsize) % 16 == 0
    if aligned and x.dtype == w.dtype and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    parts = torch.split(x, counts.tolist())
    return torch.cat([part @ w[g].T for g, part in enumerate(parts)]) if parts else x.new_zeros(0, w.shape[1])


def routed_experts(
    x: Tensor, experts: Tensor, weights: Tensor, p: dict[str, Tensor], ep: ExpertParallel | None = None
) -> Tensor:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` for ``x (tokens, embed)``, ``experts`` and
    ``weights (tokens, k)``; ``p``: ``w_gate``, ``w_up (experts, expert_mlp, embed)``, ``w_down (experts, embed,
    expert_mlp)``, this rank's ``experts / ep`` of them under expert parallelism (``ep``). Dropless: every
    assignment is computed. Where tp is in the experts' group without sequence parallelism, its ranks hold the
    same tokens: each sends only its share (``ExpertParallel.share``), so no token is computed twice."""
    if ep is not None and ep.replicas is not None:  # tp ranks hold the same tokens: each routes its share
        mine = dataclasses.replace(ep, replicas=None)
        return ep.whole(routed_experts(ep.share(x), ep.share(experts), ep.share(weights), p, mine), x.shape[0])
    n_experts = p["w_gate"].shape[0] * (ep.size if ep is not None else 1)
    k = experts.shape[1]
    flat = experts.reshape(-1)  # (tokens * k,)
    order = flat.argsort(stable=True)
    token = order // k  # the token of each sorted row
    counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))

    def swiglu(rows: Tensor, per_expert: Tensor) -> Tensor:  # rows grouped by (local) expert
        h = F.silu(grouped_mm(rows, p["w_gate"], per_expert)) * grouped_mm(rows, p["w_up"], per_expert)
        return grouped_mm(h, p["w_down"], per_expert)

    out = swiglu(x[token], counts) if ep is None else ep.routed(x, token, counts, swiglu)
    out = out * weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
    return x.new_zeros(x.shape).index_add(0, token, out)


def _shared(p: dict[str, Tensor], x: Tensor, layout: Any) -> Tensor:
    """The shared experts: one dense SwiGLU every token goes through (tensor parallel like any MLP)."""
    gate, up = layout.einsums(
        x,
        [
            ("batch seq embed, mlp embed -> batch seq mlp", p["w_gate"]),
            ("batch seq embed, mlp embed -> batch seq mlp", p["w_up"]),
        ],
    )
    return layout.einsum("batch seq mlp, embed mlp -> batch seq embed", F.silu(gate) * up, p["w_down"])


def moe(x: Tensor, p: dict[str, Any], router: Router, layout: Any) -> tuple[Tensor, dict[str, Any]]:
    """The MoE layer: ``x (batch, seq piece, embed)`` in the residual layout -> ``(out, aux)``.

    ``p``: ``router.weight (experts, embed)``; ``experts.{w_gate, w_up, w_down}`` (``routed_experts``);
    optionally ``bias (experts,)`` (the choice's balancing bias, whose gradient is this forward's load per
    expert: ``functitan.moe._balance``) and ``shared.{w_gate, w_up, w_down}``.

    ``aux`` (``Layout.blocks`` adds it over blocks; the model's loss uses it):

    - ``load``: ``TokenLoss(assignments per expert (experts,), assignments)``: the share of this rank's
      routed slots each expert got; the step adds both over ranks and microbatches, so the reported share is
      the step's.
    - ``balance`` (with ``router.balance > 0``): ``(batch,)`` each sequence's balance loss
      ``balance * sum_i f_i P_i`` over its whole length (summed over the sequence's pieces under sequence and
      context parallelism, so every rank holding a piece holds the whole value, and each token's gradient is
      counted once).
    """
    b, s, d = x.shape
    logits = layout.einsum("batch seq embed, router embed -> batch seq router", x, p["router"]["weight"])
    weights, experts, scores = route(logits.flatten(0, 1), router, p.get("bias"))
    out = routed_experts(x.flatten(0, 1), experts, weights, p["experts"], layout.expert_parallel).view(b, s, d)
    if "shared" in p:
        out = out + _shared(p["shared"], x, layout)
    with torch.no_grad():
        hits = torch.zeros_like(scores).scatter_(1, experts, 1.0)  # (tokens, experts): 1 where routed
        load = hits.sum(0)  # (experts,) this forward's assignments per expert
        aux: dict[str, Any] = {"load": TokenLoss(load, hits.new_full((), float(hits.shape[0] * router.top_k)))}
    if "bias" in p:  # the balancing bias's gradient is the load (functitan.moe._balance)
        out = count_load(out, p["bias"], load)
    if router.balance:
        whole = s * layout.seq_shards  # the sequence's length: this piece is one of seq_shards
        with torch.no_grad():  # f_i of each sequence, from its whole length
            share = layout.token_sum(hits.view(b, s, -1), per_sequence=True) * (router.experts / (router.top_k * whole))
        per_token = balance_per_token(scores.view(b, s, -1), share)
        aux["balance"] = layout.token_sum(per_token, per_sequence=True) * (router.balance / whole)
    return out, aux
