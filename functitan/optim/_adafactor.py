"""Lion and Adafactor, with optax's semantics (``optax.lion``, ``optax.adafactor``).

Lion is elementwise and runs foreach on local shards. Adafactor's factored second moments are means over
rows and columns of a whole matrix, so a sharded leaf computes them with DTensor ops (which insert the
reductions over its shards): correct under any placement, slower than the fused path; meant for recipes
that need its memory (no second-moment matrix), not for the hot path of a small model.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functitan.optim import _local
from functitan.optim._base import GradientTransformation, chain
from functitan.optim._transforms import (
    Mask,
    Schedule,
    _check,
    _zero_count,
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
    step_number,
)

__all__ = ["ScaleByLionState", "FactoredState", "scale_by_lion", "lion", "scale_by_factored_rms", "adafactor"]


class ScaleByLionState(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # () int64
    mu: Any  # momentum, mirrors params


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction (Chen et al., 2023, arXiv 2302.06675): ``sign(b1 * mu + (1 - b1) * g)``, then
    ``mu = b2 * mu + (1 - b2) * g``."""
    _check(0 <= b1 <= 1 and 0 <= b2 <= 1, f"b1={b1}, b2={b2}: both must lie in [0, 1], e.g. b1=0.9, b2=0.99")

    def init(params: Any) -> ScaleByLionState:
        return ScaleByLionState(_zero_count(), _local.zeros_like(_local.flatten(params, "params")))

    def update(grads: Any, state: ScaleByLionState, params: Any = None) -> tuple[Any, ScaleByLionState]:
        mu = _local.flatten(state.mu, "state.mu")
        g = _local.flatten_like(mu, grads, ("optimizer state", "grads"))
        with torch.no_grad():
            gl = [x.to(m.dtype) for x, m in zip(g.locals, mu.locals)]
            direction = torch._foreach_lerp(mu.locals, gl, 1 - b1)
            torch._foreach_sign_(direction)
            new_mu = torch._foreach_lerp(mu.locals, gl, 1 - b2)
        return _local.unflatten(g, direction), ScaleByLionState(state.count + 1, _local.unflatten(mu, new_mu))

    return GradientTransformation(init, update)


def lion(
    learning_rate: float | Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Lion = ``chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask), scale_by_learning_rate)``
    (optax's defaults; use a learning rate 3-10x smaller than AdamW's)."""
    return chain(
        scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask=mask), scale_by_learning_rate(learning_rate)
    )


class FactoredState(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # () int64
    v_row: Any  # per leaf: row means of g^2 (factored leaves), else a 0-element placeholder
    v_col: Any  # per leaf: column means of g^2 (factored leaves), else a 0-element placeholder
    v: Any  # per leaf: the full second moment (unfactored leaves), else a 0-element placeholder


def _factored_dims(shape: tuple[int, ...], factored: bool, min_dim: int) -> tuple[int, int] | None:
    """optax's rule: the two largest dims (d0 second largest, d1 largest), if the second is >= min_dim."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda i: (shape[i], i))
    if shape[order[-2]] < min_dim:
        return None
    return order[-2], order[-1]


