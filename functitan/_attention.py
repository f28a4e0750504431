"""Attention on one device: the kernel every parallelism's attention ends in (``Layout.attention``).

Models call ``layout.attention`` rather than ``F.scaled_dot_product_attention`` so that a parallelism that
splits the sequence (context parallel) can change how attention runs without editing a model; on one device,
and under data and tensor parallelism (local heads, the whole sequence), it is this function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["attention", "document_mask"]


def document_mask(segment_ids: Tensor, *, causal: bool = True) -> Tensor:
    """``(batch, 1, seq, seq)`` bool: query i sees key j when both are in the same document (and ``j <= i``).

    ``segment_ids (batch, seq)``: each token's document id in a packed sequence.
    """
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    if causal:
        s = segment_ids.shape[1]
        same = same & torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return same


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    segment_ids: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Scaled dot-product attention: ``q (batch, heads, seq, head_dim)``, ``k``/``v (batch, kv_heads, seq,
    head_dim)`` -> ``(batch, heads, seq, head_dim)``; grouped-query when ``kv_heads < heads``.

    ``segment_ids (batch, seq)``: packed documents attend only within themselves; ``scale``: default
    ``head_dim ** -0.5``.
    """
    gqa = q.shape[1] != k.shape[1]
    if segment_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    mask = document_mask(segment_ids, causal=causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
