"""A KV cache as a Layout: each attention call keeps its keys and values, so a forward over the new token alone
continues the sequence.

Models route attention through ``layout.attention`` and offset their positions by ``layout.past_len``
(``functitan.sharding.Layout``); ``KVCache`` is the single-device Layout whose attention appends this forward's
``k``, ``v`` to what the same layer kept last time and attends over all of it, and whose ``past_len`` is the
number of tokens kept. It holds per-generation state, so one is made per prompt (``functitan.generate.stream``).
A model that computes positions or attention on its own would give other logits through it: ``stream`` checks
the first cached step against a whole forward and generates without the cache when they differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..sharding import Layout

__all__ = ["KVCache"]


class KVCache(Layout):
    """One device, no mesh; ``forward()`` before each model call starts its layer count."""

    _kv: list[list[Tensor]]  # per layer: [k, v], (batch, kv_heads, tokens, head_dim) each
    _at: dict[str, int]  # the layer the next attention call is, and the tokens kept before this forward

    def __init__(self) -> None:
        super().__init__()
        # containers set once and filled in place (Layout is a frozen dataclass)
        object.__setattr__(self, "_kv", [])
        object.__setattr__(self, "_at", {"layer": 0, "past": 0})

    def forward(self) -> KVCache:
        """Start a model call: layers count from 0 again, and ``past_len`` is the tokens kept so far."""
        self._at["layer"] = 0
        self._at["past"] = self._kv[0][0].shape[2] if self._kv else 0
        return self

    @property
    def past_len(self) -> int:
        return self._at["past"]

    @property
    def layers(self) -> int:
        """How many attention calls kept their keys and values (0: the model never called ``layout.attention``)."""
        return len(self._kv)

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        segment_ids: Tensor | None = None,
        scale: float | None = None,
    ) -> Tensor:
        """``q (batch, heads, new, head_dim)`` over the kept keys and values plus ``k``, ``v`` of the new tokens:
        new token ``j`` (position ``past + j``) sees every kept token and the new ones up to itself."""
        if segment_ids is not None:
            raise ValueError("KVCache: packed documents (segment_ids) are not generated from; pass one prompt")
        i = self._at["layer"]
        self._at["layer"] += 1
        if i < len(self._kv):
            k, v = (torch.cat([kept, new], dim=2) for kept, new in zip(self._kv[i], (k, v)))
            self._kv[i][:] = [k, v]
        else:
            self._kv.append([k, v])
        new, total = q.shape[2], k.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if new == total or not causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        seen = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)  # (new, total)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale, enable_gqa=gqa)
