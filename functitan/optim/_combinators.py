"""Combinators over optimizers, with optax's semantics: ``masked``, ``multi_transform``, ``inject_hyperparams``,
``apply_every``, ``multi_steps`` (``optax.MultiSteps``), ``ema`` and ``param_ema``.

Inner transforms see the params' own tree with the leaves they do not own replaced by None (optax's
``MaskedNode``), so a mask that goes by name (``decay_mask_from_specs``, ``lambda name, p: ...``) sees the
params' names, a fused ``adamw`` keeps its fast path, and DTensor leaves keep their placements. A group that
selects no leaf is not updated (its state stays as it is).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functitan.optim import _local
from functitan.optim._base import GradientTransformation
from functitan.optim._transforms import Mask, _resolve_mask, learning_rate_at, step_number
from functitan.tree import flatten_with_names, map_with_names

__all__ = [
    "MaskedState",
    "MultiTransformState",
    "InjectHyperparamsState",
    "ApplyEvery",
    "MultiStepsState",
    "EmaState",
    "masked",
    "multi_transform",
    "inject_hyperparams",
    "apply_every",
    "multi_steps",
    "ema",
    "param_ema",
]


def _holed(leaves: list[Any], treedef: Any, idx: list[int]) -> Any:
    """The tree with only the leaves at ``idx``; None (no leaf) elsewhere."""
    keep = set(idx)
    return optree.tree_unflatten(treedef, [x if i in keep else None for i, x in enumerate(leaves)])


def _aligned(updates: Any, params: Any) -> tuple[list[Any], Any, list[Any] | None, list[int]]:
    """``updates``' leaves with its Nones kept (``value_and_grad`` gives None for an integer leaf), their
    treedef, ``params``' leaves at the same positions (None without params), and the positions of the leaves
    a mask or label list speaks of: the params' (or, without params, the updates') non-None ones, in order."""
    leaves, treedef = optree.tree_flatten(updates, none_is_leaf=True)
    plist = treedef.flatten_up_to(params) if params is not None else None
    ref = plist if plist is not None else leaves
    return leaves, treedef, plist, [i for i, x in enumerate(ref) if x is not None]


def _zero_count() -> Tensor:
    return torch.zeros((), dtype=torch.int64)


# Counters are 0-d int64 tensors. Eagerly a transform reads them as Python ints (``step_number``) and branches
# in Python; under torch.compile they stay tensors, both branches are computed and ``torch.where`` picks
# (optax's ``lax.cond``), so the compiled step has no graph break and is not recompiled per step.


def _where(cond: Tensor, a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    return [torch.where(cond.to(x.device), x, y) for x, y in zip(a, b)]


def _where_tree(cond: Tensor, a: Any, b: Any) -> Any:
    """``a`` where ``cond`` else ``b``, leaf by leaf (same layout), keeping placements."""
    fa = _local.flatten(a, "state")
    fb = _local.flatten_like(fa, b, ("state", "state"))
    return _local.unflatten(fa, _where(cond, fa.locals, fb.locals))


def _lerp(a: list[Tensor], b: list[Tensor], w: Any) -> list[Tensor]:
    """``a + w * (b - a)``: foreach for a number ``w``, per leaf for a 0-d tensor (foreach_lerp takes numbers)."""
    if not isinstance(w, Tensor):
        return list(torch._foreach_lerp(a, b, w))
    return [torch.lerp(x, y, w.to(x.device, x.dtype)) for x, y in zip(a, b)]


# ------------------------------------------------------------------------------------------ masked


class MaskedState(NamedTuple):
    inner_state: Any  # the inner transform's state over the selected leaves (the params' tree, None elsewhere)


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply ``inner`` to the leaves ``mask`` selects; the other updates pass through unchanged (``optax.masked``).

    ``mask`` is ``(name, param) -> bool`` or a pytree of bools mirroring the params. The inner transform's
    state holds only the selected leaves.
    """

    def init(params: Any) -> MaskedState:
        leaves, treedef, _, present = _aligned(params, None)
        idx = [i for i, m in zip(present, _resolve_mask(mask, params)) if m]
        return MaskedState(inner.init(_holed(leaves, treedef, idx)))

    def update(updates: Any, state: MaskedState, params: Any = None) -> tuple[Any, MaskedState]:
        leaves, treedef, plist, present = _aligned(updates, params)
        keep = _resolve_mask(mask, params if params is not None else updates)
        idx = [i for i, m in zip(present, keep) if m and leaves[i] is not None]
        if not idx:
            return updates, state
        sub_params = None if plist is None else _holed(plist, treedef, idx)
        new, inner_state = inner.update(_holed(leaves, treedef, idx), state.inner_state, sub_params)
        out = list(leaves)
        for i, u in zip(idx, optree.tree_leaves(new)):
            out[i] = u
        return optree.tree_unflatten(treedef, out), MaskedState(inner_state)

    return GradientTransformation(init, update)


# ------------------------------------------------------------------------------------------ multi_transform


class MultiTransformState(NamedTuple):
    inner_states: dict[str, Any]  # label -> that transform's state over its leaves (the params' tree, None elsewhere)


def multi_transform(
    transforms: Mapping[str, GradientTransformation], param_labels: Callable[[str, Any], str] | Any
) -> GradientTransformation:
    """A different transform per group of leaves (``optax.multi_transform``).

    ``param_labels`` is ``(name, param) -> label`` or a pytree of labels mirroring the params; every label
    must be a key of ``transforms``. Each transform sees (and keeps state for) only its leaves.

    >>> from functitan.optim import adamw, set_to_zero
    >>> opt = multi_transform({"adam": adamw(1e-3), "frozen": set_to_zero()},
    ...                       lambda name, p: "frozen" if name.startswith("embed") else "adam")
    """
    if not transforms:
        raise ValueError("multi_transform needs at least one transform: pass {label: transformation}")

    def labels(params: Any) -> list[str]:
        if callable(param_labels):
            tree = map_with_names(lambda name, p: param_labels(name, p), params)
        else:
            tree = map_with_names(lambda name, p, lab: lab, params, param_labels, what=("params", "param_labels"))
        flat = optree.tree_leaves(tree)
        for (name, _), lab in zip(flatten_with_names(params)[0], flat):
            if lab not in transforms:
                raise ValueError(
                    f"param_labels gives {name!r} the label {lab!r}, which is not one of the transforms "
                    f"{sorted(transforms)}; add a transform for it or relabel the param"
                )
        return flat

    def groups(params: Any, present: list[int]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {k: [] for k in transforms}
        for i, lab in zip(present, labels(params)):
            out[lab].append(i)
        return out

    def init(params: Any) -> MultiTransformState:
        leaves, treedef, _, present = _aligned(params, None)
        by_label = groups(params, present)
        return MultiTransformState({k: t.init(_holed(leaves, treedef, by_label[k])) for k, t in transforms.items()})

    def update(updates: Any, state: MultiTransformState, params: Any = None) -> tuple[Any, MultiTransformState]:
        leaves, treedef, plist, present = _aligned(updates, params)
        out, new_states = list(leaves), {}
        for k, idx in groups(params if params is not None else updates, present).items():
            idx = [i for i in idx if leaves[i] is not None]
            if not idx:  # e.g. a pipeline rank that holds none of this label's params
                new_states[k] = state.inner_states[k]
                continue
            sub_p = None if plist is None else _holed(plist, treedef, idx)
            new, new_states[k] = transforms[k].update(_holed(leaves, treedef, idx), state.inner_states[k], sub_p)
            for i, u in zip(idx, optree.tree_leaves(new)):
                out[i] = u
        return optree.tree_unflatten(treedef, out), MultiTransformState(new_states)

    return GradientTransformation(init, update)


# ------------------------------------------------------------------------------------------ inject_hyperparams


class InjectHyperparamsState(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # () int64: the step the schedules are read at next
    hyperparams: dict[str, Tensor]  # 0-d float64 tensors on the CPU: read and overwrite them between steps
    inner_state: Any


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: str | tuple[str, ...] = ()
) -> Callable[..., GradientTransformation]:
    """``optax.inject_hyperparams``: the factory's numeric arguments live in the state, so a schedule or a
    controller can change them between steps (``state.hyperparams["learning_rate"]`` is a 0-d tensor).

    A schedule argument (a callable ``step -> value``) is evaluated at the state's count each step; a number
    is stored once and may be overwritten in the state. Other arguments, and those named in ``static_args``
    (numbers that shape the transform, e.g. ``sgd``'s ``momentum``), are passed through unchanged.

    Under ``torch.compile`` the factory receives the hyperparameters as 0-d tensors (as under ``jax.jit``):
    ``adamw``'s, ``lion``'s and ``sgd``'s learning rate and ``adamw``'s weight decay compute with them.

    >>> opt = inject_hyperparams(adamw)(learning_rate=1e-3, weight_decay=0.1)   # doctest: +SKIP
    >>> state.hyperparams["learning_rate"].fill_(5e-4)                          # doctest: +SKIP
    """

    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        if args:
            raise TypeError(
                "inject_hyperparams: pass the factory's hyperparameters by keyword, e.g. learning_rate=1e-3"
            )
        fixed = (static_args,) if isinstance(static_args, str) else tuple(static_args)
        numeric = {
            k: v
            for k, v in kwargs.items()
            if k not in fixed
            and (isinstance(v, (int, float)) and not isinstance(v, bool) or callable(v) and _takes_a_number(factory, k))
        }
        static = {k: v for k, v in kwargs.items() if k not in numeric}

        def values(count: Any, hp: dict[str, Tensor]) -> dict[str, Any]:
            if isinstance(count, Tensor):  # compiling: tensors in, tensors out
                return {k: learning_rate_at(v, count) if callable(v) else hp[k] for k, v in numeric.items()}
            return {k: (float(numeric[k](count)) if callable(numeric[k]) else float(hp[k])) for k in numeric}

        def init(params: Any) -> InjectHyperparamsState:
            hp = {
                k: torch.tensor(float(v(0)) if callable(v) else float(v), dtype=torch.float64)
                for k, v in numeric.items()
            }
            return InjectHyperparamsState(_zero_count(), hp, factory(**static, **values(0, hp)).init(params))

        def update(
            updates: Any, state: InjectHyperparamsState, params: Any = None
        ) -> tuple[Any, InjectHyperparamsState]:
            now = values(step_number(state.count), state.hyperparams)
            hp = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in now.items()}
            new, inner = factory(**static, **now).update(updates, state.inner_state, params)
            return new, InjectHyperparamsState(state.count + 1, hp, inner)

        return GradientTransformation(init, update)

    return build


def _takes_a_number(factory: Callable[..., Any], name: str) -> bool:
    """Whether a callable passed as ``name`` is a schedule: the factory's parameter is required (a learning
    rate), defaults to a number, or is annotated as a number or a ``Schedule`` (``adafactor``'s
    ``learning_rate``, None by default). A callable for any other (``adamw``'s ``mask``) is passed through."""
    try:
        param = inspect.signature(factory).parameters.get(name)
    except (TypeError, ValueError):
        return True
    if param is None:
        return True
    default, annotation = param.default, str(param.annotation)
    return (
        default is inspect.Parameter.empty
        or isinstance(default, (int, float))
        and not isinstance(default, bool)
        or "float" in annotation
        or "Schedule" in annotation
    )


# ------------------------------------------------------------------------------------------ apply_every, MultiSteps


class ApplyEvery(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # () int64
    grad_acc: Any  # mirrors params


def apply_every(k: int = 1) -> GradientTransformation:
    """``optax.apply_every``: accumulate updates over ``k`` steps; emit the sum every ``k``-th step and zeros on
    the others (put it after the learning rate, so the sum of ``k`` scaled updates lands at once)."""
    if k < 1:
        raise ValueError(f"apply_every: k={k} must be >= 1")

    def init(params: Any) -> ApplyEvery:
        return ApplyEvery(_zero_count(), _local.zeros_like(_local.flatten(params, "params")))

    def update(updates: Any, state: ApplyEvery, params: Any = None) -> tuple[Any, ApplyEvery]:
        acc = _local.flatten(state.grad_acc, "state.grad_acc")
        u = _local.flatten_like(acc, updates, ("state.grad_acc", "updates"))
        n = step_number(state.count)
        first = n % k == 0  # the first step of a window starts from zero
        emit = n % k == k - 1
        with torch.no_grad():
            if isinstance(n, Tensor):
                summed = _where(first, u.locals, torch._foreach_add(acc.locals, u.locals))
                out = _where(emit, summed, [torch.zeros_like(t) for t in u.locals])
                return _local.unflatten(u, out), ApplyEvery(state.count + 1, _local.unflatten(acc, summed))
            summed = [t.clone() for t in u.locals] if first else list(torch._foreach_add(acc.locals, u.locals))
            out = [t.clone() for t in summed] if emit else [torch.zeros_like(t) for t in u.locals]
        return _local.unflatten(u, out), ApplyEvery(state.count + 1, _local.unflatten(acc, summed))

    return GradientTransformation(init, update)


class MultiStepsState(NamedTuple):
    mini_step: Tensor  # () int64: microsteps accumulated in this window
    gradient_step: Tensor  # () int64: inner updates applied
    inner_opt_state: Any
    acc_grads: Any  # running mean of this window's gradients, mirrors params


def multi_steps(opt: GradientTransformation, every_k: int) -> GradientTransformation:
    """``optax.MultiSteps(opt, every_k).gradient_transformation()``: average the gradients of ``every_k`` calls
    and apply ``opt`` to the mean on the last one; the other calls return zero updates and leave ``opt``'s
    state unchanged. Gradient accumulation across steps (``transforms.accumulate`` does it within one)."""
    if every_k < 1:
        raise ValueError(f"multi_steps: every_k={every_k} must be >= 1")

    def init(params: Any) -> MultiStepsState:
        return MultiStepsState(
            _zero_count(), _zero_count(), opt.init(params), _local.zeros_like(_local.flatten(params))
        )

    def update(grads: Any, state: MultiStepsState, params: Any = None) -> tuple[Any, MultiStepsState]:
        acc = _local.flatten(state.acc_grads, "state.acc_grads")
        g = _local.flatten_like(acc, grads, ("state.acc_grads", "grads"))
        n = step_number(state.mini_step)
        with torch.no_grad():  # running mean, as optax: acc + (g - acc) / (n + 1)
            mean = _lerp(acc.locals, [x.to(a.dtype) for x, a in zip(g.locals, acc.locals)], 1.0 / (n + 1))
        if isinstance(n, Tensor):  # compiling: the inner update is computed every call and kept on the last
            emit = n + 1 >= every_k
            updates, inner = opt.update(_local.unflatten(acc, mean), state.inner_opt_state, params)
            with torch.no_grad():
                zeros = _local.unflatten(g, [torch.zeros_like(t) for t in g.locals])
                return _where_tree(emit, updates, zeros), MultiStepsState(
                    torch.where(emit, 0, state.mini_step + 1),
                    state.gradient_step + emit.long(),
                    _where_tree(emit, inner, state.inner_opt_state),
                    _local.unflatten(acc, _where(emit, [torch.zeros_like(t) for t in mean], mean)),
                )
        if n + 1 < every_k:
            zeros = _local.unflatten(g, [torch.zeros_like(t) for t in g.locals])
            return zeros, state._replace(mini_step=state.mini_step + 1, acc_grads=_local.unflatten(acc, mean))
        updates, inner = opt.update(_local.unflatten(acc, mean), state.inner_opt_state, params)
        fresh = _local.unflatten(acc, [torch.zeros_like(t) for t in acc.locals])
        return updates, MultiStepsState(_zero_count(), state.gradient_step + 1, inner, fresh)

    return GradientTransformation(init, update)


# ------------------------------------------------------------------------------------------ EMA


class EmaState(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # () int64
    ema: Any  # mirrors params


def ema(decay: float, *, debias: bool = True) -> GradientTransformation:
    """``optax.ema``: updates become their exponential moving average ``decay * ema + (1 - decay) * u``,
    divided by ``1 - decay**t`` with ``debias``."""
    if not 0 <= decay <= 1:
        raise ValueError(f"ema: decay={decay} must lie in [0, 1], e.g. 0.999")

    def init(params: Any) -> EmaState:
        return EmaState(_zero_count(), _local.zeros_like(_local.flatten(params)))

    def update(updates: Any, state: EmaState, params: Any = None) -> tuple[Any, EmaState]:
        e = _local.flatten(state.ema, "state.ema")
        u = _local.flatten_like(e, updates, ("state.ema", "updates"))
        t = step_number(state.count, 1)
        with torch.no_grad():
            new = torch._foreach_lerp(e.locals, [x.to(a.dtype) for x, a in zip(u.locals, e.locals)], 1 - decay)
            out = torch._foreach_div(new, 1 - decay**t) if debias and decay < 1 else [x.clone() for x in new]
        return _local.unflatten(u, out), EmaState(state.count + 1, _local.unflatten(e, new))

    return GradientTransformation(init, update)


class ParamEma(NamedTuple):
    """An EMA of the params themselves (for evaluation weights): ``init(params) -> EmaState``,
    ``update(params, state) -> EmaState``; read ``state.ema``."""

    init: Callable[[Any], EmaState]
    update: Callable[[Any, EmaState], EmaState]


def param_ema(decay: float, *, warmup: bool = False) -> ParamEma:
    """Exponential moving average of params: ``ema = decay * ema + (1 - decay) * params`` after every step,
    starting from the initial params. ``warmup=True`` uses ``min(decay, (1 + t) / (10 + t))`` (the schedule
    of TF's ExponentialMovingAverage with num_updates), so early averages are not dominated by the init."""
    if not 0 <= decay <= 1:
        raise ValueError(f"param_ema: decay={decay} must lie in [0, 1], e.g. 0.999")

    def init(params: Any) -> EmaState:
        p = _local.flatten(params)
        with torch.no_grad():
            return EmaState(_zero_count(), _local.unflatten(p, [t.detach().clone() for t in p.locals]))

    def update(params: Any, state: EmaState) -> EmaState:
        e = _local.flatten(state.ema, "state.ema")
        p = _local.flatten_like(e, params, ("state.ema", "params"))
        t = step_number(state.count)
        d: Any
        if not warmup:
            d = decay
        elif isinstance(t, Tensor):
            d = ((1 + t) / (10 + t)).clamp(max=decay)
        else:
            d = min(decay, (1 + t) / (10 + t))
        with torch.no_grad():
            new = _lerp(e.locals, [x.detach() for x in p.locals], 1 - d)
        return EmaState(state.count + 1, _local.unflatten(e, new))

    return ParamEma(init, update)
