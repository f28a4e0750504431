"""Gradient transformations: the pieces ``adamw`` and ``sgd`` are chained from.

Each transform flattens its trees once, runs ``torch._foreach_*`` over the local shards of all leaves
(elementwise math keeps DTensor placements) and wraps the results back with each leaf's spec; see
``_local``. Step counters are 0-d int64 tensors kept on the CPU: bias corrections and schedules read them as
Python ints, which then costs no device sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functitan.optim import _local
from functitan.optim._base import EmptyState, GradientTransformation
from functitan.optim._norm import global_norm
from functitan.optim._schedules import Schedule
from functitan.tree import flatten_with_names, map_with_names

__all__ = [
    "ScaleByAdamState",
    "TraceState",
    "ScaleByScheduleState",
    "NO_DECAY_AXES",
    "default_decay_mask",
    "decay_mask_from_specs",
    "scale",
    "scale_by_learning_rate",
    "set_to_zero",
    "scale_by_adam",
    "trace",
    "add_decayed_weights",
    "clip_by_global_norm",
]

Mask = Callable[[str, Any], bool] | Any  # (name, param) -> bool, or a pytree of bools mirroring params


class ScaleByAdamState(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # () int64 on the CPU: updates applied so far
    mu: Any  # first moment, mirrors params
    nu: Any  # second moment, mirrors params


class TraceState(NamedTuple):
    trace: Any  # momentum buffer, mirrors params


class ScaleByScheduleState(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # () int64 on the CPU: the step the schedule is read at next


def _zero_count() -> Tensor:
    return torch.zeros((), dtype=torch.int64)


def step_number(count: Tensor, offset: int = 0) -> Any:
    """``count + offset``: a Python int eagerly (bias corrections and schedules in float math, no device
    sync), a float64 0-d tensor under ``torch.compile`` (traced into the step: no graph break at ``int()``)."""
    if torch.compiler.is_compiling():
        return count.to(torch.float64) + offset
    return int(count) + offset


def _axpy_(ys: list[Tensor], xs: list[Tensor], a: Any) -> None:
    """``ys += a * xs`` for a Python or a 0-d tensor scalar ``a`` (foreach's ``alpha`` takes numbers only)."""
    if isinstance(a, Tensor):
        torch._foreach_add_(ys, torch._foreach_mul(xs, a))
    else:
        torch._foreach_add_(ys, xs, alpha=a)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _check_nonneg(x: Any, msg: str) -> None:
    """``x >= 0`` for a number; a 0-d tensor (a hyperparameter ``inject_hyperparams`` passes under
    ``torch.compile``) is not checked: reading it would sync and break the graph."""
    if not isinstance(x, Tensor):
        _check(x >= 0, msg)


def rate(x: Any) -> Any:
    """A constant hyperparameter as the update uses it: a float, or a 0-d tensor left as it is (traced)."""
    return x if isinstance(x, Tensor) else float(x)


# Logical axis names whose params are not decayed: an embedding row (or an untied output row) is only
# updated by the tokens that use it, so decay would shrink rare tokens' rows toward zero between updates.
NO_DECAY_AXES = frozenset({"vocab"})


def default_decay_mask(name: str, param: Any) -> bool:
    """Decay matrices, not vectors: ``param.ndim >= 2``. Norm scales and biases are 1-D, and decaying them
    pulls them toward 0 (a norm's neutral value is 1). With specs at hand, ``decay_mask_from_specs`` also
    leaves out embeddings.

    >>> default_decay_mask("layers.0.attn.wq", torch.zeros(4, 4)), default_decay_mask("norm.weight", torch.zeros(4))
    (True, False)
    """
    return param.ndim >= 2


def decay_mask_from_specs(
    specs: Any, *, no_decay_axes: frozenset[str] | set[str] = NO_DECAY_AXES
) -> Callable[[str, Any], bool]:
    """A weight-decay mask read from the params' logical names: decay a param iff it has >= 2 dims and none
    of them is named in ``no_decay_axes`` (by default ``{"vocab"}``: the embedding and output tables).

    The mask is ``(name, param) -> bool`` over dotted names, so it also serves a sub-tree with the same names
    (a pipeline stage's params); a name the specs do not have falls back to ``default_decay_mask``.

    Example::

        >>> mask = decay_mask_from_specs({"embed": ("vocab", "embed"), "wq": ("heads", "embed"), "norm": ("embed",)})
        >>> [mask(n, torch.zeros(2, 2) if n != "norm" else torch.zeros(2)) for n in ("embed", "wq", "norm")]
        [False, True, False]
    """
    from functitan._rules import is_spec

    named = dict(flatten_with_names(specs, is_leaf=is_spec)[0])

    def mask(name: str, param: Any) -> bool:
        spec = named.get(name)
        if spec is None:
            return default_decay_mask(name, param)
        return len(spec) >= 2 and not any(a in no_decay_axes for a in spec if a is not None)

    return mask


def scale(factor: float) -> GradientTransformation:
    """Multiply updates by a constant ``factor``."""

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        u = _local.flatten(updates, "updates")
        with torch.no_grad():
            return _local.unflatten(u, torch._foreach_mul(u.locals, factor)), state

    return GradientTransformation(lambda params: EmptyState(), update)


def set_to_zero() -> GradientTransformation:
    """Zero updates (``optax.set_to_zero``): the leaves it gets do not move; with ``multi_transform``, frozen
    params (a JAX-style step differentiates every float leaf, whatever its ``requires_grad``)."""

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        u = _local.flatten(updates, "updates")
        with torch.no_grad():
            return _local.unflatten(u, [torch.zeros_like(x) for x in u.locals]), state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_learning_rate(learning_rate: float | Schedule) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (descent); a schedule ``step -> float`` is read at steps 0, 1, ...

    The schedule's step is counted in the state, so a restored checkpoint resumes the schedule where it was.
    """
    if not callable(learning_rate):
        _check_nonneg(
            learning_rate, f"learning_rate={learning_rate}: pass a non-negative rate (descent flips the sign)"
        )
        return scale(-rate(learning_rate))

    def init(params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=_zero_count())

    def update(updates: Any, state: ScaleByScheduleState, params: Any = None) -> tuple[Any, ScaleByScheduleState]:
        lr = learning_rate_at(learning_rate, step_number(state.count))
        u = _local.flatten(updates, "updates")
        with torch.no_grad():
            out = _local.unflatten(u, torch._foreach_mul(u.locals, -lr))
        return out, ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init, update)


def adam_moments(
    mu: _local.Flat, nu: _local.Flat, g: _local.Flat, *, b1: float, b2: float, eps: float, t: Any
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Adam's new moments and denominator ``sqrt(nu / (1 - b2**t)) + eps`` on local shards (call under no_grad).

    The arithmetic follows ``torch.optim.AdamW`` (``lerp`` for mu, ``addcmul`` for nu); shared by
    ``scale_by_adam`` and the fused ``adamw``.
    """
    gl = [x if x.dtype == m.dtype else x.to(m.dtype) for x, m in zip(g.locals, mu.locals)]
    new_mu = list(torch._foreach_lerp(mu.locals, gl, 1 - b1))
    new_nu = list(torch._foreach_mul(nu.locals, b2))
    torch._foreach_addcmul_(new_nu, gl, gl, value=1 - b2)
    denom = list(torch._foreach_sqrt(new_nu))
    torch._foreach_div_(denom, (1 - b2**t) ** 0.5)  # t: an int, or a tensor under torch.compile
    torch._foreach_add_(denom, eps)
    return new_mu, new_nu, denom


def learning_rate_at(learning_rate: float | Schedule, step: Any) -> Any:
    """The rate a constant or a schedule gives at ``step``; a schedule's bad value is an error naming the step.
    Under torch.compile ``step`` is a 0-d tensor and so is the rate (not checked: that would sync)."""
    if not callable(learning_rate):
        return rate(learning_rate)
    if isinstance(step, Tensor):
        return torch.as_tensor(learning_rate(step), dtype=torch.float64)
    lr = float(learning_rate(step))
    _check(math.isfinite(lr) and lr >= 0, f"the learning-rate schedule returned {lr} at step {step}; fix it")
    return lr


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction ``mu_hat / (sqrt(nu_hat) + eps)`` with bias-corrected moments (Kingma & Ba, 2015).

    The moments have each param's dtype and placement. The arithmetic follows ``torch.optim.AdamW``
    (``lerp`` for mu, ``addcmul`` for nu, ``sqrt(nu) / sqrt(1 - b2**t) + eps``).
    """
    _check(0 <= b1 < 1 and 0 <= b2 < 1, f"b1={b1}, b2={b2}: both must lie in [0, 1), e.g. b1=0.9, b2=0.95")
    _check(eps >= 0, f"eps={eps}: pass a non-negative eps, e.g. 1e-8")

    def init(params: Any) -> ScaleByAdamState:
        ref = _local.flatten(params, "params")
        return ScaleByAdamState(count=_zero_count(), mu=_local.zeros_like(ref), nu=_local.zeros_like(ref))

    def update(grads: Any, state: ScaleByAdamState, params: Any = None) -> tuple[Any, ScaleByAdamState]:
        mu = _local.flatten(state.mu, "state.mu")
        nu = _local.flatten_like(mu, state.nu, ("state.mu", "state.nu"))
        g = _local.flatten_like(mu, grads, ("optimizer state", "grads"))
        t = step_number(state.count, 1)
        with torch.no_grad():
            new_mu, new_nu, denom = adam_moments(mu, nu, g, b1=b1, b2=b2, eps=eps, t=t)
            out = torch._foreach_div(new_mu, denom)
            torch._foreach_div_(out, 1 - b1**t)
            new_state = ScaleByAdamState(state.count + 1, _local.unflatten(mu, new_mu), _local.unflatten(mu, new_nu))
            return _local.unflatten(g, out), new_state

    return GradientTransformation(init, update)


def trace(momentum: float, *, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``trace = g + momentum * trace``; updates are ``trace`` (or ``g + momentum * trace`` with
    ``nesterov``), which matches ``torch.optim.SGD`` with zero dampening."""
    _check(momentum >= 0, f"momentum={momentum}: pass a non-negative momentum, e.g. 0.9")

    def init(params: Any) -> TraceState:
        return TraceState(trace=_local.zeros_like(_local.flatten(params, "params")))

    def update(grads: Any, state: TraceState, params: Any = None) -> tuple[Any, TraceState]:
        tr = _local.flatten(state.trace, "state.trace")
        g = _local.flatten_like(tr, grads, ("optimizer state", "grads"))
        with torch.no_grad():
            new = torch._foreach_add(g.locals, tr.locals, alpha=momentum)
            out = torch._foreach_add(g.locals, new, alpha=momentum) if nesterov else new
            return _local.unflatten(g, out), TraceState(_local.unflatten(tr, new))

    return GradientTransformation(init, update)


def _resolve_mask(mask: Mask | None, params: Any) -> list[bool]:
    """One bool per leaf of ``params``: ``mask`` called on each (name, param), or read from a mirroring tree."""
    if mask is None:
        return [True] * len(optree.tree_leaves(params))
    if callable(mask):  # a list, not a tree: dynamo traces this (it cannot trace optree's unflatten of a dict)
        flat = [mask(name, p) for name, p in flatten_with_names(params)[0]]
    else:
        flat = optree.tree_leaves(
            map_with_names(lambda name, p, m: m, params, mask, what=("params", "mask")), none_is_leaf=True
        )
    for (name, _), m in zip(flatten_with_names(params)[0], flat):
        if not isinstance(m, bool):
            raise TypeError(
                f"mask for {name!r} is {m!r} ({type(m).__name__}); a weight-decay mask holds True/False per param"
            )
    return flat


def decay_indices(mask: Mask | None, p: _local.Flat, cache: dict[str, Any]) -> list[int]:
    """The indices of the leaves of ``p`` that ``mask`` decays, cached per tree structure (``init`` fills it).
    Under torch.compile the last eager answer is a constant of the graph (the compiled step sees the tree
    ``init`` saw); without one (a transform built inside the step, as ``inject_hyperparams`` does) a callable
    mask is read at trace time, a mask tree needs ``init`` (dynamo cannot trace optree's unflatten)."""
    if torch.compiler.is_compiling():
        if "last" not in cache and (mask is None or callable(mask)):
            return [i for i, m in enumerate(_resolve_mask(mask, p.tree)) if m]
        if "last" not in cache:
            raise ValueError(
                "a weight-decay mask is resolved by this optimizer's init: call opt.init(params) on this "
                "optimizer before its first compiled update"
            )
        return cache["last"]
    by_tree = cache.setdefault("by_tree", {})  # keyed by treedef, which only eager code hashes
    if p.treedef not in by_tree:
        by_tree[p.treedef] = [i for i, m in enumerate(_resolve_mask(mask, p.tree)) if m]
    cache["last"] = by_tree[p.treedef]
    return cache["last"]


def add_decayed_weights(weight_decay: float, *, mask: Mask | None = None) -> GradientTransformation:
    """Add ``weight_decay * param`` to the updates of the params ``mask`` selects (all when None).

    Placed after ``scale_by_adam`` and before the learning rate, this is AdamW's decoupled weight decay
    (Loshchilov & Hutter, 2019). ``mask`` is ``(name, param) -> bool`` (see ``default_decay_mask``) or a
    pytree of bools mirroring params; the choice is fixed per tree structure and cached.
    """
    _check_nonneg(weight_decay, f"weight_decay={weight_decay}: pass a non-negative decay, e.g. 0.1")
    cache: dict[str, Any] = {}

    def decayed(p: _local.Flat) -> list[int]:
        return decay_indices(mask, p, cache)

    def init(params: Any) -> EmptyState:
        decayed(_local.flatten(params, "params"))  # a bad mask fails here, not at the first step
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        if params is None:
            raise ValueError("add_decayed_weights needs the params: call update(grads, state, params)")
        if not isinstance(weight_decay, Tensor) and weight_decay == 0:
            return updates, state
        p = _local.flatten(params, "params")
        u = _local.flatten_like(p, updates, ("params", "updates"))
        idx = decayed(p)
        with torch.no_grad():
            us, ps = [u.locals[i] for i in idx], [p.locals[i] for i in idx]
            wd = weight_decay
            new = torch._foreach_add(
                us,
                torch._foreach_mul(ps, wd) if isinstance(wd, Tensor) else ps,
                alpha=1 if isinstance(wd, Tensor) else wd,
            )
            out = list(u.leaves)
            for i, local in zip(idx, new):
                out[i] = _local.wrap(local, u.specs[i])
        return p.treedef.unflatten(out), state

    return GradientTransformation(init, update)


def clip_to_norm(tree: Any, norm: Tensor, max_norm: float, *, in_place: bool = False) -> Any:
    """Scale every leaf by ``min(1, max_norm / norm)``, given the tree's global norm (computed once, e.g. by
    the train step, which also reports it). Foreach over local shards; placements are kept. ``in_place``
    scales the given buffers (a step that owns its gradients) instead of allocating new ones, except a leaf
    whose elements share memory (an expanded gradient, as autograd gives for a param used through ``.sum()``),
    which is scaled into a new tensor."""
    with torch.no_grad():
        return scale_tree(tree, (max_norm / norm).clamp(max=1.0), in_place=in_place)


def scale_tree(tree: Any, factor: Tensor, *, in_place: bool = False) -> Any:
    """Every leaf times the 0-d ``factor``, as ``clip_to_norm`` scales (foreach over local shards)."""
    u = _local.flatten(tree, "updates")
    if not u.locals:
        return tree
    with torch.no_grad():
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(u.locals):
            by_device.setdefault(t.device, []).append(i)
        out: list[Tensor] = list(u.locals)
        replaced = False
        for device, idx in by_device.items():
            if in_place:
                dense = [_local.dense(u.locals[i]) for i in idx]
                own = [i for i, d in zip(idx, dense) if d]
                if own:
                    torch._foreach_mul_([u.locals[i] for i in own], factor.to(device))
                idx = [i for i, d in zip(idx, dense) if not d]
                if not idx:
                    continue
            for i, t in zip(idx, torch._foreach_mul([u.locals[i] for i in idx], factor.to(device))):
                out[i], replaced = t, True
        return _local.unflatten(u, out) if replaced else tree


def clip_by_global_norm(max_norm: float, *, across: Any = None) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / global_norm(updates))`` (Pascanu et al., 2013).

    The norm is that of the full tensors however the leaves are sharded (see ``global_norm``; ``across`` adds
    a process group whose ranks hold other leaves, e.g. pipeline stages), and it stays on the device: no host
    sync. A norm of 0 leaves updates unchanged; a NaN norm makes them NaN.
    """
    _check(max_norm > 0, f"max_norm={max_norm}: pass a positive norm, e.g. 1.0")

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        return clip_to_norm(updates, global_norm(updates, across=across), max_norm), state

    return GradientTransformation(lambda params: EmptyState(), update)
