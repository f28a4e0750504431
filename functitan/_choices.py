"""Allowed values that a config key and the library code share, each spelled once: the config checks a value
against the ``Literal`` (job_config's ``training.remat``, ``training.on_nonfinite``) and the code branches on
it. No torch here, so ``functitan train --nproc N`` checks a config before it starts torchrun."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "RematName",
    "REMAT_POLICIES",
    "NonFinitePolicy",
    "NONFINITE_POLICIES",
    "CPAttention",
    "CP_ATTENTIONS",
    "MoEScore",
    "MOE_SCORES",
]

RematName = Literal["none", "full", "selective", "offload"]  # functitan._remat: activation checkpointing
REMAT_POLICIES: tuple[str, ...] = get_args(RematName)

NonFinitePolicy = Literal["stop", "skip"]  # functitan.step: what a NaN or inf loss does
NONFINITE_POLICIES: tuple[str, ...] = get_args(NonFinitePolicy)

CPAttention = Literal["allgather", "ring", "ulysses"]  # functitan._cp: how attention spans the cp chunks
CP_ATTENTIONS: tuple[str, ...] = get_args(CPAttention)

MoEScore = Literal["softmax", "sigmoid"]  # functitan.moe: a router's per-expert affinity (Qwen3-MoE, DeepSeek-V3)
MOE_SCORES: tuple[str, ...] = get_args(MoEScore)
