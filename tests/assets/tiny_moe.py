"""A mixture-of-experts LM written as a user would from docs/moe.md and docs/models.md, outside the package.

Each block: causal attention through ``layout.attention``, then ``layout.moe`` (the library's router, dropless
experts and sequence-wise balance term) and a router z-loss of the user's own, ``logsumexp(router logits) ** 2``
per token (ST-MoE). The loss is a 0-d mean over this rank's batch: cross-entropy + balance + z-loss.

``RAW`` is the same model with the one mistake the docs warn about: the z-loss as a plain ``.mean()`` of this
rank's tokens. Under sequence parallelism the tp ranks hold pieces of one sequence and sum their gradients of a
tp-replicated param, so the router's gradient through that mean counts tp times (``layout.token_mean`` adds the
pieces first). Under data and context parallelism the ranks' gradients are averaged, and the mean is right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functitan.model import Model, Param, normal, ones
from functitan.moe import Router, expert_params
from functitan.sharding import Layout


@dataclass(frozen=True, kw_only=True)
class Cfg:
    vocab_size: int = 64
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    experts: int = 4
    top_k: int = 2
    z_loss: float = 1e-1  # large, so that a wrong z-loss gradient shows
    raw_z: bool = False  # the mistake: a per-rank mean of the z-loss

    @property
    def router(self) -> Router:
        return Router(experts=self.experts, top_k=self.top_k, norm_topk=True, balance=1e-2)


def params(c: Cfg) -> dict:
    d, w = c.dim, normal(0.2)
    layer = lambda: {  # noqa: E731
        "norm1": Param((d,), ("embed",), ones()),
        "wq": Param((d, d), ("heads", "embed"), w),
        "wk": Param((d, d), ("heads", "embed"), w),
        "wv": Param((d, d), ("heads", "embed"), w),
        "wo": Param((d, d), ("embed", "heads"), w),
        "norm2": Param((d,), ("embed",), ones()),
        "moe": expert_params(dim=d, ffn=2 * d, router=c.router, init=w),
    }
    return {
        "embed": Param((c.vocab_size, d), ("vocab", "embed"), w),
        "layers": [layer() for _ in range(c.n_layers)],
        "norm": Param((d,), ("embed",), ones()),
    }


def _norm(x: torch.Tensor, weight: torch.Tensor, layout: Layout) -> torch.Tensor:
    return layout.einsum("batch seq embed, embed -> batch seq embed", F.rms_norm(x, x.shape[-1:]), weight)


def block(p: dict, x: torch.Tensor, c: Cfg, layout: Layout) -> tuple[torch.Tensor, dict]:
    h = _norm(x, p["norm1"], layout)
    q, k, v = layout.einsums(h, [("batch seq embed, heads embed -> batch seq heads", p[n]) for n in ("wq", "wk", "wv")])
    b, s = q.shape[:2]  # s: the whole sequence (or this rank's chunks under cp)
    q, k, v = (t.view(b, s, -1, c.dim // c.n_heads).transpose(1, 2) for t in (q, k, v))
    o = layout.attention(q, k, v).transpose(1, 2).flatten(2)
    x = x + layout.einsum("batch seq heads, embed heads -> batch seq embed", o, p["wo"])
    h = _norm(x, p["norm2"], layout)
    out, aux = layout.moe(h, p["moe"], c.router)
    logits = layout.einsum("batch seq embed, router embed -> batch seq router", h, p["moe"]["router"]["weight"])
    z = logits.float().logsumexp(-1).square()  # (batch, seq piece)
    aux["z"] = z.mean() if c.raw_z else layout.token_mean(z)
    return x + out, aux


def apply(params: dict, tokens: torch.Tensor, c: Cfg, layout: Layout = Layout()) -> tuple[torch.Tensor, dict]:
    top = layout.params({k: v for k, v in params.items() if k != "layers"})
    x = layout.embed(tokens, top["embed"], c.vocab_size)
    x, aux = layout.blocks(lambda p, x: block(p, x, c, layout), params["layers"], x)
    x = _norm(x, top["norm"], layout)
    return layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, top["embed"]), aux


def loss(params: dict, batch: dict, c: Cfg, layout: Layout = Layout()) -> tuple[torch.Tensor, dict]:
    logits, aux = apply(params, batch["inputs"], c, layout)
    ce = layout.cross_entropy(logits, batch["targets"], c.vocab_size)
    z = aux["z"] if c.raw_z else aux["z"].sum / aux["z"].count
    total = ce + aux["balance"].mean() + c.z_loss * z  # 0-d: the mean over this rank's rows
    return total, {"load": aux["load"], "z": z.detach()}


def _model(name: str, cfg: Cfg) -> Model:
    return Model(
        name=name,
        configs={"debug": cfg},
        params=params,
        loss=loss,
        apply=lambda p, t, c, layout=Layout(): apply(p, t, c, layout)[0],
        flops_per_token=lambda c, s: 6.0 * 8 * c.n_layers * c.dim**2,
    )


MODEL = _model("tiny_moe", Cfg())
RAW = _model("tiny_moe_raw", Cfg(raw_z=True))
