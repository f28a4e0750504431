"""Muon (Jordan et al., 2024): momentum orthogonalised by a Newton-Schulz iteration, for hidden matrices.

``scale_by_muon`` is the direction, with ``torch.optim.Muon``'s arithmetic (torch 2.13: Keller Jordan's quintic
coefficients, the iteration in bfloat16, the momentum as ``lerp``, the same lr adjustments). ``muon`` is the
optimizer as it is used: ``multi_transform`` of Muon for the hidden matrices and AdamW for the rest
(embeddings, the output head, norm scales, biases), the split read from the params' logical names by
``muon_labels_from_specs``.

**Sharded params.** The momentum is elementwise and stays on the local shards. The orthogonalisation is not:
for a leaf sharded along its matrix dims (FSDP's ``embed``, TP's ``heads``/``mlp``), each rank all-gathers the
direction over those mesh axes (explicit collectives on the local tensors, in the iteration's dtype: the cast
is elementwise, so gathering after it gives the same bits at half the bytes of fp32), runs the iteration on
the whole matrix, and keeps its own shard. Every rank therefore computes what one process computes on the
full matrix, bit for bit; a shard along a stacking dim (the leading dims of a stacked param) needs no
gather, since each matrix is orthogonalised on its own. Every rank holding the same matrix repeats the
iteration (no work is shared out): simple, exact, and the iteration is small next to a step's matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from functitan import _collectives
from functitan._dtensor import DTensorSpec
from functitan.optim import _local
from functitan.optim._aliases import adamw
from functitan.optim._base import GradientTransformation, chain
from functitan.optim._combinators import multi_transform
from functitan.optim._transforms import (
    Mask,
    Schedule,
    _check,
    add_decayed_weights,
    default_decay_mask,
    scale_by_learning_rate,
)
from functitan.tree import flatten_with_names

__all__ = [
    "NS_COEFFICIENTS",
    "MUON_TABLE_AXES",
    "MUON_STACK_AXES",
    "ScaleByMuonState",
    "AdjustLR",
    "orthogonalize",
    "scale_by_muon",
    "muon",
    "default_muon_labels",
    "muon_labels_from_specs",
]

# torch.optim._muon's DEFAULT_A, B, C (from github.com/KellerJordan/Muon, muon.py at f90a42b): the quintic's
# coefficients, chosen to maximise the slope at zero.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Logical axes of params that go to AdamW: a table read by index or producing one logit per row (the
# embedding, the output head, GPT-2's learned positions). A row of it is only updated by the tokens that use it,
# which is not what orthogonalising the whole matrix assumes.
MUON_TABLE_AXES = frozenset({"vocab", "positions"})
# Logical axes that stack matrices rather than being one of a matrix's dims: a stacked param's leading dims
# (GPT-2's fused q/k/v, a layer stack, experts). Each matrix of the stack is orthogonalised on its own.
MUON_STACK_AXES = frozenset({"qkv", "layers", "experts"})

AdjustLR = Literal["original", "match_rms_adamw", "none"]


class ScaleByMuonState(NamedTuple):
    momentum: Any  # the momentum buffer, mirrors params


def orthogonalize(
    x: Tensor,
    *,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Newton-Schulz's approximate ``U V^T`` of every matrix of ``x`` (its last two dims; leading dims are a
    stack, batched), in ``dtype``. For a 2-D ``x`` the ops are ``torch.optim._muon._zeropower_via_newtonschulz``'s
    (cast, transpose a tall matrix, divide by the Frobenius norm clamped at ``eps``, then ``steps`` times
    ``X = a X + (b A + c A^2) X`` with ``A = X X^T``), so the result is the same bits."""
    if x.ndim < 2:
        raise ValueError(f"orthogonalize takes matrices (>= 2 dims), got a tensor of shape {tuple(x.shape)}")
    a, b, c = coefficients
    tall = x.shape[-2] > x.shape[-1]
    y = x.to(dtype)
    if x.ndim == 2:
        y = y.T if tall else y
        y = y / y.norm().clamp(min=eps)
        for _ in range(steps):
            gram = y @ y.T
            y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
        return y.T if tall else y
    lead = x.shape[:-2]
    y = y.reshape(-1, *x.shape[-2:])
    y = y.mT if tall else y
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = y @ y.mT
        y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    y = y.mT if tall else y
    return y.reshape(*lead, *x.shape[-2:])


def _lr_ratio(adjust: AdjustLR, rows: int, cols: int) -> float:
    """``torch.optim._muon._adjust_lr``'s factor for a ``rows x cols`` matrix: Keller Jordan's ``sqrt(max(1,
    rows / cols))``, Moonshot's ``0.2 sqrt(max(rows, cols))`` (the update's RMS then matches AdamW's, so AdamW's
    lr and weight decay carry over), or 1."""
    if adjust == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


class _Unsupported(Exception):
    """A placement the gather does not take; ``update`` names the leaf."""


