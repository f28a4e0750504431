"""Qwen3 (dense) on the model interface: ``MODEL = functitan.model.Model(...)`` at the bottom.

Llama's block (RMSNorm, SwiGLU MLP, RoPE, grouped-query attention; those functions come from
``models.llama``) with two differences, both in ``attention``:

- q and k are RMS-normalised per head before RoPE (``q_norm``, ``k_norm``: one ``(head_dim,)`` weight shared
  by all heads). Under tensor parallelism each rank holds a part of the heads, so each sees a part of these
  weights' gradient: the norm is a ``layout.einsum`` whose activation names ``heads``, and the Layout sums
  the weight's gradient over tp (under sequence parallelism ``Layout.param`` already does);
- ``head_dim`` is its own setting (128 in every published size), not ``dim / n_heads``.

The small sizes tie the output head to the token table (``tie_embeddings``); 8B and up have their own head.
The parameter tree follows Hugging Face ``Qwen3ForCausalLM`` one to one (weights ``(out, in)``)::

    embed.weight                        model.embed_tokens.weight
    layers.{i}.attn_norm.weight         model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.{wq,wk,wv,wo}       model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.attn.{q,k}_norm.weight   model.layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp_norm.weight          model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.{w_gate,w_up,w_down} model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                         model.norm.weight
    output.weight                       lm_head.weight                  (absent when tied)

References: Qwen3 technical report (arXiv 2505.09388); QK-norm (arXiv 2302.05442); RoPE (arXiv 2104.09864).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from functitan import model as M
from functitan import rope
from functitan.metrics import transformer_flops_per_token
from functitan.model import HFMap, Param, TensorKey, normal, ones, transformers_major
from functitan.sharding import Layout
from models.llama import mlp, rms_norm

__all__ = [
    "Qwen3Config",
    "CONFIGS",
    "params",
    "apply",
    "loss",
    "flops_per_token",
    "check_layout",
    "stage_model",
    "PIECES",
    "MODEL",
]


@dataclass(frozen=True, kw_only=True)
class Qwen3Config:
    vocab_size: int = 151936
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128  # independent of dim / n_heads
    ffn_dim: int = 3072
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive")
        if self.n_heads % self.n_kv_heads:
            ok = [d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            raise ValueError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
                f"choose n_kv_heads among {ok}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")


_PUBLISHED: dict[str, Any] = dict(
    vocab_size=151936, head_dim=128, n_kv_heads=8, rope_theta=1_000_000.0, max_seq_len=40960
)

CONFIGS: dict[str, Qwen3Config] = {
    # tiny: trains in seconds on a CPU (the trainer sets vocab_size from the tokenizer); head_dim != dim / n_heads
    "debug": Qwen3Config(
        vocab_size=258,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=128,
        max_seq_len=1024,
        tie_embeddings=False,
    ),
    # the published dense checkpoints (Qwen/Qwen3-0.6B ... Qwen/Qwen3-32B)
    "0.6b": Qwen3Config(**_PUBLISHED, dim=1024, n_layers=28, n_heads=16, ffn_dim=3072, tie_embeddings=True),
    "1.7b": Qwen3Config(**_PUBLISHED, dim=2048, n_layers=28, n_heads=16, ffn_dim=6144, tie_embeddings=True),
    "4b": Qwen3Config(**_PUBLISHED, dim=2560, n_layers=36, n_heads=32, ffn_dim=9728, tie_embeddings=True),
    "8b": Qwen3Config(**_PUBLISHED, dim=4096, n_layers=36, n_heads=32, ffn_dim=12288, tie_embeddings=False),
    "14b": Qwen3Config(**_PUBLISHED, dim=5120, n_layers=40, n_heads=40, ffn_dim=17408, tie_embeddings=False),
    "32b": Qwen3Config(**_PUBLISHED, dim=5120, n_layers=64, n_heads=64, ffn_dim=25600, tie_embeddings=False),
}


# ----------------------------------------------------------------------------------------------- params


def params(cfg: Qwen3Config) -> dict[str, Any]:
    """Every parameter, declared once: shape, logical names (what the rules shard) and initializer."""
    d, hd, f, v = cfg.dim, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    w = normal(cfg.init_std)

    def layer() -> dict[str, Any]:
        return {
            "attn_norm": {"weight": Param((d,), ("embed",), ones())},
            "attn": {
                "wq": Param((cfg.n_heads * hd, d), ("heads", "embed"), w),
                "wk": Param((cfg.n_kv_heads * hd, d), ("kv_heads", "embed"), w),
                "wv": Param((cfg.n_kv_heads * hd, d), ("kv_heads", "embed"), w),
                "wo": Param((d, cfg.n_heads * hd), ("embed", "heads"), w),
                "q_norm": {"weight": Param((hd,), ("head_dim",), ones())},  # "head_dim": never sharded
                "k_norm": {"weight": Param((hd,), ("head_dim",), ones())},
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


def flops_per_token(cfg: Qwen3Config, seq_len: int) -> float:
    """Training FLOPs per token (PaLM's formula); an untied token table is a lookup, not a matmul."""
    skip = "" if cfg.tie_embeddings else "embed.weight"
    n = M.count(params(cfg), exclude=lambda name, _: name == skip)
    return transformer_flops_per_token(
        n_params=n, n_layers=cfg.n_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim, seq_len=seq_len
    )


def check_layout(cfg: Qwen3Config, *, tp: int = 1, seq_len: int | None = None, sequence_parallel: bool = False) -> None:
    """Fail before launch when tensor parallelism cannot split this model; name a tp that can."""
    dims = (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim))
    bad = [f"model.{k}={v}" for k, v in dims if v % tp]
    if bad:
        g = math.gcd(cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim)
        ok = [t for t in range(1, g + 1) if g % t == 0]
        raise ValueError(
            f"parallelism.tp={tp} does not divide {', '.join(bad)}; tensor parallelism splits heads, kv "
            f"heads and the MLP width evenly. A tp that works for this model: {max(t for t in ok if t <= tp)} "
            f"(any of {ok})"
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(
            f"sequence parallelism with parallelism.tp={tp} needs training.seq_len divisible by {tp}, got "
            f"{seq_len}; use seq_len={seq_len - seq_len % tp or tp} or set parallelism.sequence_parallel=false"
        )


# ----------------------------------------------------------------------------------------------- compute


def head_norm(x: Tensor, weight: Tensor, eps: float, heads: str, layout: Layout) -> Tensor:
    # x: (batch, seq, local heads, head_dim); RMSNorm over head_dim in fp32, one weight for every head
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return layout.einsum(f"batch seq {heads} head_dim, head_dim -> batch seq {heads} head_dim", xn, weight)


def attention(p: dict[str, Any], x: Tensor, cfg: Qwen3Config, layout: Layout) -> Tensor:
    # x: (batch, seq, embed), the residual layout (sequence shards under sequence parallelism)
    hd, eps = cfg.head_dim, cfg.norm_eps
    q, k, v = layout.einsums(
        x,
        [  # one input gather (sequence parallel) for the three
            ("batch seq embed, heads embed -> batch seq heads", p["wq"]),
            ("batch seq embed, kv_heads embed -> batch seq kv_heads", p["wk"]),
            ("batch seq embed, kv_heads embed -> batch seq kv_heads", p["wv"]),
        ],
    )
    b, s = q.shape[:2]  # the whole sequence; head counts from the (tensor-parallel) local shapes
    q = head_norm(q.view(b, s, -1, hd), p["q_norm"]["weight"], eps, "heads", layout).transpose(1, 2)
    k = head_norm(k.view(b, s, -1, hd), p["k_norm"]["weight"], eps, "kv_heads", layout).transpose(1, 2)
    v = v.view(b, s, -1, hd).transpose(1, 2)  # (batch, local kv heads, seq, head_dim)
    # (seq, head_dim): these tokens' positions (after a KV cache's, this rank's chunks under context parallel)
    cos, sin = layout.rotary(cfg.head_dim, cfg.rope_theta, s, device=q.device, dtype=q.dtype)
    o = layout.attention(
        rope.apply(q, cos, sin), rope.apply(k, cos, sin), v
    )  # causal; grouped-query when fewer kv heads
    o = o.transpose(1, 2).reshape(b, s, -1)  # (batch, seq, local heads * head_dim)
    return layout.einsum("batch seq heads, embed heads -> batch seq embed", o, p["wo"])


def block(p: dict[str, Any], x: Tensor, cfg: Qwen3Config, layout: Layout) -> Tensor:
    """One pre-norm block on compute params."""
    x = x + attention(p["attn"], rms_norm(x, p["attn_norm"]["weight"], cfg.norm_eps, layout), cfg, layout)
    return x + mlp(p["mlp"], rms_norm(x, p["mlp_norm"]["weight"], cfg.norm_eps, layout), layout)


def embed(p: dict[str, Any], tokens: Tensor, cfg: Qwen3Config, layout: Layout) -> Tensor:
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={cfg.max_seq_len}; shorten training.seq_len"
        )
    return layout.embed(tokens, p["embed"]["weight"], cfg.vocab_size)


