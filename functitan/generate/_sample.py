"""Sampling from any model's ``apply``: greedy, temperature, top-k and top-p (nucleus), reproducible by seed.

Every token comes from the model's own forward (``Model.apply``), so every model that trains generates, with the
logits the loss sees: no second implementation of attention or positions to keep in step with the first. With
the KV cache (``functitan.generate.KVCache``, a Layout) the prompt runs once and each new token is a forward
over that token alone; the first cached step is checked against a whole forward, and a model whose logits
differ through the cache (its own attention or positions, not the Layout's) generates without it, a forward
over the context per token. A context that outgrows the model's ``max_seq_len`` keeps its last
``max_seq_len`` tokens (without the cache: positions shift).

Filtering follows transformers' ``TopKLogitsWarper`` then ``TopPLogitsWarper`` after the temperature, so with
the same logits both keep the same tokens; greedy (``temperature=0``) is the argmax, which
``transformers.GenerationMixin.generate(do_sample=False)`` reproduces token for token on an exported model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..sharding import Layout
from ._cache import KVCache

__all__ = ["SamplingConfig", "filter_logits", "sample_next", "generate", "stream"]


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How each next token is chosen.

    Attributes:
        max_new_tokens: stop after this many new tokens (or at a stop id).
        temperature: 0 takes the most likely token (greedy); above 0 samples from softmax(logits / temperature).
        top_k: sample among the k most likely tokens only; 0: all.
        top_p: sample among the most likely tokens whose probabilities add up to top_p; 1: all.
        seed: the sampling seed (the same seed and prompt give the same tokens).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, ok, fix in (
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be >= 0 (0: greedy)"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0: no top-k)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1] (1: no top-p)"),
        ):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: {fix}")


def filter_logits(logits: Tensor, *, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``logits (batch, vocab)`` with the tokens top-k and then top-p leave out set to -inf.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p`` (always at least the
    most likely one), as transformers' ``TopPLogitsWarper``."""
    out = logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # (batch, 1)
        out = out.masked_fill(out < kth, -math.inf)
    if top_p < 1.0:
        ascending, order = torch.sort(out, dim=-1)
        cum = ascending.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1] = False  # the most likely token stays
        out = out.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf)
    return out


def sample_next(logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> Tensor:
    """The next token ``(batch,)`` for the last position's ``logits (batch, vocab)``."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    z = filter_logits(logits.float() / cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    return torch.multinomial(z.softmax(-1), 1, generator=generator).squeeze(-1)


def stream(
    model: Any,
    model_cfg: Any,
    params: Any,
    prompt: Sequence[int],
    cfg: SamplingConfig,
    *,
    stop_ids: Sequence[int] = (),
    kv_cache: bool = True,
    stats: dict[str, Any] | None = None,
) -> Iterator[int]:
    """Yield the new tokens after ``prompt`` one at a time, up to ``cfg.max_new_tokens`` or a ``stop_ids`` token
    (which is yielded last). ``params`` are whole tensors on one device (``functitan.checkpoint.saved_params``,
    ``load_hf``). ``kv_cache=False`` runs a whole forward per token. ``stats``, when given, gets
    ``{"cached": tokens computed through the cache, "full": tokens computed by a whole forward}``."""
    if not prompt:
        raise ValueError("the prompt has no tokens; give a prompt (with data.add_bos, BOS alone is one)")
    device = next(p.device for p in _leaves(params))
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    window = getattr(model_cfg, "max_seq_len", None)
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, seq)
    stops = {int(i) for i in stop_ids}
    counts = stats if stats is not None else {}
    counts.update(cached=0, full=0)
    cache: KVCache | None = KVCache() if kv_cache else None
    checked = False  # the first step through the cache is compared with a whole forward

    def whole() -> Tensor:  # (1, vocab): the last position's logits of a forward over the context
        counts["full"] += 1
        context = ids if window is None else ids[:, -window:]
        return model.apply(params, context, model_cfg, Layout())[:, -1, :]

    with torch.no_grad():
        for n in range(cfg.max_new_tokens):
            if cache is not None and window is not None and ids.shape[1] > window:
                cache = None  # past the model's positions: the window slides, positions shift
            if cache is None:
                logits = whole()
            else:
                new = ids if n == 0 else ids[:, -1:]  # the prompt once, then the last token
                logits = model.apply(params, new, model_cfg, cache.forward())[:, -1, :]
                if n == 0 and cache.layers == 0:  # no layout.attention call: nothing to cache
                    cache, counts["full"] = None, counts["full"] + 1  # that forward was a whole one
                elif n == 1 and not checked:
                    checked, full = True, whole()
                    if not torch.allclose(logits, full, rtol=1e-4, atol=1e-4):
                        cache, logits = None, full  # the model's positions or attention are its own
                if cache is not None:
                    counts["cached"] += 1
            nxt = sample_next(logits.float(), cfg, generator)  # (1,)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            token = int(nxt.item())
            yield token
            if token in stops:
                return


def generate(
    model: Any,
    model_cfg: Any,
    params: Any,
    prompt: Sequence[int],
    cfg: SamplingConfig = SamplingConfig(),
    *,
    stop_ids: Sequence[int] = (),
    kv_cache: bool = True,
    stats: dict[str, Any] | None = None,
) -> list[int]:
    """The new tokens after ``prompt`` (see ``stream``), as a list."""
    return list(stream(model, model_cfg, params, prompt, cfg, stop_ids=stop_ids, kv_cache=kv_cache, stats=stats))


def _leaves(tree: Any) -> Iterator[Tensor]:
    import optree

    yield from (x for x in optree.tree_leaves(tree) if isinstance(x, Tensor))
