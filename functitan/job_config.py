"""The trainer's config: one small frozen dataclass per component, grouped by section.

``functitan train --help`` lists every key with its default; TOML files (configs/*.toml) and
``--section.key=value`` overrides land on these dataclasses (see functitan.config). Each section checks its
own values in ``__post_init__`` and ``JobConfig`` the ones that depend on each other, so every value is
checked at parse time, before a process starts or a step is computed. A key's entry under its section's
``Attributes:`` (or a field's ``metadata["help"]``) is its help in ``functitan train --help`` and in every other
command's flag that sets it (``--seq-len`` is ``training.seq_len`` in gradcheck and plan:
functitan._command.config_flag), so it is written once.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from . import optim
from ._choices import CPAttention, NonFinitePolicy, RematName
from .config import ConfigError, check, parse_config
from .data import DataConfig
from .pipeline._generators import ScheduleName

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_FLAVOR",
    "ModelConfig",
    "parse_model_args",
    "TrainingConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "MetricsConfig",
    "CheckpointConfig",
    "ElasticConfig",
    "EvalConfig",
    "ProfileConfig",
    "JobConfig",
    "build_optimizer",
    "build_schedule",
    "learning_rate_schedule",
    "Device",
    "ParamDType",
    "OptimizerName",
]

Device = Literal["auto", "cpu", "cuda"]  # auto: cuda when available, else cpu
ParamDType = Literal["float32", "bfloat16", "float16"]  # the compute dtype of params (master weights stay fp32)


def _at_least(cfg, names: tuple[str, ...], low: int) -> None:
    for name in names:
        value = getattr(cfg, name)
        check(value >= low, name, value, f"must be >= {low}")


DEFAULT_MODEL = "llama"  # the model and flavor of a command given neither (train, gradcheck, plan)
DEFAULT_FLAVOR = "debug"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model, and its shape: the model's own config fields are ``--model.<field>=value``.

    ``name`` is a plugin (``llama``, ``gpt2``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``), a module
    (``pkg.mod:MODEL``) or a file (``path/to/model.py``); see ``functitan.model.load_model``. None keeps the model
    recorded with ``checkpoint.load_path``, else ``DEFAULT_MODEL``. Every command reads these flags with
    ``parse_model_args`` (``functitan train`` through ``parse_config``, the same parser).
    """

    name: str | None = field(
        default=None,
        metadata={
            "help": f"a plugin (llama, gpt2, qwen3, qwen3_moe, deepseek_v3), a module (pkg.mod:MODEL) or a file "
            f"(path/to/model.py); default: the checkpoint's, else {DEFAULT_MODEL}"
        },
    )
    flavor: str | None = field(
        default=None,
        metadata={"help": f"a key of the model's configs; default: the checkpoint's, else {DEFAULT_FLAVOR}"},
    )
    overrides: Mapping[str, Any] = field(default_factory=dict)  # --model.<field>=value: the model config's fields


@dataclass(frozen=True, kw_only=True)
class _ModelOnly:
    model: ModelConfig = field(default_factory=ModelConfig)


