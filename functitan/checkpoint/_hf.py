"""Hugging Face interop for any model with an ``HFMap``: ``config.json`` + safetensors in, and out.

A model's ``HFMap`` (``functitan.model``) says which HF key each parameter has and how its layout differs (a
transpose, a reshape of a fused projection); this module does the rest for every model alike: structure and
shape checks that name both keys, tied weights, sharded safetensors files, and the run record that lets
``functitan export hf`` rebuild the model from a checkpoint.

Only safetensors and JSON are read: nothing on a load path unpickles, so a checkpoint from the hub can run no
code. Exports follow the ``save_pretrained`` layout (one ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` above the shard size), so
``AutoModelForCausalLM.from_pretrained(out_dir)`` and vLLM read them as they are.

Example::

    cfg, params = load_hf("Llama-3.2-1B", llama.MODEL)    # a local directory; nothing is downloaded
    logits = llama.apply(params, tokens, cfg)
    save_hf(params, llama.MODEL, cfg, "export", dtype=torch.bfloat16)

References: the safetensors format (https://github.com/huggingface/safetensors); transformers' sharded
checkpoints (``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from functitan.model import Model, config_from_dict, config_to_dict, is_param, load_model, transformers_major
from functitan.tree import flatten_with_names, map_with_names

__all__ = [
    "to_hf_state_dict",
    "from_hf_state_dict",
    "save_hf",
    "load_hf",
    "import_hf",
    "is_hf_dir",
    "write_model_config",
    "recorded_model_config",
    "recorded_model",
    "recorded_run_config",
    "hf_model",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _hf_map(model: Model):
    if model.hf is None:
        raise ValueError(
            f"model {model.name!r} declares no Hugging Face mapping (Model.hf); it cannot be imported "
            "from or exported to Hugging Face"
        )
    return model.hf


def _expected(model: Model, cfg: Any) -> list[tuple[str, Any, tuple[int, ...]]]:
    """``[(our dotted name, TensorKey, shape)]`` in flatten order, as params flatten."""
    named, _ = flatten_with_names(model.params(cfg), is_leaf=is_param)
    table = _hf_map(model).tensors(cfg)
    missing = [name for name, _ in named if name not in table]
    if missing:
        raise ValueError(f"model {model.name!r}: HFMap.tensors has no entry for {missing[:5]}; map every parameter")
    return [(name, table[name], p.shape) for name, p in named]


# ----------------------------------------------------------------------------------------------- config


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _config_to_hf(model: Model, cfg: Any, dtype: torch.dtype, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    d = {"architectures": [_hf_map(model).architecture], **_hf_map(model).config_to_hf(cfg)}
    d["dtype" if transformers_major() >= 5 else "torch_dtype"] = _dtype_name(dtype)
    d.update(extra or {})
    return d


def _config_from_hf(model: Model, d: Mapping[str, Any]) -> Any:
    arch = _hf_map(model).architecture
    archs = d.get("architectures") or [arch]
    if arch not in archs:
        raise ValueError(
            f"config.json architectures={archs!r} is not model {model.name!r}'s ({arch!r}); choose the "
            f"model that matches with --model.name"
        )
    return _hf_map(model).config_from_hf(d)


# ----------------------------------------------------------------------------------------------- state dicts


def _full(x: Tensor) -> Tensor:
    """The whole tensor of a (possibly DTensor) leaf; a collective for DTensors, so every rank must call it."""
    return (x.full_tensor() if isinstance(x, DTensor) else x).detach()


def _check_params(params: Any, model: Model, cfg: Any) -> list[tuple[str, Any, Tensor]]:
    """``[(our name, TensorKey, leaf)]`` after checking structure and (global) shapes against ``cfg``."""
    decl = model.params(cfg)
    map_with_names(lambda n, i, x: None, decl, params, is_leaf=is_param, what=(f"{model.name}.params(cfg)", "params"))
    named, _ = flatten_with_names(params)
    out = []
    for (name, hf, shape), (_, x) in zip(_expected(model, cfg), named):
        if not isinstance(x, Tensor):
            raise TypeError(f"params {name!r} ({hf.key!r}) is a {type(x).__name__}, expected a Tensor")
        if tuple(x.shape) != shape:
            raise ValueError(
                f"params {name!r} ({hf.key!r}) has shape {tuple(x.shape)}, expected {shape} for this config"
            )
        out.append((name, hf, x))
    return out


def to_hf_state_dict(params: Any, model: Model, cfg: Any) -> dict[str, Tensor]:
    """HF state dict of ``params``: whole tensors (DTensors are gathered) in HF's layout, same device.

    Tied weights are written once, as ``save_pretrained`` does. Gathering is a collective: call it on every rank.
    """
    return {k: v for _, hf, x in _check_params(params, model, cfg) for k, v in hf.split(_to_hf(hf, _full(x))).items()}


def _to_hf(hf: Any, x: Tensor) -> Tensor:
    return hf.to_theirs(x) if hf.to_theirs is not None else x


def from_hf_state_dict(sd: Mapping[str, Tensor], model: Model, cfg: Any, *, dtype: torch.dtype | None = None) -> Any:
    """The parameter tree of an HF state dict (plain tensors on the state dict's device).

    A missing, extra or mis-shaped tensor raises ValueError naming the HF key and our dotted name. A tied
    weight HF saved anyway (``lm_head.weight``) is accepted when it equals its twin; a different one is an error.
    """
    hfmap = _hf_map(model)
    if hfmap.base_prefix and sd and not any(k.startswith(hfmap.base_prefix) for k in sd):
        sd = {hfmap.base_prefix + k: v for k, v in sd.items()}  # saved from the base model (no head, no prefix)
    expected = _expected(model, cfg)
    known = {k for _, hf, _ in expected for k in hf.keys()}
    ignored = [re.compile(p) for p in hfmap.ignored]
    extra = sorted(k for k in sd if k not in known and not any(p.fullmatch(k) for p in ignored))
    for key, twin in hfmap.tied(cfg).items():
        if key in extra:
            a, b = sd[key], sd.get(twin)
            if b is not None and (a.shape != b.shape or not torch.equal(a, b.to(a))):
                raise ValueError(
                    f"HF tensor {key!r} differs from {twin!r} but the config ties them; untie the "
                    f"weights in config.json to load both"
                )
            extra.remove(key)
    if extra:
        raise ValueError(
            f"HF tensors {extra[:8]} ({len(extra)} in all) map to no {model.name} parameter for this config"
        )
    by_name = {}
    for name, hf, shape in expected:
        missing = [k for k in hf.keys() if k not in sd]
        if missing:
            raise ValueError(f"HF tensor {missing[0]!r} (functitan {name!r}) is missing from the checkpoint")
        x = hf.from_theirs(hf.join(sd)) if hf.from_theirs is not None else hf.join(sd)
        if tuple(x.shape) != shape:
            raise ValueError(
                f"HF tensor {hf.key!r} (functitan {name!r}) has shape {tuple(x.shape)}, expected {shape} from config.json"
            )
        by_name[name] = x if dtype is None else x.to(dtype)
    return map_with_names(lambda name, _: by_name[name], model.params(cfg), is_leaf=is_param)


# ----------------------------------------------------------------------------------------------- files


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Greedy split in order, as ``save_pretrained`` does: a tensor larger than the limit gets a shard alone."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def save_hf(
    params: Any,
    model: Model,
    cfg: Any,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Write ``params`` as an HF model directory (``model.hf``'s architecture): ``config.json`` and safetensors.

    Above ``max_shard_bytes`` the weights go to ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json``. DTensors are gathered one shard file at a time, so a process holds at most
    one shard's worth of whole tensors. Under torch.distributed every rank must call this (gathering is
    collective); only rank 0 writes, and all ranks return once the files are complete. Weight files of an
    earlier export in ``out_dir`` are removed first, so a stale ``model.safetensors`` never shadows new shards.

    Args:
        params: the parameter tree of ``cfg`` (tensors or DTensors).
        model: the model (its ``hf`` mapping names the tensors).
        cfg: the model config.
        out_dir: the directory to write (created if missing).
        max_shard_bytes: the largest shard file (HF's default is 5 GB).
        dtype: cast every tensor to this dtype (e.g. ``torch.bfloat16``); None keeps each tensor's dtype.
        extra_config: further ``config.json`` keys (e.g. ``bos_token_id``, ``eos_token_id``).
    """
    from safetensors.torch import save_file

    entries = _check_params(params, model, cfg)
    out_dtype = dtype or entries[0][2].dtype
    sizes = [x.numel() * (dtype or x.dtype).itemsize for _, _, x in entries]
    shards = _plan_shards(sizes, max_shard_bytes)
    writer = _rank() == 0
    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            if old.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.fullmatch(old.name):
                old.unlink()
    n = len(shards)
    weight_map: dict[str, str] = {}
    for s, members in enumerate(shards):
        fname = WEIGHTS_NAME if n == 1 else f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for i in members:
            _, hf, x = entries[i]
            full = _full(x)  # every rank joins the gather
            if writer:
                for key, part in hf.split(_to_hf(hf, full)).items():
                    tensors[key] = part.to(device="cpu", dtype=dtype or full.dtype).contiguous()
                    weight_map[key] = fname
        if writer:
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
    if writer:
        if n > 1:
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
            (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        config = _config_to_hf(model, cfg, out_dtype, extra_config)
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_hf(
    hf_dir: str | os.PathLike, model: Model, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[Any, Any]:
    """Read an HF model directory of ``model``'s architecture (``config.json`` + safetensors, sharded or not).

    Only safetensors are read (never pickle): a directory with only ``pytorch_model.bin`` is an error.

    Returns:
        ``(cfg, params)``: plain tensors on ``device``, cast to ``dtype`` when given.
    """
    from safetensors import safe_open

    root = Path(hf_dir)
    if not (root / CONFIG_NAME).is_file():
        raise ValueError(f"{root / CONFIG_NAME} not found; load_hf takes a local Hugging Face model directory")
    cfg = _config_from_hf(model, _read_json(root / CONFIG_NAME))
    files: dict[str, list[str] | None]  # file name -> the keys to read from it (None: all of them)
    if (root / WEIGHTS_NAME).is_file():
        files = {WEIGHTS_NAME: None}
    elif (root / INDEX_NAME).is_file():
        weight_map = _read_json(root / INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{root / INDEX_NAME} has no 'weight_map' object")
        by_file: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            by_file.setdefault(fname, []).append(key)
        files = dict(by_file)
    else:
        found = sorted(p.name for p in root.iterdir())
        raise ValueError(
            f"{root} holds no {WEIGHTS_NAME} or {INDEX_NAME} (found {found[:10]}); functitan reads safetensors only, "
            "never pickle: convert .bin weights with transformers' save_pretrained(safe_serialization=True)"
        )
    sd: dict[str, Tensor] = {}
    for fname, keys in files.items():
        if not (root / fname).is_file():
            raise ValueError(f"{root / INDEX_NAME} names {fname!r}, which is missing from {root}")
        try:
            with safe_open(str(root / fname), framework="pt", device=str(device)) as f:
                for key in keys if keys is not None else f.keys():
                    sd[key] = f.get_tensor(key)
        except Exception as e:  # safetensors' SafetensorError (header, size) names no file
            if isinstance(e, (ValueError, OSError)) and str(root / fname) in str(e):
                raise
            raise ValueError(
                f"{root / fname} is not a readable safetensors file ({str(e).strip() or type(e).__name__}); "
                "download it again, or convert the weights with save_pretrained(safe_serialization=True)"
            ) from None
    return cfg, from_hf_state_dict(sd, model, cfg, dtype=dtype)


# ----------------------------------------------------------------------------------------------- run records

MODEL_CONFIG = "model_config.json"  # {"name": --model.name, "config": the model config}, beside checkpoints


def hf_model(hf_dir: str | os.PathLike, name: str | None = None) -> tuple[str, Model]:
    """``(how --model.name spells it, the Model)`` of an HF directory: ``name``'s, else the installed model of
    its ``config.json``'s architecture."""
    from functitan.model import model_for_architecture

    if name is not None:
        return name, load_model(name)
    config = Path(hf_dir) / CONFIG_NAME
    if not config.is_file():
        raise ValueError(f"{config} not found; a local Hugging Face model directory has one")
    archs = _read_json(config).get("architectures") or []
    if not archs:
        raise ValueError(f"{config} names no architectures; pass --model NAME")
    return model_for_architecture(archs[0])


def is_hf_dir(path: str | os.PathLike) -> bool:
    """True for a Hugging Face model directory (config.json and safetensors weights)."""
    root = Path(path)
    return (root / CONFIG_NAME).is_file() and ((root / WEIGHTS_NAME).is_file() or (root / INDEX_NAME).is_file())


def write_model_config(name: str, cfg: Any, directory: str | os.PathLike) -> None:
    """Record the model (as ``--model.name`` resolves it) and its config in ``directory`` (rank 0 writes), so
    ``functitan export hf`` and ``--checkpoint.load_path`` rebuild it."""
    if _rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        record = {"name": name, "config": config_to_dict(cfg)}
        (Path(directory) / MODEL_CONFIG).write_text(json.dumps(record, indent=2))


def recorded_model_config(ckpt_dir: str | os.PathLike) -> tuple[str, dict[str, Any]] | None:
    """``(model name, config dict)`` recorded in ``ckpt_dir`` or the nearest parent (a run directory), or None."""
    start = Path(ckpt_dir).resolve()
    for d in (start, *start.parents):
        if (d / MODEL_CONFIG).is_file():
            record = _read_json(d / MODEL_CONFIG)
            if not isinstance(record, dict) or "name" not in record or "config" not in record:
                raise ValueError(
                    f"{d / MODEL_CONFIG} is not a functitan model record (no 'name' and 'config'); it was "
                    f"written by an older functitan: rewrite it as {{'name': ..., 'config': {{...}}}}"
                )
            return record["name"], record["config"]
    return None


def recorded_run_config(ckpt_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The config of the run that wrote ``ckpt_dir`` (its run directory's ``config.json``, the trainer's record
    beside ``model_config.json``), or None (``import_hf``'s output, a checkpoint copied elsewhere)."""
    start = Path(ckpt_dir).resolve()
    for d in (start, *start.parents):
        if (d / MODEL_CONFIG).is_file():
            run = d / CONFIG_NAME
            record = _read_json(run) if run.is_file() else None
            return record if isinstance(record, dict) and isinstance(record.get("data"), dict) else None
    return None


def recorded_model(ckpt_dir: str | os.PathLike) -> tuple[Model, Any]:
    """The model and config recorded beside ``ckpt_dir``, or a ValueError that says how to fix it."""
    found = recorded_model_config(ckpt_dir)
    if found is None:
        raise ValueError(
            f"no {MODEL_CONFIG} in {Path(ckpt_dir).resolve()} or its parents; the trainer writes one in each run "
            f"directory. Pass the model and its config explicitly for a checkpoint written elsewhere"
        )
    model = load_model(found[0])
    return model, config_from_dict(model.config_type, found[1])


def import_hf(
    hf_dir: str | os.PathLike,
    out_ckpt_dir: str | os.PathLike,
    model: Model,
    *,
    name: str | None = None,
    dtype: torch.dtype | None = None,
) -> Any:
    """Convert an HF directory into a functitan checkpoint holding ``{"params": ...}`` plus its model record.

    The trainer starts from it with ``--checkpoint.load_path=OUT`` (a weights-only load). ``name``: how
    ``--model.name`` spells the model (default ``model.name``).
    """
    from ._save import save_sync

    cfg, params = load_hf(hf_dir, model, dtype=dtype)
    save_sync(out_ckpt_dir, {"params": params})
    write_model_config(name or model.name, cfg, out_ckpt_dir)
    return cfg
