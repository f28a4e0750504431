"""A model as pieces: ``embed``, ``block`` and ``head``; the library composes ``apply``, ``loss`` and the pipeline.

Every decoder the trainer runs has the same skeleton: gather the top-level params (embedding, final norm, head)
once, embed, run the blocks through ``layout.blocks``, apply the head, take the cross-entropy; and, for
pipeline parallelism, the same three pieces as a ``StageModel`` with the keys each reads and a forward cost per
token. A model that gives ``Model(pieces=Pieces(...))`` writes none of it; one that gives its own ``apply``,
``loss`` or ``stages`` keeps them (a model written against that interface runs unchanged).

The one rule for gathering: the pieces receive compute params, gathered by the library (``layout.params``):
the top level once per step in ``apply`` (FSDP2's root group, held to the end), a pipeline stage's share
leaf by leaf in that stage, and each block's inside its remat region (``layout.blocks``). (A stage's share
bucketed into one all-gather fails the planner's fake-process-group trace of pipelined layouts: "Could not
resolve the process group"; found when this module replaced GPT-2's and Qwen3's own stage code, which did
that, and not fixed yet.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import _remat
from .._loss import IGNORE_INDEX, TokenLoss
from ._param import expert_count, is_param

__all__ = ["Pieces", "composed"]


@dataclass(frozen=True, kw_only=True)
class Pieces:
    """The parts of a decoder that differ between families.

    Args:
        embed: ``(top, tokens, cfg, layout) -> x (batch, seq piece, dim)``: ``top`` the compute top-level params.
        block: ``(block_params, x, cfg, layout) -> x``: one block on compute params.
        head: ``(top, x, cfg, layout) -> logits (batch, seq, vocab)``.
        first_keys: ``cfg -> the top-level keys embed reads`` (``("embed",)``; GPT-2's ``("wte", "wpe")``).
        last_keys: ``cfg -> the top-level keys head reads`` (the tied embedding among them when tied).
        blocks_key: the key of the block list in the param tree.
        attention_dim: ``cfg -> heads * head_dim`` when that is not ``cfg.dim`` (Qwen3's head_dim), for the
            attention term of a block's cost.

    The config needs ``dim`` and ``vocab_size`` (the stage activations and costs are derived from them).
    """

    embed: Callable[..., Tensor]
    block: Callable[..., Tensor]
    head: Callable[..., Tensor]
    first_keys: Callable[[Any], tuple[str, ...]]
    last_keys: Callable[[Any], tuple[str, ...]]
    blocks_key: str = "layers"
    attention_dim: Callable[[Any], int] | None = None


def _default_layout() -> Any:
    from ..sharding import Layout  # the model package is imported by sharding's users, not the reverse

    return Layout()


def _matrix_params(tree: Any) -> int:
    """Elements of the 2-D (and larger) params of a declaration: what a forward multiplies per token."""
    import optree

    return sum(math.prod(p.shape) for p in optree.tree_leaves(tree, is_leaf=is_param) if len(p.shape) >= 2)


def _aux_terms(aux: dict[str, Any], targets: Tensor) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``(loss terms, metrics)`` of the blocks' aux: a per-sequence ``balance (batch,)`` is the term
    ``sum_b n_b balance_b`` (``n_b``: sequence b's valid targets in ``targets (batch, seq)``, the whole sequence);
    the rest (``load``) are metrics as they are."""
    metrics: dict[str, Any] = {k: v for k, v in aux.items() if k != "balance"}
    if "balance" not in aux:
        return {}, metrics
    tokens = (targets != IGNORE_INDEX).sum(1).float()  # (batch,)
    return {"balance": (aux["balance"] * tokens).sum()}, metrics


def _with_aux(ce: TokenLoss, aux: dict[str, Any], targets: Tensor) -> tuple[TokenLoss, dict[str, Any]]:
    """The loss and the metrics of blocks' aux: each term joins the cross-entropy's sum, and is reported as
    ``TokenLoss(term, the loss's tokens)`` under its key."""
    terms, metrics = _aux_terms(aux, targets)
    total = ce.sum
    for k, t in terms.items():
        metrics[k] = TokenLoss(t.detach(), ce.count)
        total = total + t
    return TokenLoss(total, ce.count), metrics


def composed(pieces: Pieces, declare: Callable[[Any], Any]) -> tuple[Callable, Callable, Callable]:
    """``(apply, loss, stages)`` for ``pieces``; ``declare`` is the model's ``params(cfg)`` (for the costs)."""
    key = pieces.blocks_key

    def forward(params: dict[str, Any], tokens: Tensor, cfg: Any, layout: Any) -> tuple[Tensor, Any]:
        """``(logits (batch, seq, vocab), the blocks' aux or None)`` for ``tokens (batch, seq)``."""
        top = layout.params({k: v for k, v in params.items() if k != key})  # gathered once, held to the end
        x = layout.blocks(pieces.block, params[key], pieces.embed(top, tokens, cfg, layout), cfg, layout)
        x, aux = x if isinstance(x, tuple) else (x, None)
        return pieces.head(top, x, cfg, layout), aux

    def apply(params: dict[str, Any], tokens: Tensor, cfg: Any, layout: Any = None) -> Tensor:
        """Logits ``(batch, seq, vocab)`` for ``tokens (batch, seq)``."""
        return forward(params, tokens, cfg, layout if layout is not None else _default_layout())[0]

    def loss(params: dict[str, Any], batch: dict[str, Tensor], cfg: Any, layout: Any = None) -> Any:
        """Mean next-token cross-entropy over this rank's batch (``batch["inputs"]``, ``batch["targets"]``).

        Blocks that return aux (a MoE layer's, ``functitan.moe``) make it ``(TokenLoss, metrics)``: the step's
        tokens normalise the cross-entropy plus each sequence's balance loss weighted by its tokens in the loss
        (the plain mean over sequences when none is ignored), and ``metrics`` holds ``balance`` and each
        expert's share of the routed tokens (``load``), reduced over the step by the trainer."""
        layout = layout if layout is not None else _default_layout()
        logits, aux = forward(params, batch["inputs"], cfg, layout)
        if aux is None:
            return layout.cross_entropy(logits, batch["targets"], cfg.vocab_size)
        ce = layout.cross_entropy(logits, batch["targets"], cfg.vocab_size, reduction="tokens")
        return _with_aux(ce, aux, batch["targets"])

    def stages(cfg: Any, layout: Any, *, seq_len: int, dtype: torch.dtype = torch.float32) -> Any:
        """The pipeline ``StageModel``. Costs are forward FLOPs per token: a block ``2 * its matrix params +
        2 * seq * heads * head_dim`` (causal attention scores and values), the head ``2 * its matrix params`` plus a few ops
        per logit for the loss, the embedding a row copy per table."""
        from ..pipeline import StageModel

        d, vocab = cfg.dim, cfg.vocab_size
        decl = declare(cfg)
        first, last = pieces.first_keys(cfg), pieces.last_keys(cfg)
        head_matrices = _matrix_params({k: decl[k] for k in last})
        width = pieces.attention_dim(cfg) if pieces.attention_dim is not None else d
        import optree

        def gathered(p: Any, keys: tuple[str, ...]) -> Any:
            # the keys the piece reads, leaf by leaf (what the planner's pipelined traces are validated with); the
            # executor hands the rank's whole tree, blocks included: gathering all of it in every microbatch's
            # first and last piece made a pp 2 x fsdp 2 step 1.3-1.6x as slow as fsdp 4 (1.0-1.05x without)
            return {k: optree.tree_map(layout.param, p[k]) for k in keys}

        # blocks with aux (MoE): token sums, so the terms of every stage join the loss as the one-process loss's
        moe = expert_count(decl[key]) > 0
        reduction = "tokens" if moe else "mean"
        return StageModel(
            first=lambda p, mb: pieces.embed(gathered(p, first), mb["inputs"], cfg, layout),
            blocks=lambda layers, x: layout.blocks(pieces.block, layers, x, cfg, layout),
            last=lambda p, x, mb: layout.cross_entropy(
                pieces.head(gathered(p, last), x, cfg, layout), mb["targets"], vocab, reduction=reduction
            ),
            aux=(lambda aux, mb: _aux_terms(aux, mb["targets"])) if moe else None,
            # the residual stream between stages: (microbatch, local seq, dim)
            activation=lambda mb: ((mb["inputs"].shape[0], mb["inputs"].shape[1] // layout.seq_shards, d), dtype),
            n_blocks=len(decl[key]),
            block_cost=float(2 * _matrix_params(decl[key][0]) + 2 * seq_len * width),
            first_cost=float(d * len(first)),
            last_cost=float(2 * head_matrices + 5 * vocab + 4 * d),
            blocks_key=key,
            first_keys=first,
            last_keys=last,
            single_backward=_remat.as_policy(layout.remat).single_backward,
        )

    return apply, loss, stages
