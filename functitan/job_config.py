"""The trainer's config: one small frozen dataclass per component, grouped by section.

``functitan train --help`` lists every key with its default; TOML files (configs/*.toml) and
``--section.key=value`` overrides land on these dataclasses (see functitan.config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from . import optim
from .data import DataConfig
from .pipeline._generators import ScheduleName
from .step import NonFinitePolicy

__all__ = [
    "ModelConfig", "TrainingConfig", "OptimizerConfig", "ParallelismConfig", "MetricsConfig",
    "CheckpointConfig", "JobConfig", "build_optimizer", "build_schedule", "learning_rate_schedule",
]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model, and its shape: the model's own config fields are ``--model.<field>=value``.

    ``name`` is a plugin (``llama``, ``gpt2``, ``qwen3``), a module (``pkg.mod:MODEL``) or a file
    (``path/to/model.py``); see ``functitan.model.load_model``. None keeps the model recorded with
    ``checkpoint.load_path``, else ``llama``.
    """

    name: str | None = None
    flavor: str | None = None  # a key of the model's configs; None: the recorded one, else "debug"
    overrides: Mapping[str, Any] = field(default_factory=dict)  # --model.<field>=value: the model config's fields


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    steps: int = 200
    batch_size: int = 8  # global: sequences per step over all data-parallel ranks
    seq_len: int = 256
    microbatches: int = 1  # gradient accumulation steps per rank (with pp > 1: pipeline microbatches)
    seed: int = 0
    remat: Literal["none", "full", "selective"] = "none"  # activation checkpointing per block
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute dtype (master weights stay fp32)
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # gradient reduction dtype
    compile: bool = False  # torch.compile each block
    on_nonfinite: NonFinitePolicy = "stop"
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # CPU threads per process; 0 leaves torch's default


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-3
    schedule: Literal["warmup_cosine", "warmup_linear", "wsd", "constant"] = "warmup_cosine"
    warmup_steps: int = 20
    final_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9  # sgd only
    max_norm: float = 1.0  # global gradient-norm clip; 0 disables


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the remaining ranks
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = True  # with tp > 1: shard norms and the residual stream along the sequence
    reshard_after_forward: bool = True  # FSDP: free gathered params after each block's forward
    pipeline_schedule: ScheduleName = "1f1b"  # with pp > 1
    stages_per_rank: int = 2  # interleaved_1f1b only (zb_v always has 2)


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    log_every: int = 10
    run_dir: str = "runs"
    run_name: str | None = None  # None: a timestamp


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    enable: bool = False
    folder: str = "checkpoints"  # under runs/<run_name>/ (resume a run by passing its metrics.run_name), or absolute
    interval: int = 100
    keep_last: int = 3
    load_path: str | None = None  # weights to start from: a functitan checkpoint or a Hugging Face directory


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optim.Schedule:
    final = cfg.lr * cfg.final_lr_ratio
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.schedule == "constant":
        return optim.constant(cfg.lr)
    if cfg.schedule == "warmup_cosine":
        return optim.warmup_cosine(cfg.lr, warmup, total_steps, final=final)
    if cfg.schedule == "warmup_linear":
        return optim.warmup_linear(cfg.lr, warmup, total_steps, final=final)
    return optim.wsd(cfg.lr, warmup, total_steps, final=final)


def build_optimizer(cfg: OptimizerConfig, total_steps: int) -> optim.GradientTransformation:
    """The optimizer the config names (clipping by ``max_norm`` happens in the train step, which has the norm)."""
    lr = learning_rate_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        return optim.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return optim.sgd(lr, momentum=cfg.momentum)


def build_schedule(par: ParallelismConfig, microbatches: int):
    """The pipeline schedule the config names, for ``pp`` ranks and ``microbatches`` microbatches."""
    from . import pipeline

    v = par.stages_per_rank if par.pipeline_schedule == "interleaved_1f1b" else None
    return pipeline.make_schedule(par.pipeline_schedule, par.pp, microbatches, v)