def head(p: dict[str, Any], x: Tensor, cfg: Qwen3Config, layout: Layout) -> Tensor:
    x = rms_norm(x, p["norm"]["weight"], cfg.norm_eps, layout)
    w = p["embed"]["weight"] if cfg.tie_embeddings else p["output"]["weight"]
    return layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, w)


# ----------------------------------------------------------------------------------------------- Hugging Face

_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}


def hf_tensors(cfg: Qwen3Config) -> dict[str, TensorKey]:
    """``{our dotted name: TensorKey}``: a renaming (the table in the module docstring)."""
    out = {
        "embed.weight": TensorKey(key="model.embed_tokens.weight"),
        "norm.weight": TensorKey(key="model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = TensorKey(key="lm_head.weight")
    for i in range(cfg.n_layers):
        out.update({f"layers.{i}.{ours}": TensorKey(key=f"model.layers.{i}.{hf}") for ours, hf in _HF_LAYER.items()})
    return out


def config_to_hf(cfg: Qwen3Config, *, transformers_version: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``Qwen3ForCausalLM`` (5.x: ``rope_parameters``; 4.x: top-level ``rope_theta``)."""
    d: dict[str, Any] = {
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if transformers_major(transformers_version) >= 5:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    else:
        d["rope_theta"], d["rope_scaling"] = float(cfg.rope_theta), None
    return d


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# key -> the only value functitan's Qwen3 implements
_FIXED = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}


def config_from_hf(d: Mapping[str, Any]) -> Qwen3Config:
    """The Qwen3Config of a ``Qwen3ForCausalLM`` ``config.json``; settings the model does not implement (sliding
    windows, attention biases, RoPE scaling) raise ValueError naming the key. Missing keys take HF's defaults."""
    if d.get("model_type", "qwen3") != "qwen3":
        raise ValueError(
            f"config.json model_type={d['model_type']!r} is not supported; only 'qwen3' (Qwen3ForCausalLM) is"
        )
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a Qwen3ForCausalLM config needs all of {list(_REQUIRED)}")
    for key, value in _FIXED.items():
        if d.get(key, value) != value:
            raise ValueError(
                f"config.json {key}={d[key]!r} is not supported; functitan's Qwen3 implements {key}={value!r}"
            )
    kinds = set(d.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(
            f"config.json layer_types holds {sorted(kinds)}; functitan's Qwen3 implements only 'full_attention'"
        )
    where = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    rope_hf = d.get(where) or {}
    rope_type = rope_hf.get("rope_type", rope_hf.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"config.json {where}.rope_type={rope_type!r} is not supported; functitan's Qwen3 implements 'default' RoPE"
        )
    dim, n_heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    return Qwen3Config(
        vocab_size=int(d["vocab_size"]),
        dim=dim,
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=int(d.get("head_dim") or dim // n_heads),
        ffn_dim=int(d["intermediate_size"]),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_hf.get("rope_theta", d.get("rope_theta", 10000.0))),
        max_seq_len=int(d.get("max_position_embeddings") or 32768),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=float(d.get("initializer_range", 0.02)),
    )


HF = HFMap(
    architecture="Qwen3ForCausalLM",
    config_to_hf=config_to_hf,
    config_from_hf=config_from_hf,
    tensors=hf_tensors,
    tied=lambda cfg: {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {},
)


# the decoder's parts (functitan.model.Pieces); Qwen3-MoE replaces the block alone
PIECES = M.Pieces(
    embed=embed,
    block=block,
    head=head,
    first_keys=lambda cfg: ("embed",),
    last_keys=lambda cfg: ("norm", "embed") if cfg.tie_embeddings else ("norm", "output"),
    attention_dim=lambda cfg: cfg.n_heads * cfg.head_dim,
)


MODEL = M.Model(
    name="qwen3",
    configs=CONFIGS,
    params=params,
    pieces=PIECES,
    flops_per_token=flops_per_token,
    check_layout=check_layout,
    hf=HF,
)

# composed by the library from the pieces above (functitan.model.Pieces)
apply, loss, stage_model = MODEL.apply, MODEL.loss, MODEL.stages