def parse_model_args(argv: Sequence[str]) -> tuple[ModelConfig, list[str]]:
    """``(the ModelConfig that argv's --model.<key> arguments set, the other arguments)``, for a command that
    takes a model besides its own flags (gradcheck, plan).

    ``--model.name=X`` and ``--model.name X`` both work, as in ``functitan train``: these arguments go through
    the same ``parse_config``, so the three commands read, convert and refuse them alike.

        >>> parse_model_args(["--model.flavor", "tiny", "--model.n_layers=2", "--top", "1"])
        (ModelConfig(name=None, flavor='tiny', overrides={'n_layers': '2'}), ['--top', '1'])
    """
    mine: list[str] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        taker = mine if args[i].startswith("--model.") else rest
        taker.append(args[i])
        if taker is mine and "=" not in args[i] and i + 1 < len(args) and not args[i + 1].startswith("--"):
            mine.append(args[i + 1])  # --model.flavor tiny
            i += 1
        i += 1
    return parse_config(_ModelOnly, mine).model, rest


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The loop: how long, how big, in what precision.

    Attributes:
        steps: optimizer steps.
        batch_size: global: sequences per step over all data-parallel ranks.
        seq_len: tokens per sequence.
        microbatches: gradient accumulation steps per rank (with pp > 1: pipeline microbatches).
        seed: the parameter init and dropout seed (the data order has data.seed).
        remat: activation checkpointing per block: none, full (recompute the block), selective (keep matmul
            and attention outputs), offload (saved activations to host memory).
        param_dtype: the compute dtype of params; the master weights and optimizer state stay float32.
        reduce_dtype: the dtype gradients are reduced in across data-parallel ranks.
        compile: torch.compile each block.
        on_nonfinite: a NaN or inf loss stops the run (after a checkpoint), or skips that step's update.
        device: auto is cuda when available, else cpu.
        threads: CPU threads per process; 0 leaves torch's default.
    """

    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    microbatches: int = 1
    seed: int = 0
    remat: RematName = "none"
    param_dtype: ParamDType = "float32"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    compile: bool = False
    on_nonfinite: NonFinitePolicy = "stop"
    device: Device = "auto"
    threads: int = 0

    def __post_init__(self) -> None:
        _at_least(self, ("steps", "batch_size", "seq_len", "microbatches"), 1)
        _at_least(self, ("threads",), 0)
        check(self.device in get_args(Device), "device", self.device, f"choose one of {list(get_args(Device))}")


OptimizerName = Literal["adamw", "sgd", "lion", "adafactor", "muon"]
MuonAdjustLR = Literal["match_rms_adamw", "original", "none"]  # functitan.optim.muon's adjust_lr


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer and its learning-rate schedule (``functitan.optim``, optax's shapes).

    Attributes:
        name: adamw; sgd (with momentum); lion (b1, b2, weight_decay; use an lr 3-10x below AdamW's);
            adafactor (factored second moments, relative step scaled by lr; weight_decay if > 0); muon
            (orthogonalised momentum for hidden matrices, AdamW with b1, b2, eps for embeddings, the head, norms
            and biases; one lr and weight_decay for both with muon_adjust_lr=match_rms_adamw).
        lr: the peak learning rate.
        schedule: warmup_cosine, warmup_linear, wsd (warmup, stable, then decay over the last decay_fraction
            of the steps) or constant.
        warmup_steps: linear warmup from 0 to lr (capped at training.steps).
        final_lr_ratio: the lr at the last step, as a fraction of lr.
        decay_fraction: wsd only: the share of the steps spent decaying.
        b1: first-moment decay (adamw, lion).
        b2: second-moment decay (adamw, lion).
        eps: adamw's denominator epsilon.
        weight_decay: decoupled weight decay of matrices (params whose spec says so).
        momentum: sgd only.
        max_norm: the global gradient-norm clip; 0 disables it.
        muon_momentum: muon only: the momentum of the hidden matrices (Nesterov).
        ns_steps: muon only: Newton-Schulz iterations per step.
        muon_adjust_lr: muon only: the lr of a matrix scaled by 0.2 sqrt(max(rows, cols)) (match_rms_adamw:
            the update's RMS is AdamW's, so lr serves both groups), by sqrt(max(1, rows / cols)) (original,
            torch.optim.Muon's default; wants a ~10x larger lr than AdamW) or not at all (none).
        muon_ns_dtype: muon only: the dtype of the Newton-Schulz iteration: bfloat16 (torch.optim.Muon's and
            Keller Jordan's), or float32 (on CPU often faster; layouts then agree with one process to fp32
            rounding, where bfloat16 amplifies the collectives' rounding of a gradient).
        moe_bias_rate: MoE models with balancing biases (DeepSeek-V3's ``e_score_correction_bias``): after each
            step each layer's bias moves by this times ``sign(mean load - expert load)``, centred (the
            auxiliary-loss-free update; DeepSeek-V3's gamma, torchtitan's load_balance_coeff); 0 keeps the biases
            as loaded. Not the optimizer's: no momentum, decay, clipping or lr schedule.
    """

    name: OptimizerName = "adamw"
    lr: float = 3e-3
    schedule: Literal["warmup_cosine", "warmup_linear", "wsd", "constant"] = "warmup_cosine"
    warmup_steps: int = 20
    final_lr_ratio: float = 0.1
    decay_fraction: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9
    max_norm: float = 1.0
    muon_momentum: float = 0.95
    ns_steps: int = 5
    muon_adjust_lr: MuonAdjustLR = "match_rms_adamw"
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    moe_bias_rate: float = 1e-3

    def __post_init__(self) -> None:
        check(
            math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "a learning rate is a finite number > 0, e.g. 3e-4"
        )
        _at_least(self, ("warmup_steps",), 0)
        check(
            0 <= self.final_lr_ratio <= 1,
            "final_lr_ratio",
            self.final_lr_ratio,
            "the final lr is lr times a ratio in [0, 1]",
        )
        check(
            0 <= self.decay_fraction <= 1,
            "decay_fraction",
            self.decay_fraction,
            "wsd decays over this share of training.steps, in [0, 1], e.g. 0.1",
        )
        for name in ("b1", "b2", "momentum", "muon_momentum"):
            value = getattr(self, name)
            check(0 <= value < 1, name, value, "a decay rate in [0, 1), e.g. 0.9")
        check(1 <= self.ns_steps < 100, "ns_steps", self.ns_steps, "Newton-Schulz iterations in [1, 100), e.g. 5")
        for name in ("eps", "weight_decay", "max_norm", "moe_bias_rate"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, name, value, "must be a finite number >= 0")


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """The layout: mesh degrees, whose product is the world size (docs/parallelism.md).

    Attributes:
        dp_replicate: data-parallel replicas (DDP; with dp_shard > 1: HSDP).
        dp_shard: FSDP ranks that shard params, gradients and optimizer state; -1: the remaining ranks.
        tp: tensor-parallel ranks (the model's logical axes decide the collectives).
        pp: pipeline ranks.
        cp: context-parallel ranks: each holds two balanced chunks of every sequence (docs/parallelism.md).
        ep: expert-parallel ranks, borrowed from dp_shard x cp x tp (torchtitan's efsdp = dp_shard * cp * tp /
            ep): 1, or a multiple of cp x tp that divides that product. Each holds experts / ep of every MoE
            layer's routed experts and receives their tokens by all-to-all (docs/moe.md).
        cp_attention: with cp > 1, how attention reaches the other chunks' keys: allgather (takes packed
            documents), ring (K/V passed around the cp ranks, sends overlapped) or ulysses (all-to-all to heads).
        sequence_parallel: with tp > 1: shard norms and the residual stream along the sequence.
        reshard_after_forward: FSDP: free gathered params after each block's forward (regather in backward).
        pipeline_schedule: the pipeline schedule, with pp > 1.
        stages_per_rank: interleaved_1f1b only (zb_v always has 2).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cp_attention: CPAttention = "allgather"
    sequence_parallel: bool = True
    reshard_after_forward: bool = True
    pipeline_schedule: ScheduleName = "1f1b"
    stages_per_rank: int = 2

    def __post_init__(self) -> None:
        _at_least(self, ("dp_replicate", "tp", "pp", "cp", "ep", "stages_per_rank"), 1)
        check(
            self.dp_shard == -1 or self.dp_shard >= 1,
            "dp_shard",
            self.dp_shard,
            "must be >= 1, or -1 for the remaining ranks",
        )


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Where a run's records go (runs/<run_name>/: metrics, TensorBoard events, the report's data).

    Attributes:
        log_every: write the metrics every this many steps (loss: that step's; loss_avg: the mean since the last).
        run_dir: the directory that holds the runs.
        run_name: this run's directory under run_dir; none for a timestamp (pass a run's name to resume it).
        wandb: also log to Weights & Biases (pip install 'functitan[wandb]'): a W&B run named after the run's
            directory, with the job's config; resuming the run continues it.
        wandb_project: the W&B project (with wandb).
        wandb_entity: the W&B team or user (with wandb); none for the logged-in user's default.
        wandb_mode: online, offline (kept under the run's directory for `wandb sync`) or disabled (with wandb);
            none for W&B's own choice: WANDB_MODE, else `wandb offline` / `wandb online`, else online.
    """

    log_every: int = 10
    run_dir: str = "runs"
    run_name: str | None = None
    wandb: bool = False
    wandb_project: str = "functitan"
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None

    def __post_init__(self) -> None:
        _at_least(self, ("log_every",), 1)
        check(bool(self.run_dir), "run_dir", self.run_dir, "a directory for the runs, e.g. runs")
        check(bool(self.wandb_project), "wandb_project", self.wandb_project, "a W&B project name, e.g. functitan")
        modes = ["online", "offline", "disabled", None]
        check(self.wandb_mode in modes, "wandb_mode", self.wandb_mode, f"choose one of {modes}")
        check(
            not self.wandb or importlib.util.find_spec("wandb") is not None,
            "wandb",
            self.wandb,
            "needs wandb: pip install 'functitan[wandb]'",
        )
        check(
            self.run_name is None or (self.run_name not in (".", "..") and "/" not in self.run_name),
            "run_name",
            self.run_name,
            "a directory name under run_dir (no '/'), or none for a timestamp",
        )


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """How a run adapts to its world size (docs/elastic.md).

    The data-parallel degree given as -1 (``parallelism.dp_shard`` by default) is the elastic one; ``tp`` and
    ``pp`` stay fixed. ``training.batch_size`` is global and stays constant: the per-rank batch follows the
    data-parallel size.

    Attributes:
        microbatch_size: sequences per microbatch on each rank. 0 keeps ``training.microbatches`` fixed;
            set it for elastic runs so the microbatch count follows the per-rank batch (memory stays put).
        live: keep training through membership changes without restarting (torchft replica groups).
        lighthouse: the torchft lighthouse, ``http://HOST:PORT`` (live only).
        replica_id: this replica group's name (live only; default: host and process id).
        min_replicas: steps commit only with at least this many replica groups (live only).
        timeout_s: a collective or commit vote that takes longer marks the peer dead (live only).
        quorum_timeout_s: how long a step waits for a quorum (live only).
        advertise_host: the address peers reach this group at (live only; default: the host name).
    """

    microbatch_size: int = 0
    live: bool = False
    lighthouse: str = ""
    replica_id: str = ""
    min_replicas: int = 1
    timeout_s: float = 10.0
    quorum_timeout_s: float = 120.0
    advertise_host: str = ""

    def __post_init__(self) -> None:
        check(self.microbatch_size >= 0, "microbatch_size", self.microbatch_size, "must be >= 0 (0: keep microbatches)")
        if not self.live:
            return
        # the live level's needs, checked where the config is parsed (the launcher), not at the first step
        check(
            self.microbatch_size >= 1,
            "microbatch_size",
            self.microbatch_size,
            "live=true needs >= 1: the sequences per microbatch per rank, the unit replica groups share out",
        )
        check(
            self.lighthouse.startswith(("http://", "https://")),
            "lighthouse",
            self.lighthouse,
            "live=true needs the torchft lighthouse as http://HOST:PORT (start `torchft_lighthouse "
            "--min_replicas 1 --bind HOST:PORT`)",
        )
        check(self.min_replicas >= 1, "min_replicas", self.min_replicas, "must be >= 1 (a majority of the groups)")
        for name in ("timeout_s", "quorum_timeout_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        check(
            importlib.util.find_spec("torchft") is not None,
            "live",
            self.live,
            "needs torchft: pip install 'functitan[elastic]'",
        )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Async sharded checkpoints (docs/checkpoints.md): Orbax-readable tensorstore steps.

    Attributes:
        enable: save checkpoints (and resume from the newest one of this run).
        folder: under runs/<run_name>/ (resume a run by passing its metrics.run_name), or an absolute path.
        interval: save every this many steps (and at the last step).
        keep_last: committed steps kept; older ones are deleted once a newer one commits.
        load_path: weights to start from: a functitan checkpoint, a Hugging Face directory or a torchtitan
            (DCP) step.
        when_busy: a save due while the previous one still writes: wait for it (the newest commit then trails
            the loop by at most one interval plus the save in flight), or skip this one (never waits).
    """

    enable: bool = False
    folder: str = "checkpoints"
    interval: int = 100
    keep_last: int = 3
    load_path: str | None = None
    when_busy: Literal["wait", "skip"] = "wait"

    def __post_init__(self) -> None:
        _at_least(self, ("interval", "keep_last"), 1)
        check(self.when_busy in ("wait", "skip"), "when_busy", self.when_busy, "choose one of ['wait', 'skip']")
        check(bool(self.folder), "folder", self.folder, "a directory name, e.g. checkpoints")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Validation during training: the loss over tokens never trained on, every N steps (docs/data.md).

    Every evaluation reads the same sequences: ``batches`` global batches of ``training.batch_size`` sequences,
    shared out over the data-parallel ranks as a training step's are, each token evaluated once whatever the
    layout; the mean over them (over their tokens, for a TokenLoss) is ``eval/loss`` in every sink and the report,
    with ``eval/perplexity``.

    Attributes:
        every: evaluate every this many steps and at the last step; 0: never.
        batches: global batches per evaluation (each training.batch_size sequences of training.seq_len).
        holdout: the share of data's documents set aside: never trained on, evaluated (e.g. 0.01); or give
            paths / path.
        paths: text / JSONL files or directories to evaluate on (tokenized with data.tokenizer).
        path: a directory of prepared shards to evaluate on (``functitan data prepare --split validation``;
            made with data's tokenizer).
    """

    every: int = 0
    batches: int = 4
    holdout: float = 0.0
    paths: tuple[str, ...] = ()
    path: str | None = None

    def __post_init__(self) -> None:
        _at_least(self, ("every",), 0)
        _at_least(self, ("batches",), 1)
        check(0 <= self.holdout < 1, "holdout", self.holdout, "a share of the documents in [0, 1), e.g. 0.01")
        given = [k for k, v in (("holdout", self.holdout), ("paths", self.paths), ("path", self.path)) if v]
        if len(given) > 1:
            check(
                False,
                given[0],
                getattr(self, given[0]),
                f"give one source of evaluation data, not also eval.{given[1]}",
            )

    def check_data(self) -> None:
        """``every`` with nothing to evaluate, refused where the built-in evaluation would run: ``functitan train``
        checks it as it parses, ``run`` before step 1 (``run(evaluate=...)`` brings its own and needs no data)."""
        if self.every and not (self.holdout or self.paths or self.path):
            raise ConfigError(
                f"eval.every={self.every}: evaluation needs tokens never trained on: add --eval.holdout=0.01 (1% of "
                "data's documents), --eval.paths=FILES or --eval.path=SHARDS"
            )


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """Traces and memory snapshots of chosen steps, in runs/<run_name>/profile/ (docs/reports.md).

    Attributes:
        steps: the steps to trace with torch.profiler (e.g. 5 or 5,6): each writes step-<N>-rank<R>.json, a
            Chrome trace (ui.perfetto.dev, chrome://tracing); the step before each is the profiler's warmup.
        with_stack: record each op's Python stack in the traces (larger files).
        memory_snapshot_steps: CUDA: after these steps, write the allocator's state and history to
            memory-step-<N>-rank<R>.pickle (open it in pytorch.org/memory_viz); none on CPU.
        memory_snapshot_on_oom: CUDA: when a step runs out of memory, write memory-oom-step-<N>-rank<R>.pickle
            before the error stops the run; none on CPU.
    """

    steps: tuple[int, ...] = ()
    with_stack: bool = False
    memory_snapshot_steps: tuple[int, ...] = ()
    memory_snapshot_on_oom: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "memory_snapshot_steps"):
            value = getattr(self, name)
            if not all(s >= 1 for s in value):  # named as typed: --profile.steps=5,6
                raise ConfigError(f"{name}={','.join(map(str, value))}: training steps, each >= 1, e.g. 5,6")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self) -> None:
        live, mb = self.elastic.live, self.elastic.microbatch_size
        if live and self.parallelism.pp > 1:
            raise ConfigError(
                f"elastic.live=true with parallelism.pp={self.parallelism.pp} is not supported; use "
                "parallelism.pp=1 inside each replica group"
            )
        if live and self.training.batch_size % mb:
            raise ConfigError(
                f"training.batch_size={self.training.batch_size} must be a multiple of elastic.microbatch_size={mb}: "
                "replica groups share out the global batch in units of microbatches"
            )
        for name in ("steps", "memory_snapshot_steps"):  # a step past the end would be profiled by no run
            late = [s for s in getattr(self.profile, name) if s > self.training.steps]
            if late:
                raise ConfigError(
                    f"profile.{name}={','.join(map(str, getattr(self.profile, name)))}: step {late[0]} is past "
                    f"training.steps={self.training.steps}; choose steps in 1..{self.training.steps}"
                )
        # the schedule depends on training.steps: build it once here, so that its errors name the keys
        opt, steps = self.optimizer, self.training.steps
        try:
            learning_rate_schedule(opt, steps)
        except ValueError as e:
            capped = f" (capped at training.steps={steps})" if opt.warmup_steps > steps else ""
            raise ConfigError(
                f"optimizer.schedule={opt.schedule!r} does not fit training.steps={steps} with optimizer.warmup_steps="
                f"{opt.warmup_steps}{capped}: {e}; lower optimizer.warmup_steps or raise training.steps"
            ) from None


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optim.Schedule:
    final = cfg.lr * cfg.final_lr_ratio
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.schedule == "constant":
        return optim.constant(cfg.lr)
    if cfg.schedule == "warmup_cosine":
        return optim.warmup_cosine(cfg.lr, warmup, total_steps, final=final)
    if cfg.schedule == "warmup_linear":
        return optim.warmup_linear(cfg.lr, warmup, total_steps, final=final)
    return optim.wsd(cfg.lr, warmup, total_steps, decay_fraction=cfg.decay_fraction, final=final)