def _matrix_levels(local: Tensor, s: DTensorSpec | None) -> list[tuple[int, int, int]]:
    """``(mesh dim, tensor dim, that dim's size before this mesh dim splits it)`` for each split of a matrix dim
    (one of the last two) of a leaf with spec ``s``, in mesh order (DTensor splits earlier mesh dims first)."""
    if s is None:
        return []
    from torch.distributed.tensor import Replicate, Shard

    ndim, sizes, levels = local.ndim, list(s.shape), []
    for mi, p in enumerate(s.placements):
        if isinstance(p, Replicate) or s.mesh.size(mi) == 1:
            continue
        if type(p) is not Shard:
            raise _Unsupported(
                f"has placement {p} on mesh dim {mi}; the orthogonalisation gathers Shard and Replicate "
                f"placements only (reduce a Partial gradient first)"
            )
        d = p.dim % ndim
        full = sizes[d]
        sizes[d] = _collectives.chunk(full, s.mesh.size(mi), s.mesh.get_local_rank(mi))[1]
        if d >= ndim - 2:
            levels.append((mi, d, full))
    return levels


def _orthogonalized_shard(x: Tensor, s: DTensorSpec | None, out_dtype: torch.dtype, **ns: Any) -> Tensor:
    """This rank's shard of ``orthogonalize(the full matrices of x)`` in ``out_dtype``, times the lr ratio."""
    adjust = ns.pop("adjust")
    levels = _matrix_levels(x, s)
    full = x.to(ns["dtype"])  # elementwise: the same bits as casting after the gather, half the bytes to move
    for mi, d, size in reversed(levels):  # the innermost split first
        full = _collectives._gather(full, d, size, s.mesh.get_group(mi))  # type: ignore[union-attr]
    rows, cols = full.shape[-2:]
    o = orthogonalize(full, **ns)
    for mi, d, _ in levels:
        n, r = s.mesh.size(mi), s.mesh.get_local_rank(mi)  # type: ignore[union-attr]
        o = o.narrow(d, *_collectives.chunk(o.shape[d], n, r))
    # a new contiguous tensor in the param's dtype (the update is added in it, as torch adds the bf16 update)
    return o.to(out_dtype, copy=True, memory_format=torch.contiguous_format).mul_(_lr_ratio(adjust, rows, cols))


def scale_by_muon(
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    adjust_lr: AdjustLR = "original",
    ns_dtype: torch.dtype = torch.bfloat16,
) -> GradientTransformation:
    """Muon's direction: ``m = lerp(m, g, 1 - momentum)``, then ``orthogonalize(lerp(g, m, momentum))`` (or of
    ``m`` without ``nesterov``) of each matrix, times ``adjust_lr``'s factor of the matrix's (global) shape.

    As ``torch.optim.Muon``: chained with ``add_decayed_weights(wd)`` and ``scale_by_learning_rate(lr)`` it is
    ``p = p * (1 - lr * wd) - lr * ratio * O`` (``muon`` does this). Every leaf needs >= 2 dims; a sharded leaf
    is orthogonalised on its whole matrices (see the module docstring). ``ns_dtype`` is the iteration's dtype:
    bfloat16 as torch (and Keller Jordan) run it; float32 gathers twice the bytes and keeps the iteration from
    amplifying the rounding of its input (bf16 roundings of two nearly equal gradients can differ by an ulp).

    State: ``ScaleByMuonState(momentum)``, the momentum mirroring params (dtype and placement).
    """
    _check(0 <= momentum < 1, f"momentum={momentum}: a momentum in [0, 1), e.g. 0.95")
    _check(1 <= ns_steps < 100, f"ns_steps={ns_steps}: Newton-Schulz iterations in [1, 100), e.g. 5")
    _check(len(ns_coefficients) == 3, f"ns_coefficients={ns_coefficients}: three numbers (a, b, c)")
    _check(eps > 0, f"eps={eps}: a positive eps, e.g. 1e-7")
    _check(
        adjust_lr in ("original", "match_rms_adamw", "none"),
        f"adjust_lr={adjust_lr!r}: choose 'original', 'match_rms_adamw' or 'none'",
    )
    ns = dict(steps=ns_steps, coefficients=tuple(ns_coefficients), eps=eps, dtype=ns_dtype, adjust=adjust_lr)

    def init(params: Any) -> ScaleByMuonState:
        ref = _local.flatten(params, "params")
        for (name, _), local in zip(flatten_with_names(params)[0], ref.locals):
            if local.ndim < 2:
                raise ValueError(
                    f"muon: {name!r} has shape {tuple(local.shape)}; Muon orthogonalises matrices (>= 2 dims): "
                    f"give vectors to another transform (functitan.optim.muon sends them to AdamW)"
                )
        return ScaleByMuonState(_local.zeros_like(ref))

    def update(grads: Any, state: ScaleByMuonState, params: Any = None) -> tuple[Any, ScaleByMuonState]:
        m = _local.flatten(state.momentum, "state.momentum")
        g = _local.flatten_like(m, grads, ("optimizer state", "grads"))
        with torch.no_grad():
            gl = [x if x.dtype == b.dtype else x.to(b.dtype) for x, b in zip(g.locals, m.locals)]
            new_m = list(torch._foreach_lerp(m.locals, gl, 1 - momentum))
            direction = list(torch._foreach_lerp(gl, new_m, momentum)) if nesterov else new_m
            out = []
            for i, (d, s, b) in enumerate(zip(direction, g.specs, m.locals)):
                try:
                    out.append(_orthogonalized_shard(d, s, b.dtype, **ns))
                except _Unsupported as e:
                    name = flatten_with_names(grads)[0][i][0]
                    raise ValueError(f"muon: the gradient of {name!r} {e}") from None
        return _local.unflatten(g, out), ScaleByMuonState(_local.unflatten(m, new_m))

    return GradientTransformation(init, update)


