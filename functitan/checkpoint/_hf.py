"""Hugging Face interop for the functional Llama: ``config.json`` + safetensors in, and out.

The functional Llama keeps Hugging Face ``LlamaForCausalLM``'s weight layout (``[out, in]`` matrices, RoPE on
``(i, i + head_dim/2)`` pairs), so a conversion is a renaming of keys and nothing else: no permutation, no
transpose. The table is in ``models/llama.py``'s docstring; ``hf_key`` implements it.

Only safetensors and JSON are read: nothing on a load path unpickles, so a checkpoint from the hub can run no
code. Exports follow the ``save_pretrained`` layout (one ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` above the shard size), so
``LlamaForCausalLM.from_pretrained(out_dir)`` and vLLM read them as they are.

Example::

    cfg, params = load_hf("Llama-3.2-1B")              # a local directory; nothing is downloaded
    logits = llama.apply(params, tokens, cfg)
    save_hf(params, cfg, "export", dtype=torch.bfloat16)

References: the safetensors format (https://github.com/huggingface/safetensors); transformers' sharded
checkpoints (``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from functitan.tree import flatten_with_names, map_with_names
from models.llama import LlamaConfig, ParamInfo, RopeScaling, param_shapes

__all__ = [
    "hf_key",
    "config_to_hf",
    "config_from_hf",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "save_hf",
    "load_hf",
    "export_hf_params",
    "import_hf",
    "export_hf",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# our dotted name -> HF key; "{i}" is the layer index
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}
# HF tensors that carry no parameter: old transformers saved RoPE's inverse frequencies as a buffer
_IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_key(name: str) -> str:
    """The HF key of a functitan dotted parameter name: ``layers.3.attn.wq -> model.layers.3.self_attn.q_proj.weight``."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise ValueError(f"parameter {name!r} has no Hugging Face Llama counterpart; expected a name from models.llama.param_shapes")


def _expected(cfg: LlamaConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """``[(our dotted name, HF key, shape)]`` in flatten order (optree sorts dict keys), as params flatten."""
    named, _ = flatten_with_names(param_shapes(cfg), is_leaf=lambda x: isinstance(x, ParamInfo))
    return [(name, hf_key(name), tuple(info.shape)) for name, info in named]


# ----------------------------------------------------------------------------------------------- config


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _transformers_major(version: str | None) -> int:
    if version is None:
        try:
            version = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return 4  # the 4.x layout (top-level rope_theta + rope_scaling) is read by 4.x and 5.x alike
    return int(version.split(".")[0])


def config_to_hf(
    cfg: LlamaConfig,
    *,
    dtype: torch.dtype = torch.float32,
    transformers_version: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of ``LlamaForCausalLM`` for ``cfg``.

    Args:
        cfg: the model config.
        dtype: the dtype of the exported tensors (``dtype``, or ``torch_dtype`` before transformers 5).
        transformers_version: the layout to write; None uses the installed transformers' (5.x: RoPE settings
            under ``rope_parameters``; 4.x: top-level ``rope_theta`` and ``rope_scaling``), and the 4.x layout,
            which both read, when transformers is not installed.
        extra: further keys written as given (e.g. ``bos_token_id``, ``eos_token_id`` of the tokenizer).
    """
    rope: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {
            "rope_type": "llama3",
            "factor": float(s.factor),
            "low_freq_factor": float(s.low_freq_factor),
            "high_freq_factor": float(s.high_freq_factor),
            "original_max_position_embeddings": int(s.original_max_position_embeddings),
        }
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
    }
    if _transformers_major(transformers_version) >= 5:
        d["rope_parameters"] = {**rope, "rope_theta": float(cfg.rope_theta)}
        d["dtype"] = _dtype_name(dtype)
    else:
        d["rope_theta"] = float(cfg.rope_theta)
        d["rope_scaling"] = None if cfg.rope_scaling is None else rope
        d["torch_dtype"] = _dtype_name(dtype)
    d.update(extra or {})
    return d


# HF LlamaConfig's defaults for keys a config.json may leave out
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
                "initializer_range": 0.02, "rope_theta": 10000.0}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# key -> the only value functitan's Llama implements
_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "partial_rotary_factor": 1.0}


def _rope_from_hf(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling``."""
    where = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    rope = d.get(where) or {}
    if not isinstance(rope, Mapping) or any(isinstance(v, Mapping) for v in rope.values()):
        raise ValueError(f"config.json {where}={rope!r} is not supported: expected one flat dict for all layers")
    theta = float(rope.get("rope_theta", d.get("rope_theta", _HF_DEFAULTS["rope_theta"])))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"config.json {where}.rope_type={rope_type!r} is not supported; functitan's Llama implements "
            "'default' and 'llama3' RoPE"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ValueError(f"config.json {where} with rope_type='llama3' lacks {missing}; it needs all of {list(keys)}")
    return theta, RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_position_embeddings=int(rope["original_max_position_embeddings"]))