def _drop(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return shape[:dim] + shape[dim + 1 :]


def scale_by_factored_rms(
    *,
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
) -> GradientTransformation:
    """Adafactor's scaling (Shazeer & Stern, 2018, arXiv 1804.04235): ``g / sqrt(v)`` with ``v`` the outer
    product of row and column means of ``g^2`` for matrices, a full moment otherwise; the moment decay at
    step t (from 1) is ``1 - t**-decay_rate``."""

    def init(params: Any) -> FactoredState:
        def one(p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            # plain tensors holding the full statistics on every rank (row and column means are small next
            # to the matrix; the full moment of an unfactored leaf is a vector or a small matrix)
            dims = _factored_dims(tuple(p.shape), factored, min_dim_size_to_factor)
            device = _local.flatten([p]).locals[0].device
            zeros = lambda shape: torch.zeros(shape, dtype=p.dtype, device=device)  # noqa: E731
            if dims is None:
                return zeros((0,)), zeros((0,)), zeros(tuple(p.shape))
            d0, d1 = dims
            return zeros(_drop(tuple(p.shape), d1)), zeros(_drop(tuple(p.shape), d0)), zeros((0,))

        leaves, treedef = optree.tree_flatten(params)
        parts = [one(p) for p in leaves]
        return FactoredState(_zero_count(), *(optree.tree_unflatten(treedef, [x[k] for x in parts]) for k in range(3)))

    def update(grads: Any, state: FactoredState, params: Any = None) -> tuple[Any, FactoredState]:
        t = step_number(state.count, 1 - step_offset)  # an int eagerly, a 0-d tensor under torch.compile
        rho = 1.0 - t ** (-decay_rate)
        leaves, treedef = optree.tree_flatten(grads)
        rows, cols, vs = (treedef.flatten_up_to(x) for x in (state.v_row, state.v_col, state.v))
        out, new_r, new_c, new_v = [], [], [], []
        with torch.no_grad():
            for g, r, c, v in zip(leaves, rows, cols, vs):
                full = g.full_tensor() if hasattr(g, "full_tensor") else g
                g2 = full * full + epsilon
                dims = _factored_dims(tuple(g.shape), factored, min_dim_size_to_factor)
                if dims is None:
                    v = rho * v + (1 - rho) * g2
                    u = full * v.rsqrt()
                else:
                    d0, d1 = dims
                    r = rho * r + (1 - rho) * g2.mean(d1)
                    c = rho * c + (1 - rho) * g2.mean(d0)
                    rd1 = d1 - 1 if d1 > d0 else d1
                    row_factor = (r / r.mean(rd1, keepdim=True)).rsqrt()
                    u = full * row_factor.unsqueeze(d1) * c.rsqrt().unsqueeze(d0)
                out.append(_like(g, u))
                new_r.append(r)
                new_c.append(c)
                new_v.append(v)
        unflat = lambda xs: optree.tree_unflatten(treedef, xs)  # noqa: E731
        return unflat(out), FactoredState(state.count + 1, unflat(new_r), unflat(new_c), unflat(new_v))

    return GradientTransformation(init, update)


def _like(ref: Tensor, full: Tensor) -> Tensor:
    """``full`` (the whole tensor, identical on every rank) laid out as ``ref``: this rank's shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(ref, DTensor):
        return full
    return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)


def _clip_by_block_rms(threshold: float) -> GradientTransformation:
    # optax.clip_by_block_rms: each leaf scaled by 1 / max(1, rms(leaf) / threshold)
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        with torch.no_grad():
            return optree.tree_map(lambda u: _times(u, 1.0 / torch.clamp(_rms(u) / threshold, min=1.0)), updates), state

    return GradientTransformation(lambda params: (), update)


def _times(u: Tensor, factor: Tensor) -> Tensor:
    """``u * factor`` (a 0-d plain tensor) on the local shard, keeping ``u``'s placement."""
    f = _local.flatten([u], "updates")
    return _local.wrap(f.locals[0] * factor.to(f.locals[0].device), f.specs[0])


def _rms(x: Tensor) -> Tensor:
    full = x.full_tensor() if hasattr(x, "full_tensor") else x
    return full.to(torch.promote_types(full.dtype, torch.float32)).pow(2).mean().sqrt()


def _scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    # optax.scale_by_param_block_rms: each leaf times max(rms(param), min_scale)
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError(
                "adafactor(multiply_by_parameter_scale=True) needs the params: call update(grads, state, params)"
            )
        with torch.no_grad():
            return optree.tree_map(lambda u, p: _times(u, torch.clamp(_rms(p), min=min_scale)), updates, params), state

    return GradientTransformation(lambda params: (), update)


def adafactor(
    learning_rate: float | Schedule | None = None,
    *,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: float | None = 1.0,
    weight_decay_rate: float | None = None,
    weight_decay_mask: Mask | None = None,
    eps: float = 1e-30,
    factored: bool = True,
) -> GradientTransformation:
    """``optax.adafactor`` without momentum: factored RMS scaling, block-RMS clipping, the learning rate,
    parameter-scale multiplication and optional decay, then descent. ``learning_rate=None`` leaves the
    relative step (``multiply_by_parameter_scale``) as the only scale, as in the paper."""
    parts = [
        scale_by_factored_rms(
            factored=factored,
            decay_rate=decay_rate,
            step_offset=decay_offset,
            min_dim_size_to_factor=min_dim_size_to_factor,
            epsilon=eps,
        )
    ]
    if clipping_threshold is not None:
        parts.append(_clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        parts.append(scale_by_learning_rate(learning_rate))
        parts.append(scale(-1.0))  # scale_by_learning_rate descends; optax's flip_sign=False keeps the sign here
    if multiply_by_parameter_scale:
        parts.append(_scale_by_param_block_rms())
    if weight_decay_rate is not None:
        parts.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    parts.append(scale(-1.0))
    return chain(*parts)
