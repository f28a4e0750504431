"""Losses as sums over tokens with a count: what makes a masked objective exact under every split.

A mean over a rank's tokens is not a mean over the step's tokens when the number of valid tokens varies (a
random 15% MLM mask, SFT prompts of different lengths, padding): averaging per-rank or per-microbatch means
weights a token of a sparse row more than one of a dense row. So a loss may return ``TokenLoss(sum, count)``:
the trainer adds the sums and the counts over microbatches, pipeline microbatches and data-parallel ranks,
and divides once (torchtitan's global token normalisation). ``count`` depends on the batch only, never on
the params, so each microbatch's backward runs on its ``sum`` and the summed gradient is scaled by
``1 / global count`` afterwards (``functitan.step``): one all-reduce of two scalars, no extra pass over the
gradients when clipping (the two scales are one multiply).

The per-token cross-entropy here is the one-device form (full-vocabulary logits); the vocab-parallel form is
``functitan._tp.TPContext.cross_entropy``. Both honour ``ignore_index``, label smoothing (as
``F.cross_entropy``) and PaLM's z-loss (``z_loss * logsumexp(logits) ** 2`` per valid token, arXiv 2204.02311).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TokenLoss", "IGNORE_INDEX", "dense_cross_entropy", "check_options", "split_aux", "as_mean", "aux_metrics"]

IGNORE_INDEX = -100  # torch's default: a target equal to it is no token of the loss


class TokenLoss(NamedTuple):
    """A loss as ``sum`` over tokens and the ``count`` of tokens summed (both 0-d, fp32).

    Return it from a model's loss (``layout.cross_entropy(..., reduction="tokens")``, ``layout.token_mean``)
    and the step's loss is ``sum / count`` with both added over the whole step: microbatches, pipeline
    microbatches, data-parallel ranks. Terms over the same tokens add into ``sum``:
    ``TokenLoss(ce.sum + 1e-4 * z.sum, ce.count)``.
    """

    sum: Tensor  # () float32: the sum of per-token losses over this rank's (micro)batch
    count: Tensor  # type: ignore[assignment]  # () float32: how many tokens that sum holds (shadows tuple.count)

    def mean(self) -> Tensor:
        """This rank's mean (``sum / count``; 0 when it holds no token): what one microbatch alone would report."""
        return self.sum / self.count.float().clamp_min(1.0)


def dense_cross_entropy(
    logits: Tensor,  # (batch, seq, vocab): every column of the vocabulary
    targets: Tensor,  # (batch, seq)
    *,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """``(sum of per-token losses, count of valid tokens)`` in fp32, as ``F.cross_entropy(reduction="sum")``."""
    z = logits.flatten(0, 1).float()
    t = targets.flatten()
    total = F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum")
    valid = t != ignore_index
    if z_loss:
        total = total + z_loss * torch.where(valid, torch.logsumexp(z, -1).square(), 0.0).sum()
    return total, valid.sum().float()


def check_options(reduction: str, label_smoothing: float, z_loss: float) -> None:
    if reduction not in ("mean", "tokens"):
        raise ValueError(
            f"cross_entropy(reduction={reduction!r}); choose 'mean' (this rank's mean) or 'tokens' (a TokenLoss the "
            f"trainer normalises over the step's tokens)"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy(label_smoothing={label_smoothing}) must be in [0, 1]")
    if z_loss < 0:
        raise ValueError(f"cross_entropy(z_loss={z_loss}) must be >= 0 (PaLM uses 1e-4)")


def split_aux(out: Any) -> tuple[Tensor | TokenLoss, Any]:
    """``(loss, aux or None)`` from what a model's loss returned: a 0-d loss, a TokenLoss, or ``(either, aux)``."""
    if isinstance(out, (Tensor, TokenLoss)):
        return out, None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (Tensor, TokenLoss)):
        return out[0], out[1]
    raise TypeError(
        f"the model's loss returned a {type(out).__name__}; return a 0-d mean loss, a TokenLoss(sum, count) "
        f"(layout.cross_entropy(..., reduction='tokens')), or (loss, aux dict)"
    )


def as_mean(loss: Tensor | TokenLoss) -> Tensor:
    """This (micro)batch's mean: a TokenLoss divided by its own count (a loss already a mean: itself)."""
    return loss.mean() if isinstance(loss, TokenLoss) else loss


def aux_metrics(aux: Any) -> dict[str, float]:
    """``{"aux/<key path>": value}`` for the 0-d tensors and numbers of a loss's aux outputs (a metrics sink's
    flat record). A 1-D float tensor (each expert's share of the routed tokens) gives one entry per element,
    ``aux/<key path>/<i>``, and its spread ``aux/<key path>/max_over_mean`` (1 when even); other leaves are left
    out."""
    from .tree import flatten_with_names

    if aux is None:
        return {}
    named, _ = flatten_with_names(aux)
    out = {}
    for name, v in named:
        if isinstance(v, Tensor) and v.numel() == 1:
            out[f"aux/{name}"] = float(v)
        elif isinstance(v, Tensor) and v.dim() == 1 and v.is_floating_point():
            values = v.tolist()
            out.update({f"aux/{name}/{i}": x for i, x in enumerate(values)})
            mean = sum(values) / len(values)
            out[f"aux/{name}/max_over_mean"] = max(values) / mean if mean else 0.0
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"aux/{name}"] = float(v)
    return out
