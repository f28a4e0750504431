"""Named optimizers, each a single ``chain`` of transforms (as in optax)."""

from __future__ import annotations

from typing import Any

from functitan.optim._base import GradientTransformation, chain
from functitan.optim._transforms import (
    Mask,
    Schedule,
    add_decayed_weights,
    default_decay_mask,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = ["adamw", "sgd"]


def adamw(
    learning_rate: float | Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    mask: Mask | None = default_decay_mask,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019): Adam's direction plus decoupled weight decay, times ``-lr``.

    Equals ``torch.optim.AdamW`` with the decayed params in one group and the rest in a group with
    ``weight_decay=0``. By default matrices are decayed and vectors and embeddings are not
    (``default_decay_mask``); ``mask=None`` decays everything. ``learning_rate`` may be a schedule
    ``step -> float`` (``functitan.optim.warmup_cosine`` ...), read at step 0 for the first update.

    State: ``(ScaleByAdamState(count, mu, nu), EmptyState(), ScaleByScheduleState(count) or EmptyState())``.
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps),
        add_decayed_weights(weight_decay, mask=mask),
        scale_by_learning_rate(learning_rate),
    )


def sgd(learning_rate: float | Schedule, *, momentum: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """SGD with optional (Nesterov) momentum; equals ``torch.optim.SGD`` with zero dampening and no decay."""
    if nesterov and momentum <= 0:
        raise ValueError(f"sgd(nesterov=True) needs momentum > 0, got momentum={momentum}; pass e.g. momentum=0.9")
    momentum_part: list[Any] = [trace(momentum, nesterov=nesterov)] if momentum else []
    return chain(*momentum_part, scale_by_learning_rate(learning_rate))
