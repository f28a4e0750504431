"""The train step: ``train_step(state, batch) -> (state, metrics)``, built from a loss and an optimizer.

    grad_fn(params, batch)          # accumulate(value_and_grad(loss_fn), microbatches), or a pipeline
                                    # executor: (mean loss, grads in the params' placements)
      -> global_norm                # of the full gradient, however it is sharded (and across pp stages)
      -> non-finite guard           # stop with the step named, or skip the update
      -> clip_to_norm               # with that same norm
      -> optimizer.update           # functional: new opt_state
      -> apply_updates              # functional: new params
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

from . import optim
from .errors import UserError
from .random import fold_in
from .train_state import TrainState

__all__ = ["make_train_step", "NonFiniteLossError", "NONFINITE_POLICIES"]

NonFinitePolicy = Literal["stop", "skip"]
NONFINITE_POLICIES: tuple[str, ...] = get_args(NonFinitePolicy)


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss or gradient norm was NaN or infinite; the message names which, and the step."""


def _nonfinite_message(loss: float, gnorm: float, step: int) -> str:
    bad = [f"{name} {v}" for name, v in (("loss", loss), ("grad norm", gnorm)) if not math.isfinite(v)]
    good = [f"{name} {v:.4g}" for name, v in (("loss", loss), ("grad norm", gnorm)) if math.isfinite(v)]
    return (f"non-finite {' and '.join(bad)}{f' ({good[0]})' if good else ''} at step {step}; lower optimizer.lr, "
            f"enable clipping (optimizer.max_norm), or set training.on_nonfinite='skip'")


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
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, float]]]:
    """Build ``train_step(state, batch) -> (state, metrics)``.

    Args:
        grad_fn: ``(params, batch) -> (loss, grads)``: ``accumulate(value_and_grad(loss_fn), microbatches)``,
            or a pipeline schedule's executor; ``loss`` is the mean over this rank's batch.
        optimizer: an optax-shaped transformation.
        max_norm: clip the gradient to this global norm (0: no clipping). Done here rather than by
            ``optim.clip_by_global_norm`` in the chain because the step needs the norm anyway (metrics, the
            non-finite guard): one norm per step instead of two.
        norm_across: a process group whose ranks hold other parameters (pipeline stages): the norm covers them.
        on_nonfinite: "stop" raises NonFiniteLossError naming the step; "skip" leaves params and optimizer
            state unchanged for that step and reports ``skipped=1``.

    ``metrics`` holds ``loss`` (mean over data-parallel ranks), ``grad_norm`` (of the full gradient, before
    clipping) and ``skipped``.
    """
    if on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"training.on_nonfinite={on_nonfinite!r}; choose one of {NONFINITE_POLICIES}")

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, float]]:
        loss, grads = grad_fn(state.params, batch)
        with torch.no_grad():
            gnorm = optim.global_norm(grads, across=norm_across)
            stats = _mean_over_ranks(torch.stack([loss.float(), gnorm.float().to(loss.device)]))
        loss_v, gnorm_v = stats.tolist()
        # the gradient norm is global and the loss is averaged: every rank takes the same branch
        if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
            if on_nonfinite == "stop":
                raise NonFiniteLossError(_nonfinite_message(loss_v, gnorm_v, state.step + 1))
            nxt = state._replace(step=state.step + 1, rng=fold_in(state.rng, state.step))
            return nxt, {"loss": loss_v, "grad_norm": gnorm_v, "skipped": 1}
        if max_norm > 0:
            grads = optim.clip_to_norm(grads, gnorm, max_norm)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optim.apply_updates(state.params, updates)
        nxt = state._replace(step=state.step + 1, params=params, opt_state=opt_state, rng=fold_in(state.rng, state.step))
        return nxt, {"loss": loss_v, "grad_norm": gnorm_v, "skipped": 0}

    return train_step
