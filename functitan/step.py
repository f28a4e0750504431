"""The train step: ``train_step(state, batch) -> (state, metrics)``, built from a loss and an optimizer.

grad_fn(params, batch)          # accumulate(value_and_grad(loss_fn), microbatches), or a pipeline
                                # executor: (mean loss, grads in the params' placements), or
                                # (TokenLoss(sum, count), grads of the sum)
  -> balance.take               # MoE balancing biases: their gradient is the load; the new bias from it
  -> global_norm                # of the full gradient, however it is sharded (and across pp stages)
  -> one all-reduce             # loss and norm over ranks; a TokenLoss's count: the scale 1 / count
  -> non-finite guard           # stop with the step named, or skip the update
  -> clip_to_norm               # with that same norm (and the count's scale: one pass)
  -> optimizer.update           # functional: new opt_state
  -> apply_updates              # functional: new params
  -> balance.put                # the biases from the load, not from the optimizer
                                # (donate=True: optimizer.update_in_place, one fused pass, same buffers)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import Tensor

from . import optim
from ._choices import NONFINITE_POLICIES
from ._loss import TokenLoss
from .errors import UserError
from .moe._balance import LoadBalance
from .optim._transforms import scale_tree
from .random import fold_in
from .train_state import TrainState
from .tree import flatten_with_names

__all__ = ["make_train_step", "NonFiniteLossError", "NONFINITE_POLICIES"]


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss or gradient norm was NaN or infinite; the message names which, and the step."""


def _nonfinite_message(loss: float, gnorm: float, step: int) -> str:
    bad = [f"{name} {v}" for name, v in (("loss", loss), ("grad norm", gnorm)) if not math.isfinite(v)]
    good = [f"{name} {v:.4g}" for name, v in (("loss", loss), ("grad norm", gnorm)) if math.isfinite(v)]
    return (
        f"non-finite {' and '.join(bad)}{f' ({good[0]})' if good else ''} at step {step}; lower optimizer.lr, "
        f"enable clipping (optimizer.max_norm), or set training.on_nonfinite='skip'"
    )


def _mean_over_ranks(x: Tensor) -> Tensor:
    # Every rank of a data-parallel group holds its own batch's mean; ranks that share a batch (tensor
    # parallel) hold the same value, so the mean over all ranks is the mean over data-parallel ranks.
    if dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x


