"""``check_names``: run a model once on meta tensors and compare every use of a param with its declaration."""

from __future__ import annotations

from typing import Any

import torch

from .._names import NameTable
from .._rules import Rules, default_rules
from .._usage import Tracker
from ..sharding import Layout
from ..tree import flatten_with_names
from ._model import Model
from ._param import count, init, is_param

__all__ = ["check_names"]


# a model whose loss meta tensors cannot run is checked on real CPU tensors up to this many parameters
REAL_CHECK_MAX_PARAMS = 1 << 27


def check_names(
    model: Model,
    cfg: Any,
    *,
    seq_len: int = 8,
    tp: int = 1,
    sequence_parallel: bool = False,
    rules: Rules | None = None,
    cp: int = 1,
    cp_attention: str = "allgather",
) -> set[str]:
    """Raise ValueError at the first use of a param that its declaration contradicts, for a layout of ``tp``.

    The model's loss runs once on the meta device (nothing is allocated, no collective runs), with a Layout
    in check mode and every torch op it calls watched (``functitan._usage``): each contraction's names (of the
    param, a slice or index of it, a transpose) against the declared names, and with ``tp > 1`` a raw
    contraction or a slice of a tp-sharded dim, and under sequence parallelism a column-parallel contraction
    of an input without ``seq``, and with ``cp > 1`` attention computed by the model itself rather than
    ``layout.attention`` (and under Ulysses, heads that do not divide by tp x cp); a param added to an activation must name the dims it broadcasts over as the
    activation does. The error names the param's key path, its names, the call site and the fix. A loss with a
    data-dependent op (``torch.nonzero``, a boolean mask index, ``.item()``), which meta tensors cannot run, is
    checked once more on real CPU tensors (a model of up to ``REAL_CHECK_MAX_PARAMS`` params; a larger one is
    refused in one line naming the op). ``rules``: the table the layout uses (default:
    ``default_rules(sequence_parallel=...)``). Returns the key paths of the params some contraction or lookup used
    (the rest are used directly, e.g. ``x + bias``).
    """
    decl = model.params(cfg)
    rules = rules if rules is not None else default_rules(sequence_parallel=sequence_parallel and tp > 1)
    try:
        return _check_on(model, cfg, decl, seq_len, "meta", tp, rules, cp, cp_attention)
    except (NotImplementedError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "meta" not in str(e):
            raise
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        n = count(decl)
        if n > REAL_CHECK_MAX_PARAMS:
            raise ValueError(
                f"model {model.name!r}: its loss runs an op that meta tensors cannot run ({why}), and its "
                f"{n:,} params are too many to check names on real CPU tensors (limit {REAL_CHECK_MAX_PARAMS:,}); "
                f"make the op data-independent (e.g. torch.where instead of a boolean index) or check a smaller "
                f"flavor"
            ) from None
    return _check_on(model, cfg, decl, seq_len, "cpu", tp, rules, cp, cp_attention)


def _check_on(
    model: Model, cfg: Any, decl: Any, seq_len: int, device: str, tp: int, rules: Rules, cp: int, cp_attention: str
) -> set[str]:
    params = init(decl, 0, device=device)
    named_decl, _ = flatten_with_names(decl, is_leaf=is_param)
    named_params, _ = flatten_with_names(params)
    table = NameTable(
        {id(t): (name, p.names, p.shape) for (name, p), (_, t) in zip(named_decl, named_params)},
        tp=tp,
        rules=rules,
        cp=cp,
        cp_attention=cp_attention,
    )
    tokens = torch.zeros((1, seq_len), dtype=torch.long, device=device)
    with torch.no_grad(), Tracker(table):
        model.loss(params, {"inputs": tokens, "targets": tokens}, cfg, Layout(names=table))
    return set(table.seen)
