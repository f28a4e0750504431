"""The optimizer type (optax's): a pair of pure functions over pytrees, composed with ``chain``.

An optimizer is ``GradientTransformation(init, update)``: ``init(params) -> state`` and
``update(grads, state, params=None) -> (updates, new_state)``. ``apply_updates(params, updates)`` adds the
updates and returns new params. State is a NamedTuple of pytrees mirroring params (and a 0-d int64 step
counter where a transform counts steps), so it checkpoints like params. Nothing is modified in place: every
call returns new tensors, and the inputs stay valid. The one exception is opt-in: ``update_in_place`` (adamw
has one) for a step that owns its state, ``make_train_step(donate=True)``, which the trainer uses.

>>> from functitan.optim import scale
>>> opt = chain(scale(0.5), scale(-0.1))          # updates = -0.05 * grads
>>> params = {"w": torch.ones(2)}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
>>> apply_updates(params, updates)["w"]
tensor([0.9500, 0.9500])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functitan.optim import _local

__all__ = ["GradientTransformation", "EmptyState", "chain", "identity", "apply_updates"]

InitFn = Callable[[Any], Any]
UpdateFn = Callable[..., tuple[Any, Any]]  # (grads, state, params=None) -> (updates, state)
# (grads, state, params) -> (params, state) with the same buffers updated in place, or None where it can't
InPlaceFn = Callable[[Any, Any, Any], "tuple[Any, Any] | None"]


class GradientTransformation(NamedTuple):
    """An optimizer as two pure functions; see the module docstring.

    ``update_in_place`` is an optional third path for a caller that owns the params and the state and will
    not read the old ones again (``make_train_step(donate=True)``, as ``jax.jit``'s ``donate_argnums``):
    ``update_in_place(grads, state, params) -> (params, state)`` applies the update to the same buffers in
    one fused pass, or returns None where it cannot (then the caller runs ``update`` and ``apply_updates``).
    Its result equals theirs up to rounding. Combinators do not carry it: a chain is always functional.
    """

    init: InitFn
    update: UpdateFn
    update_in_place: InPlaceFn | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def identity() -> GradientTransformation:
    """Pass updates through unchanged."""
    return GradientTransformation(lambda params: EmptyState(), lambda updates, state, params=None: (updates, state))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states (``state[i]`` is transform i's)."""

    def init(params: Any) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Any, state: tuple, params: Any = None) -> tuple[Any, tuple]:
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state of {len(state)} entries; pass the state that "
                f"this optimizer's init (or its last update) returned"
            )
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf, as NEW leaf tensors in each param's dtype and placement.

    Each new leaf has ``requires_grad`` as its param did, so the next step can differentiate it; DTensor
    params stay DTensors with the same mesh and placements. The sum runs in the wider of the two dtypes
    (fp32 updates on bf16 params) before the cast back, as in optax.
    """
    ref = _local.flatten(params, "params")
    upd = _local.flatten_like(ref, updates, ("params", "updates"))
    with torch.no_grad():
        new = torch._foreach_add(ref.locals, upd.locals)
        out = []
        for p, local, spec in zip(ref.leaves, new, ref.specs):
            if local.dtype != p.dtype:
                local = local.to(p.dtype)
            out.append(_local.wrap(local, spec, requires_grad=p.requires_grad))
    return ref.treedef.unflatten(out)
