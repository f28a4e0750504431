"""Counter-style random keys, as in JAX: a key is a plain int, ``fold_in``/``split`` derive new keys.

Why not a torch.Generator: a key must be data (checkpointed with the train state, the same on every rank)
and derivations must not depend on call order. A leaf's initial values come from
``generator(fold_in(key, leaf_name))`` on the CPU, so they are bit-identical whatever the mesh, the device,
or the order in which leaves are created.
"""

from __future__ import annotations

import hashlib
import operator

import torch

__all__ = ["PRNGKey", "key", "fold_in", "split", "generator"]

PRNGKey = int
_MASK = (1 << 63) - 1


def key(seed: int) -> PRNGKey:
    """A key from a seed (any integer, numpy's included)."""
    try:
        if isinstance(seed, bool):
            raise TypeError
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}") from None
    return fold_in(0x5EED, seed)


def fold_in(k: PRNGKey, data: int | str) -> PRNGKey:
    """A new key from ``k`` and ``data`` (an int such as a step, or a name such as a key path).

    ``data`` is hashed as text: an int and its decimal string (``3`` and ``"3"``) give the same key, and so do
    ``split(k)[i]`` and ``fold_in(k, f"split{i}")``; keep one kind of data per key (steps, or names)."""
    h = hashlib.blake2b(f"{int(k)}/{data}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & _MASK


def split(k: PRNGKey, n: int = 2) -> list[PRNGKey]:
    """``n`` independent keys derived from ``k``."""
    return [fold_in(k, f"split{i}") for i in range(n)]


def generator(k: PRNGKey) -> torch.Generator:
    """A CPU torch.Generator seeded from ``k`` (draw on the CPU, then move: same bits on every device)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(k))
    return g
