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
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from functitan.random import PRNGKey, fold_in, generator
from functitan.sharding import Layout
from functitan.tree import flatten_with_names, map_with_names

__all__ = [
    "LlamaConfig",
    "RopeScaling",
    "CONFIGS",
    "config",
    "init",
    "specs",
    "apply",
    "loss",
    "param_shapes",
    "num_params",
    "check_layout",
    "stage_model",
    "embed",
    "blocks",
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
            raise ValueError(f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE; change model.dim or model.n_heads")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

CONFIGS: dict[str, LlamaConfig] = {
    # Trains in seconds on a CPU with the byte tokenizer.
    "debug": LlamaConfig(vocab_size=258, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=1024),
    # Published shapes (Llama 3.2 1B; Llama 3.1 8B, 70B, 405B).
    "llama3_1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                             rope_scaling=_LLAMA32_ROPE, max_seq_len=131072, tie_embeddings=True),
    "llama3_8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             rope_scaling=_LLAMA31_ROPE, max_seq_len=131072),
    "llama3_70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              rope_scaling=_LLAMA31_ROPE, max_seq_len=131072),
    "llama3_405b": LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                               rope_scaling=_LLAMA31_ROPE, max_seq_len=131072),
}


def config(name: str, **overrides: Any) -> LlamaConfig:
    """A named config with field overrides: ``config("debug", n_layers=2)``."""
    if name not in CONFIGS:
        raise ValueError(f"unknown Llama config {name!r}; choose one of {sorted(CONFIGS)}")
    from dataclasses import replace

    return replace(CONFIGS[name], **overrides)


def check_layout(cfg: LlamaConfig, *, tp: int = 1, seq_len: int | None = None, sequence_parallel: bool = False) -> None:
    """Fail before launch when a tensor-parallel layout cannot split this model; name a layout that can."""
    problems = [f"model.{k}={v}" for k, v in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads), ("ffn_dim", cfg.ffn_dim)) if v % tp]
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


class ParamInfo(NamedTuple):
    shape: tuple[int, ...]
    std: float | None  # None: ones (norm weights)


def param_shapes(cfg: LlamaConfig) -> dict[str, Any]:
    """The parameter tree with a ParamInfo(shape, init std) per leaf: the one place shapes are written."""
    d, hd, f, v = cfg.dim, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    std = cfg.init_std

    def layer() -> dict[str, Any]:
        return {
            "attn_norm": {"weight": ParamInfo((d,), None)},
            "attn": {
                "wq": ParamInfo((cfg.n_heads * hd, d), std),
                "wk": ParamInfo((cfg.kv_heads * hd, d), std),
                "wv": ParamInfo((cfg.kv_heads * hd, d), std),
                "wo": ParamInfo((d, cfg.n_heads * hd), std),
            },
            "mlp_norm": {"weight": ParamInfo((d,), None)},
            "mlp": {
                "w_gate": ParamInfo((f, d), std),
                "w_up": ParamInfo((f, d), std),
                "w_down": ParamInfo((d, f), std),
            },
        }

    tree: dict[str, Any] = {
        "embed": {"weight": ParamInfo((v, d), std)},
        "layers": [layer() for _ in range(cfg.n_layers)],
        "norm": {"weight": ParamInfo((d,), None)},
    }
    if not cfg.tie_embeddings:
        tree["output"] = {"weight": ParamInfo((v, d), std)}
    return tree


def specs(cfg: LlamaConfig) -> dict[str, Any]:
    """Logical axis names of every parameter dim (mirrors ``init``'s tree)."""

    def layer() -> dict[str, Any]:
        return {
            "attn_norm": {"weight": ("embed",)},
            "attn": {
                "wq": ("heads", "embed"),
                "wk": ("kv_heads", "embed"),
                "wv": ("kv_heads", "embed"),
                "wo": ("embed", "heads"),
            },
            "mlp_norm": {"weight": ("embed",)},
            "mlp": {"w_gate": ("mlp", "embed"), "w_up": ("mlp", "embed"), "w_down": ("embed", "mlp")},
        }

    tree: dict[str, Any] = {
        "embed": {"weight": ("vocab", "embed")},
        "layers": [layer() for _ in range(cfg.n_layers)],
        "norm": {"weight": ("embed",)},
    }
    if not cfg.tie_embeddings:
        tree["output"] = {"weight": ("vocab", "embed")}
    return tree


