"""The trainer's model setup: which model, which config, fresh or loaded weights, and the checks that run before
any collective. ``run()`` (functitan/train.py) calls ``init_model`` then ``check_model``."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from .checkpoint import is_hf_dir, load_hf, recorded_model_config
from .config import ConfigError
from .job_config import DEFAULT_FLAVOR, DEFAULT_MODEL, JobConfig
from .model import Model, check_names, config_from_dict, config_to_dict, is_param, load_model
from .model import count as count_params
from .model import init as init_params
from .random import fold_in
from .tree import flatten_with_names

__all__ = ["init_model", "check_fits", "check_model", "check_resumed_model"]


def init_model(
    cfg: JobConfig, model: Model | None, rng: int, *, vocab: int, device: torch.device
) -> tuple[str, Model, Any, Any]:
    """``(model name, Model, model config, full params)``.

    The config comes from an HF directory at ``checkpoint.load_path``, else from the model recorded beside a
    functitan ``load_path`` (flags that contradict it are an error naming both values), else from ``[model]``.
    """
    mcfg, load_path = cfg.model, cfg.checkpoint.load_path
    recorded = recorded_model_config(load_path) if load_path and not is_hf_dir(load_path) else None
    name = mcfg.name or (recorded[0] if recorded else DEFAULT_MODEL)
    model = model or load_model(name)
    if load_path and is_hf_dir(load_path):
        model_cfg, params = load_hf(load_path, model, device=device, dtype=torch.float32)
        return name, model, _with_overrides(model, model_cfg, mcfg, f"the Hugging Face model in {load_path}"), params
    if recorded is not None:
        if mcfg.name is not None and mcfg.name != recorded[0]:
            raise ConfigError(
                f"model.name={mcfg.name!r} conflicts with the checkpoint's model {recorded[0]!r} "
                f"(recorded beside {load_path}); drop --model.name or choose another checkpoint.load_path"
            )
        model_cfg = config_from_dict(model.config_type, recorded[1])
        if mcfg.flavor is not None:
            flagged = model.config(mcfg.flavor, **{**dict(mcfg.overrides), "vocab_size": model_cfg.vocab_size})
            _no_conflict(flagged, model_cfg, f"the checkpoint's model (recorded beside {load_path})")
        model_cfg = _with_overrides(model, model_cfg, mcfg, f"the checkpoint's model (recorded beside {load_path})")
    else:
        model_cfg = model.config(mcfg.flavor or DEFAULT_FLAVOR, **{"vocab_size": vocab, **dict(mcfg.overrides)})
    if model_cfg.vocab_size < vocab:
        raise ValueError(
            f"the model's vocab_size {model_cfg.vocab_size} is smaller than the tokenizer's {vocab}; "
            f"set data.tokenizer to the model's tokenizer"
        )
    check_fits(model, model_cfg, mcfg, device)
    return name, model, model_cfg, init_params(model.params(model_cfg), fold_in(rng, "params"), device=device)


def check_fits(model: Model, model_cfg: Any, mcfg: Any, device: torch.device) -> None:
    """Before init allocates: the full fp32 params every local rank draws (``init`` builds them whole, then
    ``place`` keeps the shard) fit in the memory free on ``device``. From the declared shapes only, so any model;
    the optimizer's moments and activations come on top, so this bound is the least a run needs, not all of it.
    ``--model.dim=1048576`` asked for 2.2 TB of the host and died in ``torch.randn`` with a traceback."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1  # one host's memory
    need = 4 * count_params(model.params(model_cfg)) * ranks
    free = _free_bytes(device)
    if free is None or need <= free:
        return
    key = _largest_override(model, model_cfg, mcfg)
    per = f" on each of {ranks} local ranks" if ranks > 1 else ""
    where = "this host" if device.type == "cpu" else str(device)
    raise ConfigError(
        f"{key + ': ' if key else ''}the model ({model.name}, {count_params(model.params(model_cfg)):,} params) "
        f"needs {_gb(need)} to initialise its fp32 parameters{per}, and {where} has {_gb(free)} free; "
        f"{'lower ' + key.split('=')[0] if key else 'choose a smaller model.flavor'}, or train on more memory"
    )


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (host: MemAvailable from /proc/meminfo), None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _largest_override(model: Model, model_cfg: Any, mcfg: Any) -> str:
    """``model.<key>=<value>`` of the ``--model.<key>`` flag whose default would shrink the model most ("" when
    no flag grew it): the key the one-line refusal names."""
    total = count_params(model.params(model_cfg))
    base = model.configs.get(mcfg.flavor or DEFAULT_FLAVOR)
    best, saved = "", 0
    for key in dict(mcfg.overrides):
        if base is None or not hasattr(base, key) or key == "vocab_size":
            continue
        try:
            smaller = total - count_params(model.params(model.replace(model_cfg, **{key: getattr(base, key)})))
        except (ValueError, TypeError):  # that default alone is not a valid config
            continue
        if smaller > saved:
            best, saved = f"model.{key}={getattr(model_cfg, key)}", smaller
    return best


def _gb(n: float) -> str:
    return f"{n / 1e12:.1f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB"


def _with_overrides(model: Model, base: Any, mcfg: Any, what: str) -> Any:
    """``base``, checked against every ``--model.<field>`` flag: a flag that differs from it is a ConfigError."""
    _no_conflict(model.replace(base, **dict(mcfg.overrides)), base, what)
    return base


