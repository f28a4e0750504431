"""GPT-2 as pure functions on the model interface: ``MODEL = functitan.model.Model(...)`` at the bottom.

A pre-norm transformer with learned position embeddings, LayerNorm with bias, biased linears, GELU (tanh
approximation, HF's ``gelu_new``) and the token table reused as the output head (tied embeddings). Written
for one device; the Layout argument makes it run under FSDP, TP, sequence parallelism and pipelines:

- every parameter is declared once in ``params`` (shape, logical names, init); the names decide sharding;
- every contraction with a parameter is a ``layout.einsum`` whose names are the declared ones;
- biases are plain adds. A column-parallel bias (``c_attn``, ``c_fc``) is declared on the sharded dim
  (``heads``, ``mlp``), so each tensor-parallel rank holds and adds its slice; a row-parallel bias
  (``c_proj``) is declared on ``embed`` and added after the einsum has summed the partial products, once;
- positions are a second table looked up with ``layout.embed``: under sequence parallelism it returns this
  rank's sequence piece, and the Layout sums the gradient of every tp-replicated param over tp.

The parameter tree mirrors Hugging Face ``GPT2LMHeadModel``; only the layouts differ (HF's ``Conv1D`` stores
``(in, out)``, we store ``(out, in)`` like ``nn.Linear``; ``c_attn`` is 3-D here, see ``attention``)::

    wte.weight                          transformer.wte.weight            (vocab, embed)
    wpe.weight                          transformer.wpe.weight            (positions, embed)
    layers.{i}.ln_1.{weight,bias}       transformer.h.{i}.ln_1.{weight,bias}
    layers.{i}.attn.c_attn.weight       transformer.h.{i}.attn.c_attn.weight  (3, heads, embed) <- (embed, 3*heads)
    layers.{i}.attn.c_proj.{weight,bias}    transformer.h.{i}.attn.c_proj.*   (embed, heads) <- (heads, embed)
    layers.{i}.ln_2.{weight,bias}       transformer.h.{i}.ln_2.{weight,bias}
    layers.{i}.mlp.{c_fc,c_proj}.*      transformer.h.{i}.mlp.{c_fc,c_proj}.*  transposed
    ln_f.{weight,bias}                  transformer.ln_f.{weight,bias}
    lm_head.weight                      lm_head.weight                    (only with tie_embeddings=False)

References: GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"); GELU
(arXiv 1606.08415); Megatron-LM tensor parallelism (arXiv 1909.08053) and sequence parallelism (2205.05198).
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
from functitan.metrics import transformer_flops_per_token
from functitan.model import HFMap, Param, TensorKey, normal, ones, zeros
from functitan.sharding import Layout

__all__ = [
    "GPT2Config",
    "CONFIGS",
    "params",
    "apply",
    "loss",
    "flops_per_token",
    "check_layout",
    "stage_model",
    "MODEL",
]


@dataclass(frozen=True, kw_only=True)
class GPT2Config:
    vocab_size: int = 50257
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    ffn_dim: int = 3072  # GPT-2 uses 4 * dim
    max_seq_len: int = 1024  # rows of the position table
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # GPT-2 reuses wte as the output head
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive")
        if self.dim % self.n_heads:
            ok = [d for d in range(1, self.dim + 1) if self.dim % d == 0]
            raise ValueError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; choose n_heads among {ok[:12]}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


CONFIGS: dict[str, GPT2Config] = {
    # tiny: trains in seconds on a CPU (the trainer sets vocab_size from the tokenizer)
    "debug": GPT2Config(vocab_size=258, dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=1024),
    # the published checkpoints (gpt2, gpt2-medium, gpt2-large, gpt2-xl)
    "124m": GPT2Config(dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "355m": GPT2Config(dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    "774m": GPT2Config(dim=1280, n_layers=36, n_heads=20, ffn_dim=5120),
    "1.5b": GPT2Config(dim=1600, n_layers=48, n_heads=25, ffn_dim=6400),
}


# ----------------------------------------------------------------------------------------------- params


def params(cfg: GPT2Config) -> dict[str, Any]:
    """Every parameter, declared once: shape, logical names (what the rules shard) and initializer."""
    d, f, v = cfg.dim, cfg.ffn_dim, cfg.vocab_size
    w = normal(cfg.init_std)
    w_out = normal(cfg.init_std / math.sqrt(2 * cfg.n_layers))  # GPT-2's scaled init of the residual projections

    def norm() -> dict[str, Param]:
        return {"weight": Param((d,), ("embed",), ones()), "bias": Param((d,), ("embed",), zeros())}

    def layer() -> dict[str, Any]:
        return {
            "ln_1": norm(),
            "attn": {
                # q, k and v in one weight; "qkv" has no rule (never sharded), "heads" is split over tp, so a
                # tensor-parallel rank holds q, k and v of its own heads
                "c_attn": {
                    "weight": Param((3, d, d), ("qkv", "heads", "embed"), w),
                    "bias": Param((3, d), ("qkv", "heads"), zeros()),
                },
                "c_proj": {
                    "weight": Param((d, d), ("embed", "heads"), w_out),
                    "bias": Param((d,), ("embed",), zeros()),
                },
            },
            "ln_2": norm(),
            "mlp": {
                "c_fc": {"weight": Param((f, d), ("mlp", "embed"), w), "bias": Param((f,), ("mlp",), zeros())},
                "c_proj": {"weight": Param((d, f), ("embed", "mlp"), w_out), "bias": Param((d,), ("embed",), zeros())},
            },
        }

    tree: dict[str, Any] = {
        "wte": {"weight": Param((v, d), ("vocab", "embed"), w)},
        "wpe": {"weight": Param((cfg.max_seq_len, d), ("positions", "embed"), w)},  # "positions": never sharded
        "layers": [layer() for _ in range(cfg.n_layers)],
        "ln_f": norm(),
    }
    if not cfg.tie_embeddings:
        tree["lm_head"] = {"weight": Param((v, d), ("vocab", "embed"), w)}
    return tree


def flops_per_token(cfg: GPT2Config, seq_len: int) -> float:
    """Training FLOPs per token (PaLM's formula); the position table is a lookup, and so is wte when untied."""
    lookups = {"wpe.weight"} | (set() if cfg.tie_embeddings else {"wte.weight"})
    n = M.count(params(cfg), exclude=lambda name, _: name in lookups)
    return transformer_flops_per_token(
        n_params=n, n_layers=cfg.n_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim, seq_len=seq_len
    )


def check_layout(cfg: GPT2Config, *, tp: int = 1, seq_len: int | None = None, sequence_parallel: bool = False) -> None:
    """Fail before launch when tensor parallelism cannot split this model; name a tp that can."""
    bad = [f"model.{k}={v}" for k, v in (("n_heads", cfg.n_heads), ("ffn_dim", cfg.ffn_dim)) if v % tp]
    if bad:
        g = math.gcd(cfg.n_heads, cfg.ffn_dim)
        ok = [t for t in range(1, g + 1) if g % t == 0]
        raise ValueError(
            f"parallelism.tp={tp} does not divide {', '.join(bad)}; tensor parallelism splits heads and "
            f"the MLP width evenly. A tp that works for this model: {max(t for t in ok if t <= tp)} (any of {ok})"
        )
    if seq_len is not None and seq_len > cfg.max_seq_len:
        raise ValueError(
            f"training.seq_len={seq_len} exceeds model.max_seq_len={cfg.max_seq_len} (the rows of the "
            f"position table); shorten training.seq_len"
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(
            f"sequence parallelism with parallelism.tp={tp} needs training.seq_len divisible by {tp}, got "
            f"{seq_len}; use seq_len={seq_len - seq_len % tp or tp} or set parallelism.sequence_parallel=false"
        )


# ----------------------------------------------------------------------------------------------- compute


def layer_norm(p: dict[str, Tensor], x: Tensor, eps: float, layout: Layout) -> Tensor:
    # x: (batch, seq, embed); weight and bias are replicated over tp (their gradients summed over tp under SP)
    xn = F.layer_norm(x, x.shape[-1:], eps=eps)
    return layout.einsum("batch seq embed, embed -> batch seq embed", xn, p["weight"]) + p["bias"]


def attention(p: dict[str, Any], x: Tensor, cfg: GPT2Config, layout: Layout) -> Tensor:
    # x: (batch, seq, embed), the residual layout (sequence shards under sequence parallelism)
    c = p["c_attn"]
    # column parallel: (batch, seq, 3, local heads * head_dim), the whole sequence; its bias slice matches
    qkv = layout.einsum("batch seq embed, qkv heads embed -> batch seq qkv heads", x, c["weight"]) + c["bias"]
    b, s = qkv.shape[:2]
    q, k, v = (t.view(b, s, -1, cfg.head_dim).transpose(1, 2) for t in qkv.unbind(2))  # (batch, heads, seq, head_dim)
    o = layout.attention(q, k, v)  # causal
    o = o.transpose(1, 2).reshape(b, s, -1)  # (batch, seq, local heads * head_dim)
    # row parallel: the einsum sums the partial products over tp first, then the bias is added once
    return (
        layout.einsum("batch seq heads, embed heads -> batch seq embed", o, p["c_proj"]["weight"]) + p["c_proj"]["bias"]
    )


def mlp(p: dict[str, Any], x: Tensor, layout: Layout) -> Tensor:
    h = layout.einsum("batch seq embed, mlp embed -> batch seq mlp", x, p["c_fc"]["weight"]) + p["c_fc"]["bias"]
    h = F.gelu(h, approximate="tanh")
    return layout.einsum("batch seq mlp, embed mlp -> batch seq embed", h, p["c_proj"]["weight"]) + p["c_proj"]["bias"]


def block(p: dict[str, Any], x: Tensor, cfg: GPT2Config, layout: Layout) -> Tensor:
    """One pre-norm block on compute params: attention and MLP, each added to the residual stream."""
    x = x + attention(p["attn"], layer_norm(p["ln_1"], x, cfg.norm_eps, layout), cfg, layout)
    return x + mlp(p["mlp"], layer_norm(p["ln_2"], x, cfg.norm_eps, layout), layout)


def embed(p: dict[str, Any], tokens: Tensor, cfg: GPT2Config, layout: Layout) -> Tensor:
    """Token plus position embeddings ``(batch, seq, embed)`` (this rank's sequence piece under SP)."""
    s, past = tokens.shape[1], layout.past_len  # past: the tokens a KV cache holds when generating, else 0
    if past + s > cfg.max_seq_len:
        raise ValueError(
            f"sequence length {past + s} exceeds model.max_seq_len={cfg.max_seq_len}; shorten training.seq_len"
        )
    x = layout.embed(tokens, p["wte"]["weight"], cfg.vocab_size)
    # (1, seq): the Layout picks this rank's piece
    positions = torch.arange(past, past + s, device=tokens.device).unsqueeze(0)
    return x + layout.embed(positions, p["wpe"]["weight"], cfg.max_seq_len)


def head(p: dict[str, Any], x: Tensor, cfg: GPT2Config, layout: Layout) -> Tensor:
    """Final norm and the output projection -> logits ``(batch, seq, vocab)`` (vocab shards under TP)."""
    x = layer_norm(p["ln_f"], x, cfg.norm_eps, layout)
    w = p["wte"]["weight"] if cfg.tie_embeddings else p["lm_head"]["weight"]
    return layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, w)


# ----------------------------------------------------------------------------------------------- Hugging Face


def _conv1d() -> dict[str, Any]:
    # HF's Conv1D stores (in, out); ours is (out, in)
    return {"to_theirs": lambda t: t.t().contiguous(), "from_theirs": lambda t: t.t().contiguous()}


def hf_tensors(cfg: GPT2Config) -> dict[str, TensorKey]:
    """``{our dotted name: TensorKey}`` for every parameter of ``cfg``."""
    d = cfg.dim
    out = {n: TensorKey(key=f"transformer.{n}") for n in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = TensorKey(key="lm_head.weight")
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}", f"transformer.h.{i}"
        for n in (
            "ln_1.weight",
            "ln_1.bias",
            "ln_2.weight",
            "ln_2.bias",
            "attn.c_proj.bias",
            "mlp.c_fc.bias",
            "mlp.c_proj.bias",
        ):
            out[f"{ours}.{n}"] = TensorKey(key=f"{hf}.{n}")
        for n in ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"):
            out[f"{ours}.{n}"] = TensorKey(key=f"{hf}.{n}", **_conv1d())
        # c_attn: HF (embed, 3 * embed) with q, k, v side by side <-> ours (3, heads, embed)
        out[f"{ours}.attn.c_attn.weight"] = TensorKey(
            key=f"{hf}.attn.c_attn.weight",
            to_theirs=lambda t: t.reshape(3 * d, d).t().contiguous(),
            from_theirs=lambda t: t.t().reshape(3, d, d).contiguous(),
        )
        out[f"{ours}.attn.c_attn.bias"] = TensorKey(
            key=f"{hf}.attn.c_attn.bias", to_theirs=lambda t: t.reshape(3 * d), from_theirs=lambda t: t.reshape(3, d)
        )
    return out


def config_to_hf(cfg: GPT2Config) -> dict[str, Any]:
    """The ``config.json`` of ``GPT2LMHeadModel`` for ``cfg`` (the exporter adds the dtype)."""
    return {
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


_REQUIRED = ("vocab_size", "n_embd", "n_layer", "n_head")
# key -> the values functitan's GPT-2 implements (gelu_pytorch_tanh is the same function as gelu_new)
_FIXED = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "add_cross_attention": (False,),
}


def config_from_hf(d: Mapping[str, Any]) -> GPT2Config:
    """The GPT2Config of a ``GPT2LMHeadModel`` ``config.json`` (dropouts, token ids and task heads are ignored;
    a setting the model does not implement raises ValueError naming the key)."""
    if d.get("model_type", "gpt2") != "gpt2":
        raise ValueError(
            f"config.json model_type={d['model_type']!r} is not supported; only 'gpt2' (GPT2LMHeadModel) is"
        )
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a GPT2LMHeadModel config needs all of {list(_REQUIRED)}")
    for key, allowed in _FIXED.items():
        if key in d and d[key] not in allowed:
            raise ValueError(
                f"config.json {key}={d[key]!r} is not supported; functitan's GPT-2 implements {key} in {list(allowed)}"
            )
    dim = int(d["n_embd"])
    return GPT2Config(
        vocab_size=int(d["vocab_size"]),
        dim=dim,
        n_layers=int(d["n_layer"]),
        n_heads=int(d["n_head"]),
        ffn_dim=int(d.get("n_inner") or 4 * dim),
        max_seq_len=int(d.get("n_positions") or 1024),
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        init_std=float(d.get("initializer_range", 0.02)),
    )


HF = HFMap(
    architecture="GPT2LMHeadModel",
    config_to_hf=config_to_hf,
    config_from_hf=config_from_hf,
    tensors=hf_tensors,
    tied=lambda cfg: {"lm_head.weight": "transformer.wte.weight"} if cfg.tie_embeddings else {},
    ignored=(r"transformer\.h\.\d+\.attn\.(masked_)?bias",),  # causal-mask buffers older checkpoints saved
    base_prefix="transformer.",  # the hub's gpt2 files hold GPT2Model's keys: "h.0.attn.c_attn.weight"
)


MODEL = M.Model(
    name="gpt2",
    configs=CONFIGS,
    params=params,
    pieces=M.Pieces(
        embed=embed,
        block=block,
        head=head,
        first_keys=lambda cfg: ("wte", "wpe"),
        last_keys=lambda cfg: ("ln_f", "wte") if cfg.tie_embeddings else ("ln_f", "lm_head"),
    ),
    flops_per_token=flops_per_token,
    check_layout=check_layout,
    hf=HF,
)

# composed by the library from the pieces above (functitan.model.Pieces)
apply, loss, stage_model = MODEL.apply, MODEL.loss, MODEL.stages