def init(cfg: LlamaConfig, key: PRNGKey, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Fresh parameters. Each leaf is drawn on the CPU from ``fold_in(key, its dotted name)``, so values are
    bit-identical whatever the device, mesh or creation order. On ``device="meta"`` nothing is allocated."""
    device = torch.device(device)

    def one(name: str, info: ParamInfo) -> Tensor:
        if device.type == "meta":
            return torch.empty(info.shape, device=device, dtype=dtype)
        if info.std is None:
            return torch.ones(info.shape, dtype=dtype, device=device)
        x = torch.randn(info.shape, generator=generator(fold_in(key, name)), dtype=torch.float32)
        return (x * info.std).to(device=device, dtype=dtype)

    return map_with_names(one, param_shapes(cfg), is_leaf=lambda x: isinstance(x, ParamInfo))


def num_params(cfg: LlamaConfig, *, embedding: bool = True) -> int:
    """Parameter count; ``embedding=False`` leaves out an untied embedding table (a lookup, not a matmul)."""
    named, _ = flatten_with_names(param_shapes(cfg), is_leaf=lambda x: isinstance(x, ParamInfo))
    skip = "" if embedding or cfg.tie_embeddings else "embed.weight"
    return sum(math.prod(info.shape) for name, info in named if name != skip)


# ----------------------------------------------------------------------------------------------- compute


def rope_tables(cfg: LlamaConfig, seq_len: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of shape (seq, head_dim), HF layout (frequencies repeated over the two halves)."""
    hd = cfg.head_dim
    # computed in fp64 on the target device (no host round trip per block), then cast
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
    if cfg.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, cfg.rope_scaling)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_scale(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (batch, heads, seq, head_dim); cos, sin: (seq, head_dim)
    return x * cos + _rotate_half(x) * sin


def rms_norm(x: Tensor, weight: Tensor, eps: float, layout: Layout) -> Tensor:
    # x: (batch, seq, embed); normalised in fp32, as HF does
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return layout.einsum("batch seq embed, embed -> batch seq embed", xn, weight)


def attention(p: dict[str, Tensor], x: Tensor, cfg: LlamaConfig, layout: Layout) -> Tensor:
    # x: (batch, seq, embed), the residual layout (sequence shards under sequence parallelism)
    hd = cfg.head_dim
    q = layout.einsum("batch seq embed, heads embed -> batch seq heads", x, p["wq"])
    k = layout.einsum("batch seq embed, kv_heads embed -> batch seq kv_heads", x, p["wk"])
    v = layout.einsum("batch seq embed, kv_heads embed -> batch seq kv_heads", x, p["wv"])
    # q, k, v hold the whole sequence; head counts come from the (possibly tensor-parallel) local shapes
    b, s = q.shape[:2]
    cos, sin = rope_tables(cfg, s, device=q.device, dtype=q.dtype)  # cheap next to the matmuls; fused when compiled
    q = q.view(b, s, -1, hd).transpose(1, 2)  # (batch, local_heads, seq, head_dim)
    k = k.view(b, s, -1, hd).transpose(1, 2)  # (batch, local_kv_heads, seq, head_dim)
    v = v.view(b, s, -1, hd).transpose(1, 2)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    o = o.transpose(1, 2).reshape(b, s, -1)  # (batch, seq, local_heads * head_dim)
    return layout.einsum("batch seq heads, embed heads -> batch seq embed", o, p["wo"])


def mlp(p: dict[str, Tensor], x: Tensor, layout: Layout) -> Tensor:
    gate = layout.einsum("batch seq embed, mlp embed -> batch seq mlp", x, p["w_gate"])
    up = layout.einsum("batch seq embed, mlp embed -> batch seq mlp", x, p["w_up"])
    return layout.einsum("batch seq mlp, embed mlp -> batch seq embed", F.silu(gate) * up, p["w_down"])


def block(p: dict[str, Any], x: Tensor, cfg: LlamaConfig, layout: Layout) -> Tensor:
    """One transformer block on compute params: pre-norm attention and SwiGLU MLP with residuals."""
    x = x + attention(p["attn"], rms_norm(x, p["attn_norm"]["weight"], cfg.norm_eps, layout), cfg, layout)
    return x + mlp(p["mlp"], rms_norm(x, p["mlp_norm"]["weight"], cfg.norm_eps, layout), layout)


def embed(params: dict[str, Any], tokens: Tensor, cfg: LlamaConfig, layout: Layout = Layout()) -> Tensor:
    """The first pipeline piece: token embeddings ``(batch, seq, embed)``."""
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={cfg.max_seq_len}; raise max_seq_len or shorten training.seq_len")
    return layout.embed(tokens, layout.param(params["embed"]["weight"]), cfg.vocab_size)


def blocks(layers: list[dict[str, Any]], x: Tensor, cfg: LlamaConfig, layout: Layout = Layout()) -> Tensor:
    """A run of transformer blocks (all of them, or one pipeline stage's)."""
    for i, p in enumerate(layers):
        nxt = layers[i + 1] if i + 1 < len(layers) else None  # FSDP: its all-gather overlaps this block
        x = layout.block(block, p, x, cfg, layout, prefetch=nxt)
    return x


def head(params: dict[str, Any], x: Tensor, cfg: LlamaConfig, layout: Layout = Layout()) -> Tensor:
    """The last pipeline piece: final norm and output projection -> logits ``(batch, seq, vocab)``."""
    x = rms_norm(x, layout.param(params["norm"]["weight"]), cfg.norm_eps, layout)
    w = params["embed"]["weight"] if cfg.tie_embeddings else params["output"]["weight"]
    return layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, layout.param(w))