def default_muon_labels(name: str, param: Any) -> str:
    """``"muon"`` for a 2-D param, ``"adamw"`` otherwise: ``torch.optim.Muon``'s rule, which cannot tell an
    embedding from a hidden matrix; with specs at hand, ``muon_labels_from_specs`` can.

    >>> default_muon_labels("layers.0.attn.wq", torch.zeros(4, 4)), default_muon_labels("norm", torch.zeros(4))
    ('muon', 'adamw')
    """
    return "muon" if param.ndim == 2 else "adamw"


def muon_labels_from_specs(
    specs: Any,
    *,
    table_axes: frozenset[str] | set[str] = MUON_TABLE_AXES,
    stack_axes: frozenset[str] | set[str] = MUON_STACK_AXES,
) -> Callable[[str, Any], str]:
    """Labels for ``muon``'s split read from the params' logical names: ``"muon"`` for a hidden matrix, else
    ``"adamw"``.

    A param is a hidden matrix iff, once its ``stack_axes`` dims are set aside (``qkv``, ``layers``,
    ``experts``: they stack matrices), exactly two dims remain, they are its last two, and none is named in
    ``table_axes`` (``vocab``, ``positions``: the embedding, the output head and learned positions). So
    ``("heads", "embed")`` and ``("qkv", "heads", "embed")`` (three matrices) are Muon's; ``("vocab", "embed")``,
    ``("embed",)``, a stacked bias ``("qkv", "heads")`` and a router ``("experts", "embed")`` are AdamW's. A name
    the specs do not have falls back to ``default_muon_labels``.

    Example::

        >>> labels = muon_labels_from_specs({"embed": ("vocab", "embed"), "wq": ("heads", "embed"), "b": ("embed",)})
        >>> [labels(n, torch.zeros(2, 2)) for n in ("embed", "wq")], labels("b", torch.zeros(2))
        (['adamw', 'muon'], 'adamw')
    """
    from functitan._rules import is_spec

    named = dict(flatten_with_names(specs, is_leaf=is_spec)[0])

    def labels(name: str, param: Any) -> str:
        spec = named.get(name)
        if spec is None:
            return default_muon_labels(name, param)
        matrix = [i for i, a in enumerate(spec) if a not in stack_axes]
        hidden = matrix == [len(spec) - 2, len(spec) - 1] and not any(spec[i] in table_axes for i in matrix)
        return "muon" if hidden else "adamw"

    return labels


def muon(
    learning_rate: float | Schedule,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    weight_decay: float = 0.1,
    adjust_lr: AdjustLR = "original",
    mask: Mask | None = default_decay_mask,
    labels: Callable[[str, Any], str] | Any = default_muon_labels,
    adam_learning_rate: float | Schedule | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    adam_eps: float = 1e-8,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> GradientTransformation:
    """Muon for the hidden matrices, AdamW for the other params: ``multi_transform`` by ``labels``.

    The params ``labels`` calls ``"muon"`` get ``chain(scale_by_muon(...), add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate(learning_rate))``, which equals ``torch.optim.Muon`` (same defaults:
    momentum 0.95, Nesterov, 5 steps, lr adjusted as ``"original"``) up to the rounding of the final add; the
    ``"adamw"`` ones get ``adamw(adam_learning_rate or learning_rate, b1, b2, adam_eps, weight_decay, mask)``.

    ``labels`` is ``(name, param) -> "muon" | "adamw"`` or a tree of them; the default, ``default_muon_labels``,
    is torch's 2-D rule, and the trainer passes ``muon_labels_from_specs(specs)``, which also sends embeddings
    and the output head to AdamW. With ``adjust_lr="original"`` Muon wants a larger lr than AdamW (0.02 vs
    3e-4 in Keller Jordan's runs): pass ``adam_learning_rate``; ``"match_rms_adamw"`` (Moonshot) lets one lr and
    weight decay serve both groups, as the trainer's config does.

    State: ``MultiTransformState({"muon": (ScaleByMuonState, EmptyState, schedule state), "adamw": adamw's})``.
    """
    muon_part = chain(
        scale_by_muon(
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            eps=eps,
            adjust_lr=adjust_lr,
            ns_dtype=ns_dtype,
        ),
        add_decayed_weights(weight_decay, mask=mask),
        scale_by_learning_rate(learning_rate),
    )
    adam_lr = learning_rate if adam_learning_rate is None else adam_learning_rate
    adam_part = adamw(adam_lr, b1=b1, b2=b2, eps=adam_eps, weight_decay=weight_decay, mask=mask)
    return multi_transform({"muon": muon_part, "adamw": adam_part}, labels)
