"""``check_names``: run a model once on meta tensors and compare every contraction with the declarations."""

from __future__ import annotations

from typing import Any

import torch

from .._names import NameTable
from ..sharding import Layout
from ..tree import flatten_with_names
from ._model import Model
from ._param import count, init, is_param

__all__ = ["check_names"]


# a model whose loss meta tensors cannot run is checked on real CPU tensors up to this many parameters
REAL_CHECK_MAX_PARAMS = 1 << 27


def check_names(model: Model, cfg: Any, *, seq_len: int = 8) -> set[str]:
    """Raise ValueError at the first contraction whose names differ from its parameter's declared names.

    The model's loss runs once on the meta device (nothing is allocated, no collective runs), with a Layout
    in check mode; the error names the param's key path, both name lists and the call site. A loss with a
    data-dependent op (``torch.nonzero``, a boolean mask index, ``.item()``), which meta tensors cannot run, is
    checked once more on real CPU tensors (a model of up to ``REAL_CHECK_MAX_PARAMS`` params; a larger one is
    refused in one line naming the op). Returns the key paths of the params some contraction or lookup used
    (the rest are used directly, e.g. ``x + bias``).
    """
    decl = model.params(cfg)
    try:
        return _check_on(model, cfg, decl, seq_len, "meta")
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
    return _check_on(model, cfg, decl, seq_len, "cpu")


def _check_on(model: Model, cfg: Any, decl: Any, seq_len: int, device: str) -> set[str]:
    params = init(decl, 0, device=device)
    named_decl, _ = flatten_with_names(decl, is_leaf=is_param)
    named_params, _ = flatten_with_names(params)
    table = NameTable({id(t): (name, p.names, p.shape) for (name, p), (_, t) in zip(named_decl, named_params)})
    tokens = torch.zeros((1, seq_len), dtype=torch.long, device=device)
    with torch.no_grad():
        model.loss(params, {"inputs": tokens, "targets": tokens}, cfg, Layout(names=table))
    return set(table.seen)
