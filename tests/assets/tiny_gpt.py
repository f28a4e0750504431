"""A GPT-style model written as a user would, outside the package: every pattern that broke TP + SP before.

Biases added raw to the residual stream (``x + layout.param(b)``), LayerNorm weight and bias used raw, learned
positions through ``layout.embed``, a fused q/k/v projection declared 3-D so TP splits heads (not q from k),
and tied embeddings. ``BAD`` is the same model with one contraction misnaming a dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functitan.model import Model, Param, normal, ones, zeros
from functitan.sharding import Layout


@dataclass(frozen=True, kw_only=True)
class Cfg:
    vocab_size: int = 64
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    max_seq: int = 32
    wrong_name: bool = False
    raw_scale: bool = False  # multiply head-sharded q by a replicated param directly (wrong under TP without SP)


def params(c: Cfg) -> dict:
    d, hd = c.dim, c.dim // c.n_heads
    layer = lambda: {  # noqa: E731
        "ln1": {"weight": Param((d,), ("embed",), ones()), "bias": Param((d,), ("embed",), zeros())},
        "qkv": Param((3, c.n_heads * hd, d), ("qkv", "heads", "embed"), normal(0.2)),
        "qkv_bias": Param((3, c.n_heads * hd), ("qkv", "heads"), normal(0.2)),
        "q_scale": Param((hd,), ("head_dim",), normal(0.2, 1.0)),
        "proj": Param((d, c.n_heads * hd), ("embed", "heads"), normal(0.2)),
        "proj_bias": Param((d,), ("embed",), normal(0.2)),
        "ln2": {"weight": Param((d,), ("embed",), normal(0.2, 1.0)), "bias": Param((d,), ("embed",), normal(0.2))},
        "fc": Param((4 * d, d), ("mlp", "embed"), normal(0.2)),
        "fc_bias": Param((4 * d,), ("mlp",), normal(0.2)),
        "out": Param((d, 4 * d), ("embed", "mlp"), normal(0.2)),
        "out_bias": Param((d,), ("embed",), normal(0.2)),
    }
    return {
        "wte": Param((c.vocab_size, d), ("vocab", "embed"), normal(0.2)),
        "wpe": Param((c.max_seq, d), ("pos", "embed"), normal(0.2)),
        "layers": [layer() for _ in range(c.n_layers)],
        "ln_f": {"weight": Param((d,), ("embed",), ones()), "bias": Param((d,), ("embed",), normal(0.2))},
    }


def _ln(x, p, layout):
    return F.layer_norm(x, x.shape[-1:], layout.param(p["weight"]), layout.param(p["bias"]))


def block(p: dict, x: torch.Tensor, c: Cfg, layout: Layout) -> torch.Tensor:
    b, s, _ = x.shape  # s: this rank's piece of the sequence under SP
    h = _ln(x, p["ln1"], layout)
    qkv = layout.einsum("batch seq embed, qkv heads embed -> batch seq qkv heads", h, p["qkv"]) + p["qkv_bias"]
    q, k, v = (t.reshape(b, qkv.shape[1], -1, c.dim // c.n_heads).transpose(1, 2) for t in qkv.unbind(2))
    if c.raw_scale:
        q = q * p["q_scale"]
    else:  # q is split by heads under TP: the einsum derives the gradient sum over tp for the replicated scale
        q = layout.einsum("batch heads seq head_dim, head_dim -> batch heads seq head_dim", q, p["q_scale"])
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    x = x + layout.einsum("batch seq heads, embed heads -> batch seq embed", o, p["proj"]) + p["proj_bias"]
    h = _ln(x, p["ln2"], layout)
    mlp = "hidden" if c.wrong_name else "mlp"
    h = F.gelu(layout.einsum(f"batch seq embed, {mlp} embed -> batch seq {mlp}", h, p["fc"]) + p["fc_bias"])
    return x + layout.einsum("batch seq mlp, embed mlp -> batch seq embed", h, p["out"]) + p["out_bias"]


def apply(params: dict, tokens: torch.Tensor, c: Cfg, layout: Layout = Layout()) -> torch.Tensor:
    top = layout.params({k: v for k, v in params.items() if k != "layers"})
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    x = layout.embed(tokens, top["wte"], c.vocab_size) + layout.embed(pos, top["wpe"], c.max_seq)
    x = layout.blocks(lambda p, x: block(p, x, c, layout), params["layers"], x)
    x = F.layer_norm(x, x.shape[-1:], top["ln_f"]["weight"], top["ln_f"]["bias"])
    return layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, top["wte"])


def loss(params: dict, batch: dict, c: Cfg, layout: Layout = Layout()) -> torch.Tensor:
    return layout.cross_entropy(apply(params, batch["inputs"], c, layout), batch["targets"], c.vocab_size)


MODEL = Model(
    name="tiny_gpt",
    configs={"debug": Cfg(), "raw": Cfg(raw_scale=True)},
    params=params,
    loss=loss,
    apply=apply,
    flops_per_token=lambda c, s: 6.0 * 12 * c.n_layers * c.dim**2,
)
BAD = Model(
    name="tiny_gpt_bad",
    configs={"debug": Cfg(wrong_name=True)},
    params=params,
    loss=loss,
    apply=apply,
    flops_per_token=lambda c, s: 6.0 * 12 * c.n_layers * c.dim**2,
)
