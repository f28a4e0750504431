"""Functional optimizers in optax's shape: ``GradientTransformation(init, update)`` over pytrees of tensors.

Params, grads and optimizer state are pytrees whose leaves may be DTensors; the math runs on local shards
with ``torch._foreach_*`` and keeps every leaf's placement. Typical use::

    opt = optim.chain(optim.clip_by_global_norm(1.0),
                      optim.adamw(optim.warmup_cosine(3e-4, warmup_steps=200, total_steps=10_000)))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = optim.apply_updates(params, updates)
"""

from typing import TYPE_CHECKING

from functitan._lazy import lazy_exports
from functitan.optim._schedules import Schedule, constant, join_schedules, warmup_cosine, warmup_linear, wsd

if TYPE_CHECKING:  # imported on first use (functitan._lazy): they import torch, the schedules do not
    from functitan.optim._adafactor import (
        FactoredState,
        ScaleByLionState,
        adafactor,
        lion,
        scale_by_factored_rms,
        scale_by_lion,
    )
    from functitan.optim._aliases import adamw, sgd
    from functitan.optim._base import EmptyState, GradientTransformation, apply_updates, chain, identity
    from functitan.optim._combinators import (
        ApplyEvery,
        EmaState,
        InjectHyperparamsState,
        MaskedState,
        MultiStepsState,
        MultiTransformState,
        apply_every,
        ema,
        inject_hyperparams,
        masked,
        multi_steps,
        multi_transform,
        param_ema,
    )
    from functitan.optim._muon import (
        MUON_STACK_AXES,
        MUON_TABLE_AXES,
        NS_COEFFICIENTS,
        ScaleByMuonState,
        default_muon_labels,
        muon,
        muon_labels_from_specs,
        orthogonalize,
        scale_by_muon,
    )
    from functitan.optim._norm import global_norm
    from functitan.optim._transforms import (
        NO_DECAY_AXES,
        Mask,
        ScaleByAdamState,
        ScaleByScheduleState,
        TraceState,
        add_decayed_weights,
        clip_by_global_norm,
        clip_to_norm,
        decay_mask_from_specs,
        default_decay_mask,
        scale,
        scale_by_adam,
        scale_by_learning_rate,
        set_to_zero,
        trace,
    )

__getattr__ = lazy_exports(
    __name__,
    {
        "._adafactor": (
            "FactoredState",
            "ScaleByLionState",
            "adafactor",
            "lion",
            "scale_by_factored_rms",
            "scale_by_lion",
        ),
        "._aliases": ("adamw", "sgd"),
        "._base": ("EmptyState", "GradientTransformation", "apply_updates", "chain", "identity"),
        "._combinators": (
            "ApplyEvery",
            "EmaState",
            "InjectHyperparamsState",
            "MaskedState",
            "MultiStepsState",
            "MultiTransformState",
            "apply_every",
            "ema",
            "inject_hyperparams",
            "masked",
            "multi_steps",
            "multi_transform",
            "param_ema",
        ),
        "._muon": (
            "MUON_STACK_AXES",
            "MUON_TABLE_AXES",
            "NS_COEFFICIENTS",
            "ScaleByMuonState",
            "default_muon_labels",
            "muon",
            "muon_labels_from_specs",
            "orthogonalize",
            "scale_by_muon",
        ),
        "._norm": ("global_norm",),
        "._transforms": (
            "NO_DECAY_AXES",
            "Mask",
            "ScaleByAdamState",
            "ScaleByScheduleState",
            "TraceState",
            "add_decayed_weights",
            "clip_by_global_norm",
            "clip_to_norm",
            "decay_mask_from_specs",
            "default_decay_mask",
            "scale",
            "scale_by_adam",
            "scale_by_learning_rate",
            "set_to_zero",
            "trace",
        ),
    },
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
    "set_to_zero",
    "scale_by_adam",
    "trace",
    "add_decayed_weights",
    "clip_by_global_norm",
    "clip_to_norm",
    "default_decay_mask",
    "decay_mask_from_specs",
    "NO_DECAY_AXES",
    "Mask",
    "ScaleByAdamState",
    "TraceState",
    "ScaleByScheduleState",
    "adamw",
    "sgd",
    "constant",
    "warmup_cosine",
    "warmup_linear",
    "wsd",
    "join_schedules",
    "Schedule",
    "masked",
    "MaskedState",
    "multi_transform",
    "MultiTransformState",
    "inject_hyperparams",
    "InjectHyperparamsState",
    "apply_every",
    "ApplyEvery",
    "multi_steps",
    "MultiStepsState",
    "ema",
    "param_ema",
    "EmaState",
    "lion",
    "scale_by_lion",
    "ScaleByLionState",
    "adafactor",
    "scale_by_factored_rms",
    "FactoredState",
    "muon",
    "scale_by_muon",
    "ScaleByMuonState",
    "orthogonalize",
    "default_muon_labels",
    "muon_labels_from_specs",
    "MUON_TABLE_AXES",
    "MUON_STACK_AXES",
    "NS_COEFFICIENTS",
]