def make_train_step(
    grad_fn: Callable[[Any, Any], tuple[Tensor, Any]],
    optimizer: optim.GradientTransformation,
    *,
    max_norm: float = 0.0,
    norm_across: dist.ProcessGroup | None = None,
    on_nonfinite: str = "stop",
    compile: bool | str = False,
    donate: bool = False,
    balance: LoadBalance | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, float]]]:
    """Build ``train_step(state, batch) -> (state, metrics)``.

    Args:
        grad_fn: ``(params, batch) -> (loss, grads)``: ``accumulate(value_and_grad(loss_fn), microbatches)``,
            or a pipeline schedule's executor; ``loss`` is the mean over this rank's batch, or a
            ``TokenLoss(sum, count)`` with the gradient of the sum: the step then divides loss and gradient by
            the count added over data-parallel ranks (the mean over the step's tokens, exact under any mask).
        optimizer: an optax-shaped transformation.
        max_norm: clip the gradient to this global norm (0: no clipping). Done here rather than by
            ``optim.clip_by_global_norm`` in the chain because the step needs the norm anyway (metrics, the
            non-finite guard): one norm per step instead of two.
        norm_across: a process group whose ranks hold other parameters (pipeline stages): the norm covers them.
        on_nonfinite: "stop" raises NonFiniteLossError naming the step; "skip" leaves params and optimizer
            state unchanged for that step and reports ``skipped=1``.
        compile: ``torch.compile`` the whole step (forward, backward, norm, clipping, optimizer update) as one
            graph, as ``jax.jit`` would: see ``_compiled_step``. A string names the backend (``"aot_eager"``
            traces forward and backward without generating code: quick to build, for tests).
        donate: the step owns the state it is given, as with ``jax.jit(step, donate_argnums=0)``: params and
            optimizer state are updated in place where the optimizer has a fused in-place path
            (``optimizer.update_in_place``: adamw), and the state passed in must not be read afterwards.
            The trainer donates; the default keeps every input valid.
        balance: MoE balancing biases (``functitan.moe.LoadBalance``: the leaves whose gradient is their layer's
            load): each moves by the balance rule after the step, outside the optimizer, the gradient norm and
            clipping; ``moe_bias_norm`` (over all of them) joins the metrics. Without it such a bias would be
            trained by the optimizer on its load: pass it for any model that declares one.

    ``train_step(state, batch, before_update=fence)``: a donating step calls ``fence()`` after the forward and
    backward and just before it changes the state's buffers (e.g. ``CheckpointManager.staged``: a checkpoint
    copying them in the background finishes first); a functional step never changes them and never calls it.

    ``metrics`` holds ``loss`` (mean over data-parallel ranks; a TokenLoss: over the step's tokens),
    ``grad_norm`` (of the full gradient, before clipping) and ``skipped``; with ``value_and_grad(loss_fn,
    has_aux=True)``, also ``aux``: the auxiliary outputs, detached, averaged over data-parallel ranks (a
    ``TokenLoss`` leaf: its sum over its count, over the step; see ``_reduce_aux``).
    """
    if on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"training.on_nonfinite={on_nonfinite!r}; choose one of {NONFINITE_POLICIES}")

    if compile:
        backend = compile if isinstance(compile, str) else "inductor"
        return _compiled_step(
            grad_fn,
            optimizer,
            max_norm=max_norm,
            norm_across=norm_across,
            on_nonfinite=on_nonfinite,
            backend=backend,
            balance=balance,
        )

    in_place = optimizer.update_in_place if donate else None

    def train_step(
        state: TrainState, batch: Any, *, before_update: Callable[[], None] | None = None
    ) -> tuple[TrainState, dict[str, float]]:
        value, grads = grad_fn(state.params, batch)
        loss, aux = _loss_and_aux(value)
        biases = balance.take(grads, state.params) if balance is not None else {}
        with torch.no_grad():
            gnorm = optim.global_norm(grads, across=norm_across)
            stats, scale = _reduce_stats(loss, gnorm)
        loss_v, gnorm_v = stats.tolist()
        # the gradient norm is global and the loss is averaged: every rank takes the same branch
        if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
            if on_nonfinite == "stop":
                raise NonFiniteLossError(_nonfinite_message(loss_v, gnorm_v, state.step + 1))
            nxt = state._replace(step=state.step + 1, rng=fold_in(state.rng, state.step))
            return nxt, _metrics(loss_v, gnorm_v, 1, aux)
        grads = _normalise(grads, gnorm, scale, max_norm, in_place=donate)  # the step owns its grads
        if in_place is not None and before_update is not None:
            before_update()  # the fence: e.g. a checkpoint still copying these buffers (the functional path reads them)
        done = in_place(grads, state.opt_state, state.params) if in_place else None
        if done is None:
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optim.apply_updates(state.params, updates)
        else:
            params, opt_state = done
        if balance is not None:
            params = balance.put(params, biases)
        nxt = state._replace(
            step=state.step + 1, params=params, opt_state=opt_state, rng=fold_in(state.rng, state.step)
        )
        return nxt, {**_metrics(loss_v, gnorm_v, 0, aux), **_bias_norm(balance, params, norm_across)}

    return train_step


