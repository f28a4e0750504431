"""Llama 3 as pure functions: ``init(cfg, key)``, ``specs(cfg)``, ``apply(params, tokens, cfg, layout)``.

The whole model reads in one sitting and is written for one device. Sharding lives beside it: ``specs``
names every parameter dim, and the Layout argument turns the logical names into collectives. The parameter
tree follows Hugging Face ``LlamaForCausalLM`` one to one (weights ``[out, in]``, RoPE on dimension pairs
``(i, i + head_dim/2)`` as HF's ``rotate_half``), so importing and exporting HF checkpoints is a renaming::

    embed.weight                    model.embed_tokens.weight          (vocab, embed)
    layers.{i}.attn_norm.weight     model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.{wq,wk,wv,wo}   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.mlp_norm.weight      model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.{w_gate,w_up,w_down}  model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                     model.norm.weight
    output.weight                   lm_head.weight                      (absent when embeddings are tied)

References: Llama 3 (arXiv 2407.21783); RoPE (arXiv 2104.09864); GQA (arXiv 2305.13245); SwiGLU
(arXiv 2002.05202); RMSNorm (arXiv 1910.07467).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from functitan import model as M
from functitan import rope
from functitan.metrics import transformer_flops_per_token
from functitan.model import HFMap, Param, TensorKey, normal, ones, transformers_major
from functitan.random import PRNGKey
from functitan.sharding import Layout

__all__ = [
    "LlamaConfig",
    "RopeScaling",
    "CONFIGS",
    "config",
    "init",
    "specs",
    "apply",
    "loss",
    "params",
    "num_params",
    "flops_per_token",
    "MODEL",
    "check_layout",
    "stage_model",
    "embed",
    "head",
    "block",
    "rope_tables",
]


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 frequency scaling of RoPE (HF ``rope_type="llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 258
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: multi-head attention (n_kv_heads = n_heads)
    ffn_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive")
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; choose n_heads among "
                f"{_divisors(self.dim)[:12]} or change dim"
            )
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; choose "
                f"n_kv_heads among {_divisors(self.n_heads)}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE; change model.dim or model.n_heads"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_LLAMA31_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

CONFIGS: dict[str, LlamaConfig] = {
    # Trains in seconds on a CPU with the byte tokenizer.
    "debug": LlamaConfig(vocab_size=258, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=1024),
    # Published shapes (Llama 3.2 1B; Llama 3.1 8B, 70B, 405B).
    "llama3_1b": LlamaConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        rope_scaling=_LLAMA32_ROPE,
        max_seq_len=131072,
        tie_embeddings=True,
    ),
    "llama3_8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_scaling=_LLAMA31_ROPE,
        max_seq_len=131072,
    ),
    "llama3_70b": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        rope_scaling=_LLAMA31_ROPE,
        max_seq_len=131072,
    ),
    "llama3_405b": LlamaConfig(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        rope_scaling=_LLAMA31_ROPE,
        max_seq_len=131072,
    ),
}


def config(name: str, **overrides: Any) -> LlamaConfig:
    """A named config with field overrides: ``config("debug", n_layers=2)``."""
    if name not in CONFIGS:
        raise ValueError(f"unknown Llama config {name!r}; choose one of {sorted(CONFIGS)}")
    from dataclasses import replace

    return replace(CONFIGS[name], **overrides)


def check_layout(cfg: LlamaConfig, *, tp: int = 1, seq_len: int | None = None, sequence_parallel: bool = False) -> None:
    """Fail before launch when a tensor-parallel layout cannot split this model; name a layout that can."""
    problems = [
        f"model.{k}={v}"
        for k, v in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads), ("ffn_dim", cfg.ffn_dim))
        if v % tp
    ]
    if problems:
        ok = [d for d in _divisors(math.gcd(cfg.n_heads, cfg.kv_heads, cfg.ffn_dim)) if d <= max(tp, 1)]
        raise ValueError(
            f"parallelism.tp={tp} does not divide {', '.join(problems)}; tensor parallelism splits heads, kv heads and "
            f"the MLP width evenly. A tp that works for this model: {ok[-1]} (any of {_divisors(math.gcd(cfg.n_heads, cfg.kv_heads, cfg.ffn_dim))})"
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(
            f"sequence parallelism with parallelism.tp={tp} needs training.seq_len divisible by {tp}, got {seq_len}; "
            f"use seq_len={seq_len - seq_len % tp or tp} or set parallelism.sequence_parallel=false"
        )


# ----------------------------------------------------------------------------------------------- params


def params(cfg: LlamaConfig) -> dict[str, Any]:
    """Every parameter, declared once: shape, logical names (what the rules shard) and initializer."""
    d, hd, f, v = cfg.dim, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    w = normal(cfg.init_std)

    def layer() -> dict[str, Any]:
        return {
            "attn_norm": {"weight": Param((d,), ("embed",), ones())},
            "attn": {
                "wq": Param((cfg.n_heads * hd, d), ("heads", "embed"), w),
                "wk": Param((cfg.kv_heads * hd, d), ("kv_heads", "embed"), w),
                "wv": Param((cfg.kv_heads * hd, d), ("kv_heads", "embed"), w),
                "wo": Param((d, cfg.n_heads * hd), ("embed", "heads"), w),
            },
            "mlp_norm": {"weight": Param((d,), ("embed",), ones())},
            "mlp": {
                "w_gate": Param((f, d), ("mlp", "embed"), w),
                "w_up": Param((f, d), ("mlp", "embed"), w),
                "w_down": Param((d, f), ("embed", "mlp"), w),
            },
        }

    tree: dict[str, Any] = {
        "embed": {"weight": Param((v, d), ("vocab", "embed"), w)},
        "layers": [layer() for _ in range(cfg.n_layers)],
        "norm": {"weight": Param((d,), ("embed",), ones())},
    }
    if not cfg.tie_embeddings:
        tree["output"] = {"weight": Param((v, d), ("vocab", "embed"), w)}
    return tree


def specs(cfg: LlamaConfig) -> dict[str, Any]:
    """Logical axis names of every parameter dim (derived from ``params``)."""
    return M.specs(params(cfg))


def init(
    cfg: LlamaConfig, key: PRNGKey, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """Fresh parameters (``functitan.model.init`` of ``params(cfg)``): bit-identical on every device and mesh."""
    return M.init(params(cfg), key, device=device, dtype=dtype)


def num_params(cfg: LlamaConfig, *, embedding: bool = True) -> int:
    """Parameter count; ``embedding=False`` leaves out an untied embedding table (a lookup, not a matmul)."""
    skip = "" if embedding or cfg.tie_embeddings else "embed.weight"
    return M.count(params(cfg), exclude=lambda name, _: name == skip)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter plus causal attention (PaLM's formula)."""
    return transformer_flops_per_token(
        n_params=num_params(cfg, embedding=False),
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        seq_len=seq_len,
    )