def config_from_hf(d: Mapping[str, Any]) -> LlamaConfig:
    """The LlamaConfig of a ``LlamaForCausalLM`` ``config.json`` (as a dict).

    Keys that only matter to other code (token ids, ``use_cache``, dropout) are ignored; settings the model
    does not implement raise ValueError naming the key. Missing optional keys take HF LlamaConfig's defaults,
    so a config means here what it means to transformers. ``config_from_hf(config_to_hf(cfg)) == cfg``, except
    that ``n_kv_heads=None`` comes back as ``n_heads``.
    """
    model_type = d.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"config.json model_type={model_type!r} is not supported; only 'llama' (LlamaForCausalLM) is")
    archs = d.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in archs:
        raise ValueError(f"config.json architectures={archs!r} is not supported; only ['LlamaForCausalLM'] is")
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a LlamaForCausalLM config needs all of {list(_REQUIRED)}")
    for key, value in _FIXED.items():
        if d.get(key, value) != value:
            raise ValueError(f"config.json {key}={d[key]!r} is not supported; functitan's Llama implements {key}={value!r}")
    dim, n_heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    head_dim = d.get("head_dim")
    if head_dim is not None and dim % n_heads == 0 and int(head_dim) != dim // n_heads:
        raise ValueError(
            f"config.json head_dim={head_dim} is not supported; functitan's Llama has head_dim = hidden_size / "
            f"num_attention_heads = {dim // n_heads}"
        )
    theta, scaling = _rope_from_hf(d)
    opt = {k: default if d.get(k) is None else d[k] for k, default in _HF_DEFAULTS.items()}
    return LlamaConfig(
        vocab_size=int(d["vocab_size"]), dim=dim, n_layers=int(d["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads), ffn_dim=int(d["intermediate_size"]),
        norm_eps=float(opt["rms_norm_eps"]), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=int(opt["max_position_embeddings"]), tie_embeddings=bool(opt["tie_word_embeddings"]),
        init_std=float(opt["initializer_range"]),
    )


# ----------------------------------------------------------------------------------------------- state dicts


def _full(x: Tensor) -> Tensor:
    """The whole tensor of a (possibly DTensor) leaf; a collective for DTensors, so every rank must call it."""
    return (x.full_tensor() if isinstance(x, DTensor) else x).detach()


def _check_params(params: Any, cfg: LlamaConfig) -> list[tuple[str, str, Tensor]]:
    """``[(our name, HF key, leaf)]`` after checking structure and (global) shapes against ``cfg``."""
    shapes = param_shapes(cfg)
    map_with_names(lambda n, i, x: None, shapes, params, is_leaf=lambda x: isinstance(x, ParamInfo),
                   what=(f"param_shapes(cfg) of {type(cfg).__name__}", "params"))
    named, _ = flatten_with_names(params)
    out = []
    for (name, key, shape), (_, x) in zip(_expected(cfg), named):
        if not isinstance(x, Tensor):
            raise TypeError(f"params {name!r} ({key!r}) is a {type(x).__name__}, expected a Tensor")
        if tuple(x.shape) != shape:
            raise ValueError(f"params {name!r} ({key!r}) has shape {tuple(x.shape)}, expected {shape} for this config")
        out.append((name, key, x))
    return out


def to_hf_state_dict(params: Any, cfg: LlamaConfig) -> dict[str, Tensor]:
    """HF ``LlamaForCausalLM`` state dict of ``params``: whole tensors (DTensors are gathered), same device.

    With tied embeddings no ``lm_head.weight`` is written, as ``save_pretrained`` does. Gathering is a
    collective: call it on every rank.
    """
    return {key: _full(x) for _, key, x in _check_params(params, cfg)}


def from_hf_state_dict(sd: Mapping[str, Tensor], cfg: LlamaConfig, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The parameter tree of an HF Llama state dict (plain tensors on the state dict's device).

    A missing, extra or mis-shaped tensor raises ValueError naming the HF key and our dotted name. With tied
    embeddings an ``lm_head.weight`` equal to the embedding is accepted and dropped; a different one is an error.
    """
    expected = _expected(cfg)
    known = {key for _, key, _ in expected}
    extra = sorted(k for k in sd if k not in known and not _IGNORED_HF.fullmatch(k))
    if cfg.tie_embeddings and "lm_head.weight" in extra:
        head, embed = sd["lm_head.weight"], sd.get("model.embed_tokens.weight")
        if embed is not None and (head.shape != embed.shape or not torch.equal(head, embed.to(head))):
            raise ValueError(
                "HF tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' (functitan 'embed.weight') but "
                "config.json has tie_word_embeddings=true; set tie_word_embeddings=false to load it as 'output.weight'"
            )
        extra.remove("lm_head.weight")
    if extra:
        raise ValueError(f"HF tensors {extra[:8]} ({len(extra)} in all) map to no functitan Llama parameter for this config")
    by_name = {}
    for name, key, shape in expected:
        if key not in sd:
            raise ValueError(f"HF tensor {key!r} (functitan {name!r}) is missing from the checkpoint")
        x = sd[key]
        if tuple(x.shape) != shape:
            raise ValueError(
                f"HF tensor {key!r} (functitan {name!r}) has shape {tuple(x.shape)}, expected {shape} from config.json"
            )
        by_name[name] = x if dtype is None else x.to(dtype)
    return map_with_names(lambda name, _: by_name[name], param_shapes(cfg), is_leaf=lambda x: isinstance(x, ParamInfo))


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
    cfg: LlamaConfig,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Write ``params`` as an HF ``LlamaForCausalLM`` directory: ``config.json`` and safetensors.

    Above ``max_shard_bytes`` the weights go to ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json``. DTensors are gathered one shard file at a time, so a process holds at most
    one shard's worth of whole tensors. Under torch.distributed every rank must call this (gathering is
    collective); only rank 0 writes, and all ranks return once the files are complete. Weight files of an
    earlier export in ``out_dir`` are removed first, so a stale ``model.safetensors`` never shadows new shards.

    Args:
        params: the parameter tree of ``cfg`` (tensors or DTensors).
        cfg: the model config.
        out_dir: the directory to write (created if missing).
        max_shard_bytes: the largest shard file (HF's default is 5 GB).
        dtype: cast every tensor to this dtype (e.g. ``torch.bfloat16``); None keeps each tensor's dtype.
        extra_config: further ``config.json`` keys (e.g. ``bos_token_id``, ``eos_token_id``).
    """
    from safetensors.torch import save_file

    entries = _check_params(params, cfg)
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
            _, key, x = entries[i]
            full = _full(x)  # every rank joins the gather
            if writer:
                tensors[key] = full.to(device="cpu", dtype=dtype or full.dtype).contiguous()
                weight_map[key] = fname
        if writer:
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
    if writer:
        if n > 1:
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
            (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        config = config_to_hf(cfg, dtype=out_dtype, extra=extra_config)
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_hf(
    hf_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[LlamaConfig, dict[str, Any]]:
    """Read an HF ``LlamaForCausalLM`` directory (``config.json`` + safetensors, sharded or not).

    Only safetensors are read (never pickle): a directory with only ``pytorch_model.bin`` is an error.

    Returns:
        ``(cfg, params)``: plain tensors on ``device``, cast to ``dtype`` when given.
    """
    from safetensors import safe_open

    root = Path(hf_dir)
    if not (root / CONFIG_NAME).is_file():
        raise ValueError(f"{root / CONFIG_NAME} not found; load_hf takes a local Hugging Face model directory")
    cfg = config_from_hf(_read_json(root / CONFIG_NAME))
    if (root / WEIGHTS_NAME).is_file():
        files = {WEIGHTS_NAME: None}
    elif (root / INDEX_NAME).is_file():
        weight_map = _read_json(root / INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{root / INDEX_NAME} has no 'weight_map' object")
        files = {}
        for key, fname in weight_map.items():
            files.setdefault(fname, []).append(key)
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
        with safe_open(str(root / fname), framework="pt", device=str(device)) as f:
            for key in keys if keys is not None else f.keys():
                sd[key] = f.get_tensor(key)
    return cfg, from_hf_state_dict(sd, cfg, dtype=dtype)


# ----------------------------------------------------------------------------------------------- glue


def export_hf_params(params: Any, cfg: LlamaConfig, out_dir: str | os.PathLike, **kwargs: Any) -> None:
    """``save_hf`` under the name the CLI uses; ``kwargs`` as ``save_hf``'s."""
    save_hf(params, cfg, out_dir, **kwargs)


MODEL_CONFIG = "model_config.json"  # the model's HF config.json, kept beside functitan checkpoints


def is_hf_dir(path: str | os.PathLike) -> bool:
    """True for a Hugging Face model directory (config.json and safetensors weights)."""
    root = Path(path)
    return (root / CONFIG_NAME).is_file() and ((root / WEIGHTS_NAME).is_file() or (root / INDEX_NAME).is_file())


def write_model_config(cfg: LlamaConfig, directory: str | os.PathLike) -> None:
    """Record ``cfg`` (as an HF config) in ``directory`` so ``export_hf`` can rebuild the model (rank 0 writes)."""
    if _rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / MODEL_CONFIG).write_text(json.dumps(config_to_hf(cfg), indent=2))


def recorded_model_config(ckpt_dir: str | os.PathLike) -> LlamaConfig | None:
    """The model config recorded in ``ckpt_dir`` or the nearest parent (a run directory), or None."""
    start = Path(ckpt_dir).resolve()
    for d in (start, *start.parents):
        if (d / MODEL_CONFIG).is_file():
            return config_from_hf(_read_json(d / MODEL_CONFIG))
    return None


def find_model_config(ckpt_dir: str | os.PathLike) -> LlamaConfig:
    """``recorded_model_config`` or a ValueError that says how to fix it."""
    found = recorded_model_config(ckpt_dir)
    if found is not None:
        return found
    start = Path(ckpt_dir).resolve()
    raise ValueError(
        f"no {MODEL_CONFIG} in {start} or its parents; the trainer writes one in each run directory. Pass the "
        f"model config explicitly (export_hf(..., cfg=...)) for a checkpoint written elsewhere"
    )


def import_hf(hf_dir: str | os.PathLike, out_ckpt_dir: str | os.PathLike, *, dtype: torch.dtype | None = None) -> LlamaConfig:
    """Convert an HF directory into a functitan checkpoint holding ``{"params": ...}`` plus its model config.

    The trainer starts from it with ``--checkpoint.load_path=OUT`` (a weights-only load).
    """
    from ._save import save_sync

    cfg, params = load_hf(hf_dir, dtype=dtype)
    save_sync(out_ckpt_dir, {"params": params})
    write_model_config(cfg, out_ckpt_dir)
    return cfg


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, cfg: LlamaConfig | None = None, **kwargs: Any) -> LlamaConfig:
    """Convert a functitan checkpoint (a trainer's step directory, or ``import_hf``'s output) into an HF
    directory. ``cfg`` defaults to the model config recorded beside the checkpoint."""
    from ._manager import ITEM, restore_params
    from models import llama

    cfg = cfg or find_model_config(ckpt_dir)
    item = Path(ckpt_dir) / ITEM if (Path(ckpt_dir) / ITEM).is_dir() else Path(ckpt_dir)
    # restore in the dtype the checkpoint holds (the exemplar's dtype must match: no silent casts)
    array = item / "params.embed.weight" / "zarr.json"
    dtype = getattr(torch, _read_json(array).get("data_type", "float32"), torch.float32) if array.is_file() else torch.float32
    params = restore_params(item, llama.init(cfg, 0, device="meta", dtype=dtype))
    save_hf(params, cfg, out_dir, **kwargs)
    return cfg