def _compiled_step(
    grad_fn: Callable[[Any, Any], tuple[Tensor, Any]],
    optimizer: optim.GradientTransformation,
    *,
    max_norm: float,
    norm_across: dist.ProcessGroup | None,
    on_nonfinite: str,
    backend: str = "inductor",
    balance: LoadBalance | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, float]]]:
    """The step as one ``torch.compile`` graph: ``update(params, opt_state, batch)`` holds every tensor op, and
    the host does only what needs Python values (the metrics' ``.tolist()``, the non-finite decision).

    Unlike the eager step, the update is computed before the finiteness is known: "stop" raises afterwards
    (the new state is dropped), "skip" keeps the old state (``torch.where`` on every leaf, inside the graph).
    Step counters stay 0-d tensors inside the graph (``optim.step_number``), so the graph is reused every step.
    DTensor params (FSDP, DDP) trace too: the collectives become functional collectives in the graph (see
    docs/parallelism.md, "Compiling the whole step"); ``train_step.explain(params, opt_state, batch)`` reports
    the graphs and breaks of exactly what is compiled.
    """
    skip = on_nonfinite == "skip"

    def update(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Tensor, Any]:
        value, grads = grad_fn(params, batch)
        loss, aux = _loss_and_aux(value, reduce=False)  # reduced outside the graph
        biases = balance.take(grads, params) if balance is not None else {}
        with torch.no_grad():
            gnorm = optim.global_norm(grads, across=norm_across)
            stats, scale = _reduce_stats(loss, gnorm)
            grads = _normalise(grads, gnorm, scale, max_norm)
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            new_params = optim.apply_updates(params, updates)
            if balance is not None:
                new_params = balance.put(new_params, biases)
            if skip:
                finite = torch.isfinite(stats).all()
                new_params = _select(finite, new_params, params)
                new_opt_state = _select(finite, new_opt_state, opt_state)
        return new_params, new_opt_state, stats, aux

    compiled = torch.compile(update, backend=backend)
    # dynamo traces torch.autograd.grad only when asked: the gradient then stays in the graph on any leaves,
    # DTensors included (torch.func.grad, the other traceable engine, cannot see DTensor params)
    config = torch._dynamo.config.patch(trace_autograd_ops=True)

    def train_step(
        state: TrainState, batch: Any, *, before_update: Callable[[], None] | None = None
    ) -> tuple[TrainState, dict[str, float]]:
        del before_update  # the compiled step is functional: it never changes the state it is given
        # a graph may not return leaves that need grad (dynamo breaks the graph there): the params go in and
        # come out without the flag, which is set again here (in place, on leaves: no copy, no dispatch)
        _set_requires_grad(state.params, False)
        with config:
            params, opt_state, stats, aux = compiled(state.params, state.opt_state, batch)
        _set_requires_grad(params, True)
        aux = _reduce_aux(aux)
        loss_v, gnorm_v = stats.tolist()
        finite = math.isfinite(loss_v) and math.isfinite(gnorm_v)
        if not finite and not skip:
            raise NonFiniteLossError(_nonfinite_message(loss_v, gnorm_v, state.step + 1))
        nxt = state._replace(
            step=state.step + 1, params=params, opt_state=opt_state, rng=fold_in(state.rng, state.step)
        )
        return nxt, {**_metrics(loss_v, gnorm_v, int(not finite), aux), **_bias_norm(balance, params, norm_across)}

    def explain(params: Any, opt_state: Any, batch: Any) -> Any:
        """``torch._dynamo.explain`` of the step's graph (its ``graph_break_count`` is 0), as compiled."""
        _set_requires_grad(params, False)
        try:
            with config:
                return torch._dynamo.explain(update)(params, opt_state, batch)
        finally:
            _set_requires_grad(params, True)

    train_step.compiled = compiled  # type: ignore[attr-defined]  # for benchmarks
    train_step.update = update  # type: ignore[attr-defined]
    train_step.explain = explain  # type: ignore[attr-defined]
    return train_step


def _reduce_stats(loss: Tensor | TokenLoss, gnorm: Tensor) -> tuple[Tensor, Tensor | None]:
    """``([loss, grad norm] over the step, scale or None)``: one all-reduce either way.

    A mean loss is averaged over ranks. A ``TokenLoss`` came with the gradient of its sum (summed over
    microbatches, averaged over data-parallel ranks by DDP / FSDP): loss and gradient are divided by the
    count, added over the same ranks. Ranks that share a batch (tp, pp) hold the same sum and count, so the
    mean over all ranks of each is the mean over data-parallel ranks, and ``1 / mean(count)`` is the scale
    that turns the dp-averaged gradient of the sums into that of ``sum / global count``.
    """
    if not isinstance(loss, TokenLoss):
        return _mean_over_ranks(torch.stack([loss.float(), gnorm.float().to(loss.device)])), None
    total, count, norm = _mean_over_ranks(
        torch.stack([loss.sum.float(), loss.count.float().to(loss.sum.device), gnorm.float().to(loss.sum.device)])
    )
    scale = torch.where(count > 0, 1.0 / count, 0.0)  # a step without a token: loss 0, no gradient
    return torch.stack([total * scale, norm * scale]), scale