# ----------------------------------------------------------------------------------------------- compute


def rope_tables(
    cfg: LlamaConfig, seq_len: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of shape (seq, head_dim), HF layout (``functitan.rope``)."""
    return rope.tables(cfg.head_dim, cfg.rope_theta, seq_len, scaling=cfg.rope_scaling, device=device, dtype=dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float, layout: Layout) -> Tensor:
    # x: (batch, seq, embed); normalised in fp32, as HF does
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return layout.einsum("batch seq embed, embed -> batch seq embed", xn, weight)


def attention(p: dict[str, Tensor], x: Tensor, cfg: LlamaConfig, layout: Layout) -> Tensor:
    # x: (batch, seq, embed), the residual layout (sequence shards under sequence parallelism)
    hd = cfg.head_dim
    q, k, v = layout.einsums(
        x,
        [  # one input gather (sequence parallel) for the three
            ("batch seq embed, heads embed -> batch seq heads", p["wq"]),
            ("batch seq embed, kv_heads embed -> batch seq kv_heads", p["wk"]),
            ("batch seq embed, kv_heads embed -> batch seq kv_heads", p["wv"]),
        ],
    )
    # q, k, v hold the whole sequence; head counts come from the (possibly tensor-parallel) local shapes
    b, s = q.shape[:2]
    # (seq, head_dim): these tokens' positions (after a KV cache's, this rank's chunks under context parallel)
    cos, sin = layout.rotary(cfg.head_dim, cfg.rope_theta, s, scaling=cfg.rope_scaling, device=q.device, dtype=q.dtype)
    q = q.view(b, s, -1, hd).transpose(1, 2)  # (batch, local_heads, seq, head_dim)
    k = k.view(b, s, -1, hd).transpose(1, 2)  # (batch, local_kv_heads, seq, head_dim)
    v = v.view(b, s, -1, hd).transpose(1, 2)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    o = layout.attention(q, k, v)  # causal; grouped-query when fewer kv heads
    o = o.transpose(1, 2).reshape(b, s, -1)  # (batch, seq, local_heads * head_dim)
    return layout.einsum("batch seq heads, embed heads -> batch seq embed", o, p["wo"])


def mlp(p: dict[str, Tensor], x: Tensor, layout: Layout) -> Tensor:
    gate, up = layout.einsums(
        x,
        [
            ("batch seq embed, mlp embed -> batch seq mlp", p["w_gate"]),
            ("batch seq embed, mlp embed -> batch seq mlp", p["w_up"]),
        ],
    )
    return layout.einsum("batch seq mlp, embed mlp -> batch seq embed", F.silu(gate) * up, p["w_down"])


def block(p: dict[str, Any], x: Tensor, cfg: LlamaConfig, layout: Layout) -> Tensor:
    """One transformer block on compute params: pre-norm attention and SwiGLU MLP with residuals."""
    x = x + attention(p["attn"], rms_norm(x, p["attn_norm"]["weight"], cfg.norm_eps, layout), cfg, layout)
    return x + mlp(p["mlp"], rms_norm(x, p["mlp_norm"]["weight"], cfg.norm_eps, layout), layout)


def embed(params: dict[str, Any], tokens: Tensor, cfg: LlamaConfig, layout: Layout = Layout()) -> Tensor:
    """Token embeddings ``(batch, seq, embed)`` on compute params (the first pipeline piece)."""
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={cfg.max_seq_len}; raise max_seq_len or shorten training.seq_len"
        )
    return layout.embed(tokens, params["embed"]["weight"], cfg.vocab_size)


def head(params: dict[str, Any], x: Tensor, cfg: LlamaConfig, layout: Layout = Layout()) -> Tensor:
    """Final norm and output projection on compute params -> logits ``(batch, seq, vocab)`` (the last piece)."""
    x = rms_norm(x, params["norm"]["weight"], cfg.norm_eps, layout)
    w = params["embed"]["weight"] if cfg.tie_embeddings else params["output"]["weight"]
    return layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, w)


# ----------------------------------------------------------------------------------------------- Hugging Face
# The parameter tree follows LlamaForCausalLM one to one (the table in the module docstring): a renaming.

_HF_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER = {
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


def hf_tensors(cfg: LlamaConfig) -> dict[str, TensorKey]:
    """``{our dotted name: TensorKey}`` for every parameter of ``cfg``."""
    out = {
        name: TensorKey(key=key) for name, key in _HF_TOP.items() if name != "output.weight" or not cfg.tie_embeddings
    }
    for i in range(cfg.n_layers):
        out.update({f"layers.{i}.{name}": TensorKey(key=f"model.layers.{i}.{key}") for name, key in _HF_LAYER.items()})
    return out


def config_to_hf(cfg: LlamaConfig, *, transformers_version: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``LlamaForCausalLM`` for ``cfg`` (the exporter adds the dtype).

    ``transformers_version``: the layout to write; None uses the installed transformers' (5.x: RoPE settings
    under ``rope_parameters``; 4.x: top-level ``rope_theta`` and ``rope_scaling``), and the 4.x layout, which
    both read, when transformers is not installed.
    """
    rope_hf: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope_hf = {
            "rope_type": "llama3",
            "factor": float(s.factor),
            "low_freq_factor": float(s.low_freq_factor),
            "high_freq_factor": float(s.high_freq_factor),
            "original_max_position_embeddings": int(s.original_max_position_embeddings),
        }
    d: dict[str, Any] = {
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
    if transformers_major(transformers_version) >= 5:
        d["rope_parameters"] = {**rope_hf, "rope_theta": float(cfg.rope_theta)}
    else:
        d["rope_theta"] = float(cfg.rope_theta)
        d["rope_scaling"] = None if cfg.rope_scaling is None else rope_hf
    return d


# HF LlamaConfig's defaults for keys a config.json may leave out
_HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "rope_theta": 10000.0,
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# key -> the only value functitan's Llama implements
_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "partial_rotary_factor": 1.0}


def _rope_from_hf(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling``."""
    where = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    rope_hf = d.get(where) or {}
    if not isinstance(rope_hf, Mapping) or any(isinstance(v, Mapping) for v in rope_hf.values()):
        raise ValueError(f"config.json {where}={rope_hf!r} is not supported: expected one flat dict for all layers")
    theta = float(rope_hf.get("rope_theta", d.get("rope_theta", _HF_DEFAULTS["rope_theta"])))
    rope_type = rope_hf.get("rope_type", rope_hf.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"config.json {where}.rope_type={rope_type!r} is not supported; functitan's Llama implements "
            "'default' and 'llama3' RoPE"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope_hf]
    if missing:
        raise ValueError(f"config.json {where} with rope_type='llama3' lacks {missing}; it needs all of {list(keys)}")
    return theta, RopeScaling(
        factor=float(rope_hf["factor"]),
        low_freq_factor=float(rope_hf["low_freq_factor"]),
        high_freq_factor=float(rope_hf["high_freq_factor"]),
        original_max_position_embeddings=int(rope_hf["original_max_position_embeddings"]),
    )


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
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a LlamaForCausalLM config needs all of {list(_REQUIRED)}")
    for key, value in _FIXED.items():
        if d.get(key, value) != value:
            raise ValueError(
                f"config.json {key}={d[key]!r} is not supported; functitan's Llama implements {key}={value!r}"
            )
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
        vocab_size=int(d["vocab_size"]),
        dim=dim,
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        ffn_dim=int(d["intermediate_size"]),
        norm_eps=float(opt["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(opt["max_position_embeddings"]),
        tie_embeddings=bool(opt["tie_word_embeddings"]),
        init_std=float(opt["initializer_range"]),
    )


# ----------------------------------------------------------------------------------------------- torchtitan
# torchtitan's Llama 3 (its DCP checkpoints' keys) keeps Meta's RoPE on interleaved pairs (2j, 2j + 1); HF's
# layout, ours, pairs (j, j + head_dim/2). The q and k rows convert by HF's own permutation, per head.

_TT_TOP = {"embed.weight": "tok_embeddings.weight", "norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
_TT_LAYER = {
    "attn_norm.weight": "attention_norm.weight",
    "attn.wq": "attention.qkv_linear.wq.weight",
    "attn.wk": "attention.qkv_linear.wk.weight",
    "attn.wv": "attention.qkv_linear.wv.weight",
    "attn.wo": "attention.wo.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "mlp.w_gate": "feed_forward.w1.weight",
    "mlp.w_up": "feed_forward.w3.weight",
    "mlp.w_down": "feed_forward.w2.weight",
}


def _rows_to_hf(heads: int) -> Any:
    """Meta's interleaved rotary rows -> HF's halves: (heads * head_dim, in), pairs (2j, 2j+1) -> (j, j+hd/2)."""
    return lambda w: w.reshape(heads, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape).contiguous()


def _rows_to_meta(heads: int) -> Any:
    """The inverse of ``_rows_to_hf``."""
    return lambda w: w.reshape(heads, 2, -1, w.shape[-1]).transpose(1, 2).reshape(w.shape).contiguous()


def torchtitan_tensors(cfg: LlamaConfig) -> dict[str, TensorKey]:
    """``{our dotted name: TensorKey}`` in torchtitan's Llama 3 state-dict names (torchtitan 0.3)."""
    top = {
        "embed.weight": TensorKey(key=_TT_TOP["embed.weight"], also=("lm_head.weight",) if cfg.tie_embeddings else ())
    }
    top["norm.weight"] = TensorKey(key=_TT_TOP["norm.weight"])
    if not cfg.tie_embeddings:
        top["output.weight"] = TensorKey(key=_TT_TOP["output.weight"])
    rows = {
        "attn.wq": (_rows_to_meta(cfg.n_heads), _rows_to_hf(cfg.n_heads)),
        "attn.wk": (_rows_to_meta(cfg.kv_heads), _rows_to_hf(cfg.kv_heads)),
    }
    out = dict(top)
    for i in range(cfg.n_layers):
        for name, key in _TT_LAYER.items():
            to, back = rows.get(name, (None, None))
            out[f"layers.{i}.{name}"] = TensorKey(key=f"layers.{i}.{key}", to_theirs=to, from_theirs=back)
    return out


HF = HFMap(
    architecture="LlamaForCausalLM",
    config_to_hf=config_to_hf,
    config_from_hf=config_from_hf,
    tensors=hf_tensors,
    tied=lambda cfg: {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {},
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),  # a buffer old transformers saved
)


MODEL = M.Model(
    name="llama",
    configs=CONFIGS,
    params=params,
    pieces=M.Pieces(
        embed=embed,
        block=block,
        head=head,
        first_keys=lambda cfg: ("embed",),
        last_keys=lambda cfg: ("norm", "embed") if cfg.tie_embeddings else ("norm", "output"),
    ),
    flops_per_token=flops_per_token,
    check_layout=check_layout,
    hf=HF,
    torchtitan=torchtitan_tensors,
)

# composed by the library from the pieces above (functitan.model.Pieces)
apply, loss, stage_model = MODEL.apply, MODEL.loss, MODEL.stages
