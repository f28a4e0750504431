"""``check_names``: run a model once on meta tensors and compare every contraction with the declarations."""

from __future__ import annotations

from typing import Any

import torch

from .._names import NameTable
from ..sharding import Layout
from ..tree import flatten_with_names
from ._model import Model
from ._param import init, is_param

__all__ = ["check_names"]


def check_names(model: Model, cfg: Any, *, seq_len: int = 8) -> set[str]:
    """Raise ValueError at the first contraction whose names differ from its parameter's declared names.

    The model's loss runs once on the meta device (nothing is allocated, no collective runs), with a Layout
    in check mode; the error names the param's key path, both name lists and the call site. Returns the key
    paths of the params some contraction or lookup used (the rest are used directly, e.g. ``x + bias``).
    """
    decl = model.params(cfg)
    params = init(decl, 0, device="meta")
    named_decl, _ = flatten_with_names(decl, is_leaf=is_param)
    named_params, _ = flatten_with_names(params)
    table = NameTable({id(t): (name, p.names, p.shape) for (name, p), (_, t) in zip(named_decl, named_params)})
    tokens = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    with torch.no_grad():
        model.loss(params, {"inputs": tokens, "targets": tokens}, cfg, Layout(names=table))
    return set(table.seen)