def _no_conflict(flagged: Any, recorded: Any, what: str) -> None:
    diff = [
        f"{f.name}={getattr(flagged, f.name)!r} vs {getattr(recorded, f.name)!r}"
        for f in dataclasses.fields(recorded)
        if getattr(flagged, f.name) != getattr(recorded, f.name)
    ]
    if diff:
        raise ConfigError(
            f"[model] flags conflict with {what}: {'; '.join(diff)} (flag vs checkpoint); drop the "
            f"[model] flags to train the checkpoint's model, or drop checkpoint.load_path"
        )


def check_model(
    model: Model,
    model_cfg: Any,
    *,
    tp: int,
    pp: int,
    seq_len: int,
    sequence_parallel: bool,
    cp: int = 1,
    cp_attention: str = "allgather",
    ep: int = 1,
) -> None:
    """Before any collective: the model can take this layout, and its contractions name params as declared."""
    pieces = 2 * cp * (tp if sequence_parallel else 1)
    if cp > 1 and seq_len % pieces:
        both = f" x tp={tp} (sequence parallel)" if sequence_parallel and tp > 1 else ""
        raise ValueError(
            f"training.seq_len={seq_len}: context parallelism cuts the sequence into 2 x cp={cp}{both} = {pieces} "
            f"equal chunks; make training.seq_len a multiple of {pieces}"
        )
    if pp > 1 and model.stages is None:
        raise ValueError(
            f"parallelism.pp={pp}: model {model.name!r} declares no pipeline stages (Model.stages); use pp=1"
        )
    named = flatten_with_names(model.params(model_cfg), is_leaf=is_param)[0]
    stacks = sorted({p.shape[p.names.index("experts")] for _, p in named if "experts" in p.names})
    if ep > 1 and not stacks:
        raise ValueError(
            f"parallelism.ep={ep}: model {model.name!r} has no routed experts (no param names an 'experts' dim); use "
            f"ep=1"
        )
    if any(n % ep for n in stacks):
        raise ValueError(
            f"parallelism.ep={ep} does not divide the model's {stacks[0]} routed experts; expert parallelism gives "
            f"each ep rank an equal share: choose an ep that divides {stacks[0]}"
        )
    refused = pipeline_refusal(model, model_cfg, pp)
    if refused:
        raise ValueError(refused)
    if model.check_layout is not None:
        model.check_layout(model_cfg, tp=tp, seq_len=seq_len, sequence_parallel=sequence_parallel)
    check_names(model, model_cfg, tp=tp, sequence_parallel=sequence_parallel, cp=cp, cp_attention=cp_attention)


def pipeline_refusal(model: Model, model_cfg: Any, pp: int) -> str | None:
    """Why ``model`` cannot run under ``pp`` pipeline ranks (one line), or None. A model with mixture-of-experts
    layers returns aux outputs (load, balance loss) from its blocks: stages built from ``Pieces`` carry them
    (``StageModel.aux``); a model with its own ``stages`` and experts is refused, as its stages may drop them.
    The planner asks too, so that it offers no pipelined layout the trainer would refuse."""
    if pp <= 1 or model.pieces is not None:
        return None
    named = flatten_with_names(model.params(model_cfg), is_leaf=is_param)[0]
    experts = [name for name, p in named if "experts" in p.names]
    if not experts:
        return None
    return (
        f"parallelism.pp={pp}: model {model.name!r} has mixture-of-experts layers ({experts[0]} and "
        f"{len(experts) - 1} more params name an 'experts' dim) and gives its own stages, which carry no aux "
        f"outputs (load, balance loss); build it from functitan.model.Pieces (docs/models.md), or use pp=1"
    )


def check_resumed_model(run_dir: Path, name: str, model_cfg: Any) -> None:
    """A run resumes the model its checkpoints hold. Another ``--model.name`` or shape is one line naming the
    fields and the run's record (``model_config.json``), before the restore meets missing keys or shapes."""
    recorded = recorded_model_config(run_dir) if (Path(run_dir) / "model_config.json").is_file() else None
    if recorded is None:
        return
    fix = "drop the flags that differ, or start another run with a new metrics.run_name"
    where = f"the checkpoints of {run_dir} ({Path(run_dir) / 'model_config.json'})"
    if not _same_model_name(recorded[0], name):
        raise ConfigError(f"model.name={name!r} differs from {where}, which hold model {recorded[0]!r}; {fix}")
    ours = json.loads(json.dumps(config_to_dict(model_cfg)))  # as the record stores it (tuples as lists)
    keys = [k for k, v in ours.items() if recorded[1].get(k) != v]
    if keys:
        raise ConfigError(
            f"{', '.join(f'model.{k}={ours[k]!r}' for k in keys)} differ{'s' if len(keys) == 1 else ''} from "
            f"{where}, which hold {', '.join(f'{k}={recorded[1].get(k)!r}' for k in keys)}; {fix}"
        )


def _same_model_name(a: str, b: str) -> bool:
    """Two spellings of one model: the same name, or the same model file (``path.py[:ATTR]``)."""
    if a == b:
        return True
    fa, _, attr_a = a.partition(":")
    fb, _, attr_b = b.partition(":")
    return fa.endswith(".py") and fb.endswith(".py") and attr_a == attr_b and Path(fa).resolve() == Path(fb).resolve()