def _normalise(grads: Any, gnorm: Tensor, scale: Tensor | None, max_norm: float, *, in_place: bool = False) -> Any:
    """The gradients divided by the token count (``scale``) and clipped to ``max_norm``: one scaling pass."""
    if scale is None:
        return optim.clip_to_norm(grads, gnorm, max_norm, in_place=in_place) if max_norm > 0 else grads
    factor = scale.to(gnorm.device)
    if max_norm > 0:  # clip_to_norm's min(1, max_norm / norm) of the divided gradient, with the division
        factor = factor * (max_norm / (gnorm * factor)).clamp(max=1.0)
    return scale_tree(grads, factor, in_place=in_place)


def _loss_and_aux(value: Any, *, reduce: bool = True) -> tuple[Tensor | TokenLoss, Any]:
    """(loss, aux or None) from what the gradient function returned as its value; aux detached and, with
    ``reduce``, averaged over data-parallel ranks (``_reduce_aux``)."""
    if isinstance(value, (Tensor, TokenLoss)):
        return value, None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (Tensor, TokenLoss)):
        aux = optree.tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, value[1])
        return value[0], _reduce_aux(aux) if reduce else aux
    raise TypeError(
        f"the gradient function returned a {type(value).__name__} as its value; make_train_step takes "
        f"(loss, grads) or, from value_and_grad(..., has_aux=True), ((loss, aux), grads), with a 0-d tensor loss"
    )


def _reduce_aux(aux: Any) -> Any:
    """The step's aux values instead of this rank's: each 0-d float tensor averaged over data-parallel ranks, a
    ``TokenLoss`` leaf (a token mean: ``layout.token_mean``, ``cross_entropy(reduction="tokens")``; its sum may
    be a vector, a MoE layer's routed tokens per expert) its sum over its count, both added over the ranks (and, by ``accumulate``, the microbatches). One all-reduce for all of
    them; ranks that share a batch hold the same values, so the mean over all ranks is the data-parallel mean."""
    leaves, treedef = optree.tree_flatten(aux, is_leaf=lambda x: isinstance(x, TokenLoss), none_is_leaf=True)
    parts: list[Tensor] = []  # 1-D pieces of one all-reduce
    for x in leaves:
        if isinstance(x, TokenLoss):  # a sum of any shape (per-expert counts) over one count
            parts += [x.sum.float().flatten(), x.count.float().reshape(1).to(x.sum.device)]
        elif isinstance(x, Tensor) and x.is_floating_point() and x.numel() == 1:
            parts.append(x.float().reshape(1))
    if not parts:
        return aux
    device = parts[0].device
    reduced = _mean_over_ranks(torch.cat([p.to(device) for p in parts]))
    at = 0

    def take(n: int) -> Tensor:
        nonlocal at
        at += n
        return reduced[at - n : at]

    out = []
    for x in leaves:
        if isinstance(x, TokenLoss):
            total, count = take(x.sum.numel()).reshape(x.sum.shape), take(1).reshape(())
            out.append(torch.where(count > 0, total / count.clamp_min(1e-30), 0.0))
        elif isinstance(x, Tensor) and x.is_floating_point() and x.numel() == 1:
            out.append(take(1).to(x.dtype).reshape(x.shape))
        else:
            out.append(x)
    return optree.tree_unflatten(treedef, out)


def _metrics(loss: float, gnorm: float, skipped: int, aux: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"loss": loss, "grad_norm": gnorm, "skipped": skipped}
    if aux is not None:
        out["aux"] = aux
    return out


def _bias_norm(balance: LoadBalance | None, params: Any, across: dist.ProcessGroup | None) -> dict[str, float]:
    """``{"moe_bias_norm": the L2 norm of every balancing bias in params}`` (over pipeline stages too); {} without."""
    if balance is None:
        return {}
    mine = [b for n, b in flatten_with_names(params)[0] if n in balance.names]
    return {"moe_bias_norm": float(optim.global_norm(mine, across=across))}


def _set_requires_grad(tree: Any, flag: bool) -> None:
    for x in optree.tree_leaves(tree):
        if isinstance(x, Tensor) and x.is_floating_point() and x.is_leaf:
            x.requires_grad_(flag)


def _select(keep_new: Tensor, new: Any, old: Any) -> Any:
    """``new`` where ``keep_new`` else ``old``, leaf by leaf (requires_grad as the old leaf)."""

    def pick(a: Any, b: Any) -> Any:
        if not isinstance(a, Tensor):
            return a
        out = torch.where(keep_new.to(a.device), a, b)
        return out.requires_grad_(b.requires_grad) if b.requires_grad else out

    return optree.tree_map(pick, new, old)
