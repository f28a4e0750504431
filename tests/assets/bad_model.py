"""A deliberately wrong model at the usual init (normal(0.02)): its MLP einsum calls the ``mlp`` dim of ``w_in``
"hidden".

Under tensor parallelism the pattern's names decide the collectives, so this computes wrong gradients without
a word; ``functitan.model.check_names`` (run by the trainer before any collective) refuses it, naming the param,
both name lists and this file's line. At this init the wrong gradient is small (~8e-6): ``gradcheck`` must
compare each gradient with its own size to see it (tests/test_custom_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functitan.model import Model, Param, count
from functitan.sharding import Layout


@dataclass(frozen=True, kw_only=True)
class Config:
    vocab_size: int = 258
    dim: int = 32
    hidden: int = 64


def params(cfg: Config) -> dict:
    return {
        "embed": Param((cfg.vocab_size, cfg.dim), ("vocab", "embed")),
        "w_in": Param((cfg.hidden, cfg.dim), ("mlp", "embed")),
        "w_out": Param((cfg.dim, cfg.hidden), ("embed", "mlp")),
    }


def apply(params: dict, tokens: torch.Tensor, cfg: Config, layout: Layout = Layout()) -> torch.Tensor:
    p = layout.params(params)
    x = layout.embed(tokens, p["embed"], cfg.vocab_size)
    h = F.gelu(layout.einsum("batch seq embed, hidden embed -> batch seq hidden", x, p["w_in"]))  # wrong: "mlp"
    x = x + layout.einsum("batch seq mlp, embed mlp -> batch seq embed", h, p["w_out"])
    return layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, p["embed"])


def loss(params: dict, batch: dict, cfg: Config, layout: Layout = Layout()) -> torch.Tensor:
    return layout.cross_entropy(apply(params, batch["inputs"], cfg, layout), batch["targets"], cfg.vocab_size)


MODEL = Model(
    name="bad",
    configs={"debug": Config()},
    params=params,
    loss=loss,
    apply=apply,
    flops_per_token=lambda cfg, seq_len: 6.0 * count(params(cfg)),
)