def build_optimizer(
    cfg: OptimizerConfig,
    total_steps: int,
    *,
    decay_mask: optim.Mask | None = None,
    muon_labels: Callable[[str, Any], str] | None = None,
) -> optim.GradientTransformation:
    """The optimizer the config names (clipping by ``max_norm`` happens in the train step, which has the norm).
    ``decay_mask``: which params are decayed (``optim.decay_mask_from_specs(specs)``; default: matrices).
    ``muon_labels``: muon only, which params are hidden matrices (``optim.muon_labels_from_specs(specs)``;
    default: the 2-D ones)."""
    lr = learning_rate_schedule(cfg, total_steps)
    mask = decay_mask or optim.default_decay_mask
    if cfg.name == "muon":
        import torch  # not at the top: parsing a config does not import torch

        return optim.muon(
            lr,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.ns_steps,
            weight_decay=cfg.weight_decay,
            adjust_lr=cfg.muon_adjust_lr,
            mask=mask,
            labels=muon_labels or optim.default_muon_labels,
            b1=cfg.b1,
            b2=cfg.b2,
            adam_eps=cfg.eps,
            ns_dtype=getattr(torch, cfg.muon_ns_dtype),
        )
    if cfg.name == "adamw":
        return optim.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.name == "lion":
        return optim.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.name == "adafactor":
        decay = cfg.weight_decay or None  # 0: no decay term in the chain
        return optim.adafactor(lr, weight_decay_rate=decay, weight_decay_mask=mask)
    return optim.sgd(lr, momentum=cfg.momentum)


def build_schedule(par: ParallelismConfig, microbatches: int):
    """The pipeline schedule the config names, for ``pp`` ranks and ``microbatches`` microbatches."""
    from . import pipeline

    v = par.stages_per_rank if par.pipeline_schedule == "interleaved_1f1b" else None
    return pipeline.make_schedule(par.pipeline_schedule, par.pp, microbatches, v)
