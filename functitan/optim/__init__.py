"""Functional optimizers in optax's shape: ``GradientTransformation(init, update)`` over pytrees of tensors.

Params, grads and optimizer state are pytrees whose leaves may be DTensors; the math runs on local shards
with ``torch._foreach_*`` and keeps every leaf's placement. Typical use::

    opt = optim.chain(optim.clip_by_global_norm(1.0),
                      optim.adamw(optim.warmup_cosine(3e-4, warmup_steps=200, total_steps=10_000)))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = optim.apply_updates(params, updates)
"""

from functitan.optim._aliases import adamw, sgd
from functitan.optim._base import EmptyState, GradientTransformation, apply_updates, chain, identity
from functitan.optim._norm import global_norm
from functitan.optim._schedules import constant, warmup_cosine, warmup_linear, wsd
from functitan.optim._transforms import (
    EMBEDDING_NAMES,
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    clip_to_norm,
    default_decay_mask,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "chain",
    "identity",
    "apply_updates",
    "global_norm",
    "scale",
    "scale_by_learning_rate",
    "scale_by_adam",
    "trace",
    "add_decayed_weights",
    "clip_by_global_norm",
    "clip_to_norm",
    "default_decay_mask",
    "EMBEDDING_NAMES",
    "ScaleByAdamState",
    "TraceState",
    "ScaleByScheduleState",
    "adamw",
    "sgd",
    "constant",
    "warmup_cosine",
    "warmup_linear",
    "wsd",
]
