"""Function transforms that build a train step from ``loss_fn(params, batch)``.

- ``value_and_grad``: loss and gradients over the tensor leaves of ``params``. torch.func cannot see DTensor
  leaves (it hands the function functorch wrappers), so this flattens the tree with optree and calls
  ``torch.autograd.grad`` on the leaves: gradients keep the leaves' placements.
- ``accumulate``: gradient accumulation over microbatches (the mean over microbatches equals one big batch
  when each microbatch holds the same number of tokens).
- ``remat``: activation checkpointing of a function (per block: see ``Layout.block``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import _dtensor as _dt

__all__ = ["value_and_grad", "accumulate", "remat", "split_batch"]


def _is_diff(x: Any) -> bool:
    return isinstance(x, Tensor) and (x.is_floating_point() or x.is_complex())


def value_and_grad(fn: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., tuple[Any, Any]]:
    """``fn(params, *args) -> loss`` becomes ``(params, *args) -> (loss, grads)``.

    ``grads`` mirrors ``params``: a gradient for each floating-point tensor leaf (zeros where the loss does
    not depend on it), ``None`` for other leaves. With ``has_aux=True``, ``fn`` returns ``(loss, aux)`` and the
    result is ``((loss, aux), grads)``. The returned loss is detached.
    """

    @functools.wraps(fn)
    def wrapped(params: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
        idx = [i for i, x in enumerate(leaves) if _is_diff(x)]
        leaves = list(leaves)
        for i in idx:
            if not leaves[i].requires_grad:
                leaves[i] = leaves[i].detach().requires_grad_(True)
        with torch.enable_grad():
            out = fn(optree.tree_unflatten(treedef, leaves), *args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        if not (isinstance(loss, Tensor) and loss.numel() == 1):
            raise TypeError(f"value_and_grad: {getattr(fn, '__name__', 'fn')} must return a scalar tensor loss, got {type(loss).__name__}")
        diff = [leaves[i] for i in idx]
        grads = torch.autograd.grad(loss, diff, allow_unused=True) if diff else ()
        out_leaves: list[Any] = [None] * len(leaves)
        for i, g in zip(idx, grads):
            out_leaves[i] = g if g is not None else torch.zeros_like(leaves[i])
        grad_tree = optree.tree_unflatten(treedef, out_leaves)
        value = loss.detach()
        return ((value, aux) if has_aux else value), grad_tree

    return wrapped


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split every tensor leaf of ``batch`` into ``n`` equal microbatches along dim 0."""
    leaves, treedef = optree.tree_flatten(batch)
    for x in leaves:
        if isinstance(x, Tensor) and x.shape[0] % n:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split into {n} microbatches; make training.batch_size "
                f"a multiple of training.microbatches"
            )
    chunks = [x.chunk(n) if isinstance(x, Tensor) else [x] * n for x in leaves]
    return [optree.tree_unflatten(treedef, [c[i] for c in chunks]) for i in range(n)]


def accumulate(grad_fn: Callable[..., tuple[Any, Any]], microbatches: int) -> Callable[..., tuple[Any, Any]]:
    """Gradient accumulation: ``grad_fn(params, batch) -> (loss, grads)`` over ``microbatches`` slices.

    Returns the mean loss and mean gradients over the microbatches. With one microbatch it is ``grad_fn``.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if microbatches == 1:
        return grad_fn

    @functools.wraps(grad_fn)
    def wrapped(params: Any, batch: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        # The sums run on local shards (DTensor gradients keep their specs aside): a foreach op on DTensors
        # pays sharding propagation, which took minutes on the first step of a 4-D mesh.
        total_loss: Tensor | None = None
        acc: list[Any] = []
        specs: list[Any] = []
        treedef = None
        for mb in split_batch(batch, microbatches):
            loss, grads = grad_fn(params, mb, *args, **kwargs)
            leaves, treedef = optree.tree_flatten(grads, none_is_leaf=True)
            if total_loss is None:
                acc, specs, total_loss = [_dt.local(g) for g in leaves], [_dt.spec(g) for g in leaves], loss
                continue
            idx = [i for i, g in enumerate(leaves) if g is not None]
            # out of place: the first microbatch's gradients may alias tensors autograd still holds
            for i, s in zip(idx, torch._foreach_add([acc[i] for i in idx], [_dt.local(leaves[i]) for i in idx])):
                acc[i] = s
            total_loss = total_loss + loss
        idx = [i for i, g in enumerate(acc) if g is not None]
        torch._foreach_div_([acc[i] for i in idx], float(microbatches))  # every acc[i] is a sum made above
        out = [None if g is None else _dt.wrap(g, s) for g, s in zip(acc, specs)]
        return total_loss / microbatches, optree.tree_unflatten(treedef, out)

    return wrapped


def remat(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Activation checkpointing: keep only ``fn``'s inputs, recompute its activations in backward."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrapped
