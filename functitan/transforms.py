"""Function transforms in JAX's shape, on torch.func and autograd: ``loss_fn(params, batch)`` -> a train step.

- ``grad`` / ``value_and_grad`` (``argnums``, ``has_aux``): gradients over the tensor leaves of pytree
  arguments. Two engines, one meaning:

  * eager (the trainer's path): flatten with optree and call ``torch.autograd.grad`` on the leaves. It works
    on DTensor leaves (torch.func cannot see them: it hands the function functorch wrappers), gradients
    keep the leaves' placements, and nothing is wrapped per op.
  * torch.func: inside another functorch transform (``vmap``, ``jvp``, a torch.func ``grad``) the call
    goes to ``torch.func.grad_and_value``, so ``vmap(grad(f))`` (per-example gradients), ``jvp(grad(f))``
    (Hessian-vector products) and ``jacrev(grad(f))`` compose as in JAX.

  Nested eager calls (``grad(grad(f))``) build the inner graph (``create_graph``) so the outer one can
  differentiate it. At the outermost level the value is detached, and so is ``aux`` (JAX returns aux
  without a tangent; here it holds no autograd graph, which would keep activations alive).
- ``vmap``, ``jvp``, ``vjp``, ``jacrev``, ``jacfwd``, ``hessian``, ``hvp``: torch.func's, on pytrees of
  plain tensors, e.g. the local compute tensors ``Layout.params`` returns (DTensor leaves are refused with
  a message naming the fix).
- ``accumulate``: gradient accumulation over microbatches (the mean over microbatches equals one big
  batch when each holds the same number of tokens; a ``TokenLoss`` is summed, so it equals one big batch
  whatever the tokens per microbatch); runs on local shards, keeps placements; composes with ``has_aux``.
- ``remat``: activation checkpointing of a function with a policy (``functitan._remat``).

>>> import torch
>>> f = lambda w, x: (w * x).sum() ** 2
>>> grad(f)(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))   # 2 * (w.x) * x
tensor([66., 88.])
>>> per_example = vmap(grad(f), in_dims=(None, 0))(torch.tensor([1.0, 2.0]), torch.eye(2))
>>> per_example
tensor([[2., 0.],
        [0., 4.]])
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.func as tf
from torch import Tensor
from torch._C._functorch import peek_interpreter_stack
from torch.distributed.tensor import DTensor

from . import _dtensor as _dt
from ._loss import TokenLoss
from ._remat import Policy, remat
from .tree import flatten_with_names

__all__ = [
    "grad",
    "value_and_grad",
    "vmap",
    "jvp",
    "vjp",
    "jacrev",
    "jacfwd",
    "hessian",
    "hvp",
    "accumulate",
    "remat",
    "Policy",
    "split_batch",
]

# Depth of eager differentiation around the current call: nested grads keep their graphs when it is > 0.
_EAGER_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("functitan_eager_grad_depth", default=0)


def _is_diff(x: Any) -> bool:
    return isinstance(x, Tensor) and (x.is_floating_point() or x.is_complex())


def _in_functorch() -> bool:
    """True inside a torch.func transform (vmap, grad, jvp, ...), where leaves are functorch wrappers, and while
    dynamo traces without ``trace_autograd_ops``: it then breaks the graph at torch.autograd.grad but traces
    torch.func.grad_and_value. The compiled train step sets the option (functitan/step.py), so its gradient
    is autograd.grad in the graph, which also works on DTensor params (torch.func cannot see them)."""
    if torch.compiler.is_compiling():
        return not torch._dynamo.config.trace_autograd_ops
    return peek_interpreter_stack() is not None


def _argnums(argnums: int | Sequence[int], nargs: int, name: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(not isinstance(i, int) or not -nargs <= i < nargs for i in nums):
        raise ValueError(f"{name}: argnums={argnums!r} does not name positional arguments of a call with {nargs}")
    return tuple(i % nargs for i in nums)


def _check_loss(loss: Any, fn: Callable[..., Any]) -> None:
    if not (isinstance(loss, Tensor) and loss.numel() == 1):
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise TypeError(
            f"value_and_grad: {getattr(fn, '__name__', 'fn')} must return a scalar tensor loss, got {what}; "
            f"reduce it (e.g. .mean()), or use jacrev for a non-scalar output"
        )


def _differentiated(loss: Any, fn: Callable[..., Any]) -> Tensor:
    """The scalar to differentiate: the loss, or a TokenLoss's sum (the step divides by the global count)."""
    target = loss.sum if isinstance(loss, TokenLoss) else loss
    _check_loss(target, fn)
    if isinstance(loss, TokenLoss) and not (isinstance(loss.count, Tensor) and loss.count.numel() == 1):
        raise TypeError(
            f"value_and_grad: {getattr(fn, '__name__', 'fn')} returned a TokenLoss whose count is a "
            f"{type(loss.count).__name__}; give the count as a 0-d tensor, e.g. (targets != -100).sum()"
        )
    return target


def _detach_tree(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, tree, none_is_leaf=True)


def value_and_grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``fn(*args) -> loss`` becomes ``(*args) -> (loss, grads)`` (``jax.value_and_grad``).

    ``grads`` mirrors ``args[argnums]`` (a tuple of such trees when ``argnums`` is a tuple): a gradient for
    each floating-point tensor leaf (zeros where the loss does not depend on it), ``None`` for other leaves.
    With ``has_aux=True``, ``fn`` returns ``(loss, aux)`` and the result is ``((loss, aux), grads)``. At the
    outermost level the loss and aux are detached. DTensor leaves get gradients with their placements.

    As ``jax.grad``, every floating-point leaf is differentiated, whatever its ``requires_grad``: freeze
    params in the optimizer (``optim.multi_transform({..., "frozen": optim.set_to_zero()}, labels)``), or
    pass them in another argument than ``argnums``.
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        nums = _argnums(argnums, len(args), "value_and_grad")
        if _in_functorch():
            return _func_value_and_grad(fn, nums, argnums, has_aux, args, kwargs)
        return _eager_value_and_grad(fn, nums, argnums, has_aux, args, kwargs)

    return wrapped


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, *, has_aux: bool = False) -> Callable[..., Any]:
    """``jax.grad``: the gradients of ``value_and_grad`` (with ``has_aux``: ``(grads, aux)``)."""
    vg = value_and_grad(fn, argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _eager_value_and_grad(
    fn: Callable[..., Any], nums: tuple[int, ...], argnums: Any, has_aux: bool, args: tuple, kwargs: dict
) -> tuple[Any, Any]:
    compiling = torch.compiler.is_compiling()  # dynamo cannot trace ContextVar: no nesting inside a compiled step
    depth = 0 if compiling else _EAGER_DEPTH.get()
    call_args: list[Any] = list(args)
    flat: list[tuple[list[Any], Any, list[int]]] = []
    for n in nums:
        leaves, treedef = optree.tree_flatten(call_args[n], none_is_leaf=True)
        idx = [i for i, x in enumerate(leaves) if _is_diff(x)]
        for i in idx:
            # a nested call differentiates the outer call's graph through its own leaves: keep them attached
            if not leaves[i].requires_grad or (depth == 0 and leaves[i].grad_fn is not None):
                leaves[i] = leaves[i].detach().requires_grad_(True)
        call_args[n] = optree.tree_unflatten(treedef, leaves)
        flat.append((leaves, treedef, idx))
    token = None if compiling else _EAGER_DEPTH.set(depth + 1)
    try:
        with torch.enable_grad():
            out = fn(*call_args, **kwargs)
    finally:
        if token is not None:
            _EAGER_DEPTH.reset(token)
    if has_aux and not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"value_and_grad(..., has_aux=True): {getattr(fn, '__name__', fn)!r} returned a "
            f"{type(out).__name__}; with has_aux it returns (loss, aux), else drop has_aux"
        )
    loss, aux = out if has_aux else (out, None)
    target = _differentiated(loss, fn)
    diff = [leaves[i] for leaves, _, idx in flat for i in idx]
    nested = depth > 0
    grads = (
        torch.autograd.grad(target, diff, allow_unused=True, create_graph=nested)
        if diff and target.requires_grad
        else [None] * len(diff)
    )
    trees, k = [], 0
    for leaves, treedef, idx in flat:
        out_leaves: list[Any] = [None] * len(leaves)
        for i in idx:
            g = grads[k]
            out_leaves[i] = g if g is not None else torch.zeros_like(leaves[i])
            k += 1
        trees.append(optree.tree_unflatten(treedef, out_leaves))
    grad_tree = trees[0] if isinstance(argnums, int) else tuple(trees)
    if not nested:
        loss = loss.detach() if isinstance(loss, Tensor) else _detach_tree(loss)  # a TokenLoss: both fields
        aux = _detach_tree(aux)
    return ((loss, aux) if has_aux else loss), grad_tree


def _func_value_and_grad(
    fn: Callable[..., Any], nums: tuple[int, ...], argnums: Any, has_aux: bool, args: tuple, kwargs: dict
) -> tuple[Any, Any]:
    # torch.func differentiates every tensor leaf of the argnums trees; non-float leaves are split off and
    # passed through so that integer leaves get None, as on the eager path.
    masks = []
    diff_args = list(args)
    for n in nums:
        leaves, treedef = optree.tree_flatten(args[n], none_is_leaf=True)
        masks.append((leaves, treedef))
        diff_args[n] = [x for x in leaves if _is_diff(x)]

    def inner(*a: Any) -> Any:
        full = list(a)
        for (leaves, treedef), n in zip(masks, nums):
            it = iter(a[n])
            full[n] = optree.tree_unflatten(treedef, [next(it) if _is_diff(x) else x for x in leaves])
        out = fn(*full, **kwargs)
        return _differentiated(out[0] if has_aux else out, fn), out

    g, (_, out) = tf.grad_and_value(inner, argnums=nums, has_aux=True)(*diff_args)
    trees = []
    for (leaves, treedef), gl in zip(masks, g):
        it = iter(gl)
        trees.append(optree.tree_unflatten(treedef, [next(it) if _is_diff(x) else None for x in leaves]))
    grad_tree = trees[0] if isinstance(argnums, int) else tuple(trees)
    return out, grad_tree


# ------------------------------------------------------------------------------------ torch.func, on pytrees


def _plain(tree: Any, name: str) -> None:
    for x in optree.tree_leaves(tree, none_is_leaf=True):
        if isinstance(x, DTensor):
            raise TypeError(
                f"{name} runs on plain tensors, got a DTensor leaf of shape {tuple(x.shape)}; pass the local "
                f"compute tensors (layout.params(params)) or x.to_local()"
            )


def vmap(
    fn: Callable[..., Any],
    in_dims: Any = 0,
    out_dims: Any = 0,
    *,
    chunk_size: int | None = None,
    randomness: str = "error",
) -> Callable[..., Any]:
    """``jax.vmap``: map ``fn`` over a leading (or ``in_dims``) axis of its arguments (``torch.func.vmap``).

    ``vmap(grad(loss), in_dims=(None, 0))(params, examples)`` gives per-example gradients; stacked params
    with ``in_dims=(0, None)`` give an ensemble (see examples/ensemble.py).
    """
    mapped = tf.vmap(fn, in_dims, out_dims, chunk_size=chunk_size, randomness=randomness)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _plain((args, kwargs), "vmap")
        return mapped(*args, **kwargs)

    return wrapped


@functools.cache
def _forward_ad_ready() -> None:
    # torch.func's first forward-mode call imports decompositions built with the deprecated torch.jit.script
    # and warns about it (torch's own use, nothing a caller can change): import them once, quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch._decomp.decompositions_for_jvp  # noqa: F401


def jvp(fn: Callable[..., Any], primals: tuple, tangents: tuple, *, has_aux: bool = False) -> Any:
    """``jax.jvp``: ``(fn(*primals), J @ tangents)`` by forward-mode AD (``torch.func.jvp``)."""
    _plain((primals, tangents), "jvp")
    _forward_ad_ready()
    return tf.jvp(fn, tuple(primals), tuple(tangents), has_aux=has_aux)