def apply(params: dict[str, Any], tokens: Tensor, cfg: LlamaConfig, layout: Layout = Layout()) -> Tensor:
    """Logits ``(batch, seq, vocab)`` for ``tokens (batch, seq)``."""
    # embedding, final norm and head gathered together: one collective (FSDP2's root group), held to the end
    top = layout.params({k: v for k, v in params.items() if k != "layers"})
    return head(top, blocks(params["layers"], embed(top, tokens, cfg, layout), cfg, layout), cfg, layout)


def loss(params: dict[str, Any], batch: dict[str, Tensor], cfg: LlamaConfig, layout: Layout = Layout()) -> Tensor:
    """Mean next-token cross-entropy over this rank's batch (``batch["inputs"]``, ``batch["targets"]``)."""
    return layout.cross_entropy(apply(params, batch["inputs"], cfg, layout), batch["targets"], cfg.vocab_size)


def stage_model(cfg: LlamaConfig, layout: Layout, *, seq_len: int, dtype: torch.dtype = torch.float32) -> Any:
    """This model as a pipeline ``StageModel``: ``embed``, ``blocks``, ``head`` + cross-entropy.

    Costs are forward FLOPs per token: a block is ``2 * its matrix params + 2 * seq * dim`` (causal attention
    scores and values), the head ``2 * vocab * dim`` plus a few ops per logit for the loss, the embedding a
    row copy. ``layout`` is the stages' layout (on ``pipeline.stage_mesh``); ``dtype`` is the activation dtype.
    """
    from functitan.pipeline import StageModel

    d = cfg.dim
    block_params = d * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.kv_heads) + 3 * d * cfg.ffn_dim
    shards = layout.seq_shards
    return StageModel(
        first=lambda params, mb: embed(params, mb["inputs"], cfg, layout),
        blocks=lambda layers, x: blocks(layers, x, cfg, layout),
        last=lambda params, x, mb: layout.cross_entropy(head(params, x, cfg, layout), mb["targets"], cfg.vocab_size),
        # the residual stream between stages: (microbatch, local seq, embed)
        activation=lambda mb: ((mb["inputs"].shape[0], mb["inputs"].shape[1] // shards, d), dtype),
        n_blocks=cfg.n_layers,
        block_cost=float(2 * block_params + 2 * seq_len * d),
        first_cost=float(d),
        last_cost=float(2 * cfg.vocab_size * d + 5 * cfg.vocab_size + 4 * d),
        blocks_key="layers",
        first_keys=("embed",),
        last_keys=("norm", "embed") if cfg.tie_embeddings else ("norm", "output"),
        single_backward=layout.single_backward,
    )

