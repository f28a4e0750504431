"""Evaluation during training (``[eval]``): the loss over tokens never trained on, exact under every layout.

The eval loader shares each global batch out over the data-parallel ranks as the training loader does, so
every sequence is evaluated once, by one data-parallel rank, whatever the layout. Each rank computes its part
with the step's own objective: forward only (no graph) without pipelining; with it, the pipeline's executor,
whose gradients are dropped (its schedules interleave forward and backward, so it has no forward-only mode).
The reduction is the step's: a mean loss is averaged over ranks and batches (they are the same size), a
``TokenLoss`` has its sums and counts added over microbatches, batches and ranks before one division.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._loss import TokenLoss, split_aux
from .data import TokenLoader, build_loader
from .data._shards import tokenizer_identity
from .errors import UserError
from .job_config import JobConfig
from .step import _loss_and_aux, _mean_over_ranks
from .transforms import split_batch

__all__ = ["eval_loader", "forward_loss", "pipeline_loss", "make_evaluator"]

_TOKENIZER_KEYS = ("kind", "hash", "vocab_size", "bos_id", "eos_id")


def eval_loader(cfg: JobConfig, train: TokenLoader, device: torch.device) -> TokenLoader | None:
    """The loader of ``cfg.eval``'s data on this data-parallel rank (None when ``eval.every`` is 0).

    Its batches have the training shape (the same per-rank batch and seq_len, so a pipeline or a compiled block
    sees the shapes it was built for). Refused here, before step 1: a tokenizer other than training's, and data
    too short for ``eval.batches`` batches without repeating a sequence."""
    ev = cfg.eval
    if not ev.every:
        return None
    ev.check_data()

    def shaped(data: Any, **holdout: Any) -> TokenLoader:
        return build_loader(
            data,
            batch_size=train.batch_size,
            seq_len=train.seq_len,
            dp_rank=train.dp_rank,
            dp_size=train.dp_size,
            device=device,
            **holdout,
        )

    if ev.holdout:
        loader, source = shaped(cfg.data, holdout=ev.holdout, held_out=True), f"eval.holdout={ev.holdout}"
    else:
        loader = shaped(dataclasses.replace(cfg.data, paths=ev.paths, path=ev.path))
        source = f"eval.path={ev.path}" if ev.path else f"eval.paths={list(ev.paths)}"
        theirs, ours = _identity(loader, cfg.data.tokenizer), _identity(train, cfg.data.tokenizer)
        if any(theirs.get(k) != ours.get(k) for k in _TOKENIZER_KEYS):
            flag = f"--tokenizer {ours['path']}" if ours.get("path") else "without --tokenizer"
            raise UserError(
                f"{source} was tokenized with {_describe(theirs)}, training with {_describe(ours)}; prepare it "
                f"with the training tokenizer (functitan data prepare ... {flag})"
            )
    need = ev.batches * train.batch_size * train.dp_size
    if not loader.holds(need):
        raise UserError(
            f"eval.batches={ev.batches}: {source} holds fewer than {need} sequences of training.seq_len + 1 = "
            f"{train.seq_len + 1} tokens ({ev.batches} x training.batch_size={train.batch_size * train.dp_size}); "
            "lower eval.batches, or give more evaluation data (raise eval.holdout)"
        )
    return loader


def _identity(loader: TokenLoader, tokenizer_path: str | None) -> dict[str, Any]:
    if loader.shards is not None:
        return dict(loader.shards.index["tokenizer"])
    return tokenizer_identity(loader.tokenizer, tokenizer_path)


def _describe(ident: dict[str, Any]) -> str:
    return (
        "the byte tokenizer"
        if ident.get("kind") == "byte"
        else f"{ident.get('path')} (vocab {ident.get('vocab_size')})"
    )


def forward_loss(objective: Callable[[Any, Any], Any], microbatches: int) -> Callable[[Any, Any], Any]:
    """``(params, batch) -> this rank's loss`` without gradients, over the microbatches the step splits it in:
    a mean loss's mean over them, a TokenLoss's sums."""

    def loss(params: Any, batch: Any) -> Tensor | TokenLoss:
        with torch.no_grad():
            parts = [split_aux(objective(params, mb))[0] for mb in split_batch(batch, microbatches)]
        tokens = [p for p in parts if isinstance(p, TokenLoss)]
        if tokens:  # a loss returns one kind
            return TokenLoss(torch.stack([t.sum for t in tokens]).sum(), torch.stack([t.count for t in tokens]).sum())
        return torch.stack([p.detach().float() for p in parts if isinstance(p, Tensor)]).mean()

    return loss


def pipeline_loss(grad_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``(params, batch) -> this rank's loss`` from a pipeline executor, its gradients dropped."""

    def loss(params: Any, batch: Any) -> Tensor | TokenLoss:
        value, _ = grad_fn(params, batch)
        return _loss_and_aux(value, reduce=False)[0]

    return loss


def make_evaluator(loader: TokenLoader, loss: Callable[[Any, Any], Any], batches: int) -> Callable[[Any], dict]:
    """``evaluate(params) -> {"eval/loss", "eval/perplexity", "eval_s"}``: the same ``batches`` global batches
    each time (the eval stream from its start), reduced over every rank as the step reduces its loss."""

    def evaluate(params: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        state = loader.init_state()
        sums: list[Tensor] = []
        counts: list[Tensor] = []
        for _ in range(batches):
            batch, state = loader.next(state)
            value = loss(params, batch)
            if isinstance(value, TokenLoss):
                sums.append(value.sum.detach().float().reshape(()))
                counts.append(value.count.detach().float().reshape(()).to(sums[-1].device))
            else:
                sums.append(value.detach().float().reshape(()))
        if counts:  # a token mean over every evaluated token
            total, count = _mean_over_ranks(torch.stack([torch.stack(sums).sum(), torch.stack(counts).sum()])).tolist()
            mean = total / count if count > 0 else 0.0
        else:  # means of equal-sized batches: their mean
            mean = _mean_over_ranks(torch.stack(sums).mean()).item()
        return {
            "eval/loss": mean,
            "eval/perplexity": math.exp(mean) if mean < 700 else math.inf,
            "eval_s": time.perf_counter() - t0,
        }

    return evaluate
