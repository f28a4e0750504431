"""Rotary position embeddings (RoPE) for any model: the tables, one cache of them, and their application.

HF's layout: frequency ``j`` rotates the pair ``(j, j + head_dim/2)`` (``rotate_half``), the tables are
``(positions, head_dim)`` with the frequencies repeated over the two halves. ``scaling``: Llama 3.1's
frequency scaling (any object with ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
``original_max_position_embeddings``: HF ``rope_type="llama3"``), or None.

Models take the tables from ``cached_tables``: built once per (shape, device, dtype) in eager mode (rebuilt
in every block they were ~4% of a small model's forward), traced inline under ``torch.compile`` and inside a
torch.func transform such as ``hvp`` or ``vmap`` (a cached tensor would escape it), and under a FakeTensorMode
(torch's fake tracing) built once per mode, in a cache that dies with it (rebuilt in every block they were a
tenth of a trace's ops, and a real step keeps them from its first block on).

References: RoPE (arXiv 2104.09864); Llama 3 (arXiv 2407.21783), section 3.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["tables", "cached_tables", "apply", "clear_cache"]


def _llama3_scale(inv_freq: Tensor, s: Any) -> Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def tables(
    head_dim: int,
    theta: float,
    seq_len: int,
    *,
    scaling: Any = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of shape ``(seq_len, head_dim)`` for positions ``0..seq_len-1``."""
    # computed in fp64 on the target device (no host round trip per block), then cast
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    if scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@functools.lru_cache(maxsize=32)
def _cached(
    head_dim: int, theta: float, seq_len: int, scaling: Any, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    return tables(head_dim, theta, seq_len, scaling=scaling, device=device, dtype=dtype)


_FAKE_CACHE = "_functitan_rope_tables"  # a FakeTensorMode's own {key: (cos, sin)}: it dies with the mode


def cached_tables(
    head_dim: int, theta: float, seq_len: int, *, scaling: Any = None, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``tables`` through a cache when that is safe (``scaling`` must then be hashable: a frozen dataclass)."""
    if torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None:
        return tables(head_dim, theta, seq_len, scaling=scaling, device=device, dtype=dtype)
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if fake is None:
        return _cached(head_dim, theta, seq_len, scaling, torch.device(device), dtype)
    # on the mode itself: a dict keyed by the mode would keep it alive (each fake tensor refers to its mode)
    cache = fake.__dict__.setdefault(_FAKE_CACHE, {})
    key = (head_dim, theta, seq_len, scaling, torch.device(device), dtype)
    if key not in cache:
        cache[key] = tables(head_dim, theta, seq_len, scaling=scaling, device=device, dtype=dtype)
    return cache[key]


def clear_cache() -> None:
    """Drop every cached table (a test that must see them built)."""
    _cached.cache_clear()


def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x (batch, heads, seq, head_dim)`` by the tables ``cos, sin (seq, head_dim)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