def vjp(fn: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Any:
    """``jax.vjp``: ``(fn(*primals), vjp_fn)`` where ``vjp_fn(cotangent)`` is a tuple, one per primal."""
    _plain(primals, "vjp")
    return tf.vjp(fn, *primals, has_aux=has_aux)


def jacrev(fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False) -> Callable[..., Any]:
    """``jax.jacrev``: the Jacobian by reverse mode, one output row per vmapped vjp."""
    return tf.jacrev(fn, argnums, has_aux=has_aux)


def jacfwd(fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False) -> Callable[..., Any]:
    """``jax.jacfwd``: the Jacobian by forward mode, one column per vmapped jvp."""
    _forward_ad_ready()
    return tf.jacfwd(fn, argnums, has_aux=has_aux)


def hessian(fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0) -> Callable[..., Any]:
    """``jax.hessian``: ``jacfwd(jacrev(fn))``; quadratic in the parameter count, so for small problems."""
    _forward_ad_ready()
    return tf.hessian(fn, argnums)


def hvp(fn: Callable[..., Any], primals: tuple, tangents: tuple) -> Any:
    """Hessian-vector product ``H(primals) @ tangents`` of a scalar ``fn``, forward-over-reverse
    (``jvp(grad(fn))``): the cost of about two gradients, without forming H. ``tangents`` mirrors the
    first primal; the result mirrors it too."""
    _plain((primals, tangents), "hvp")
    _forward_ad_ready()
    rest = tuple(primals[1:])
    return tf.jvp(lambda p: grad(fn)(p, *rest), (primals[0],), tuple(tangents))[1]


# ------------------------------------------------------------------------------------ accumulation


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split every tensor leaf of ``batch`` into ``n`` equal microbatches along dim 0."""
    leaves, treedef = optree.tree_flatten(batch)
    for x in leaves:
        if isinstance(x, Tensor) and x.dim() == 0:
            name = next(k for k, v in flatten_with_names(batch)[0] if v is x)
            raise ValueError(
                f"batch leaf {name!r} is a 0-d tensor: microbatches split every tensor of the batch along dim 0; "
                f"give it a batch dim, or pass it as a Python number (numbers go to every microbatch)"
            )
        if isinstance(x, Tensor) and x.shape[0] % n:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split into {n} microbatches; make training.batch_size "
                f"a multiple of training.microbatches"
            )
    chunks = [x.chunk(n) if isinstance(x, Tensor) else [x] * n for x in leaves]
    return [optree.tree_unflatten(treedef, [c[i] for c in chunks]) for i in range(n)]


def _mean_tree(trees: list[Any]) -> Any:
    """Floating tensor leaves averaged over microbatches; other leaves from the last microbatch."""

    def mean(*xs: Any) -> Any:
        if isinstance(xs[-1], Tensor) and xs[-1].is_floating_point():
            return torch.stack([x.detach() for x in xs]).mean(0)
        return xs[-1]

    return optree.tree_map(mean, *trees, none_is_leaf=True)


def accumulate(grad_fn: Callable[..., tuple[Any, Any]], microbatches: int) -> Callable[..., tuple[Any, Any]]:
    """Gradient accumulation: ``grad_fn(params, batch) -> (loss, grads)`` over ``microbatches`` slices of the
    batch (dim 0 of every tensor leaf).

    Returns the mean loss and mean gradients; a loss returning ``TokenLoss(sum, count)`` gives the sums of both
    and of the gradients (the step divides by the count summed over data-parallel ranks too). With
    ``value_and_grad(f, has_aux=True)`` the result is ``((loss, aux), grads)``: floating-point aux leaves are
    averaged over microbatches, others come from the last one. The sums run on local shards (no DTensor
    dispatch); gradients keep their placements. With one microbatch it is ``grad_fn``.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if microbatches == 1:
        return grad_fn

    @functools.wraps(grad_fn)
    def wrapped(params: Any, batch: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        # The sums run on local shards (DTensor gradients keep their specs aside): a foreach op on DTensors
        # pays sharding propagation, which took minutes on the first step of a 4-D mesh.
        values: list[Any] = []
        acc: list[Any] = []
        specs: list[Any] = []
        treedef: Any = None
        for mb in split_batch(batch, microbatches):
            value, grads = grad_fn(params, mb, *args, **kwargs)
            values.append(value)
            leaves, treedef = optree.tree_flatten(grads, none_is_leaf=True)
            if len(values) == 1:
                acc, specs = [_dt.local(g) for g in leaves], [_dt.spec(g) for g in leaves]
                continue
            idx = [i for i, g in enumerate(leaves) if g is not None]
            # out of place: the first microbatch's gradients may alias tensors autograd still holds
            for i, s in zip(idx, torch._foreach_add([acc[i] for i in idx], [_dt.local(leaves[i]) for i in idx])):
                acc[i] = s
        aux = not isinstance(values[0], TokenLoss) and isinstance(values[0], tuple)  # has_aux: (loss, aux)
        losses = [v[0] if aux else v for v in values]
        tokens = isinstance(losses[0], TokenLoss)
        if not tokens:  # a mean per microbatch: the mean of them; a TokenLoss keeps sums (the step divides)
            idx = [i for i, g in enumerate(acc) if g is not None]
            torch._foreach_div_([acc[i] for i in idx], float(microbatches))  # every acc[i] is a sum made above
        out = [None if g is None else _dt.wrap(g, s) for g, s in zip(acc, specs)]
        summed_grads = optree.tree_unflatten(treedef, out)
        if tokens:
            loss: Any = TokenLoss(
                sum(v.sum for v in losses[1:]) + losses[0].sum, sum(v.count for v in losses[1:]) + losses[0].count
            )
        else:
            loss = (sum(losses[1:]) + losses[0]) / microbatches
        return ((loss, _mean_tree([v[1] for v in values])) if aux else loss), summed_grads

    return wrapped
