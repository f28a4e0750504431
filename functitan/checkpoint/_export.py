"""Exports: a functitan checkpoint's weights, whole on this process, written in another framework's format
(``functitan export hf`` / ``export dcp``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from functitan.model import Model, init, is_param
from functitan.tree import flatten_with_names

from ._dcp import DcpFormat, torchtitan_keys
from ._hf import _read_json, recorded_model, save_hf
from ._manager import ITEM, restore_params
from ._save import Checkpointer

__all__ = ["export_hf", "export_dcp", "saved_params"]


def export_hf(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    model: Model | None = None,
    cfg: Any = None,
    tokenizer: Any = None,
    **kwargs: Any,
) -> Any:
    """Convert a functitan checkpoint (a trainer's step directory, or ``import_hf``'s output) into an HF
    directory. ``model`` and ``cfg`` default to the record beside the checkpoint; ``kwargs`` as ``save_hf``'s.

    With ``tokenizer`` (``functitan.data.run_tokenizer`` gives the run's) the directory is complete: its
    ``tokenizer.json`` and ``tokenizer_config.json``, and the BOS / EOS / pad ids in ``config.json`` and
    ``generation_config.json``, so ``AutoTokenizer`` and ``generate`` stop on the token the run ended documents
    with (without them transformers falls back to ids 1 and 2)."""
    from functitan.data import save_hf_tokenizer

    model, cfg, params = saved_params(ckpt_dir, model, cfg)
    ids = {}
    if tokenizer is not None:
        ids = {"bos_token_id": int(tokenizer.bos_id), "eos_token_id": int(tokenizer.eos_id)}
        ids["pad_token_id"] = ids["eos_token_id"]  # no pad token of its own: generate pads with EOS
    save_hf(params, model, cfg, out_dir, extra_config={**ids, **kwargs.pop("extra_config", {})}, **kwargs)
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, out_dir, model_max_length=getattr(cfg, "max_seq_len", None))
        generation = {**ids, "_from_model_config": False}
        (Path(out_dir) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return cfg


def saved_params(ckpt_dir: str | os.PathLike, model: Model | None = None, cfg: Any = None) -> tuple[Model, Any, Any]:
    """``(model, cfg, params)`` of a functitan checkpoint, whole on this process in the dtype it was saved in
    (what an export converts); ``model`` and ``cfg`` default to the record beside the checkpoint."""
    if model is None or cfg is None:
        model, cfg = recorded_model(ckpt_dir)
    item = Path(ckpt_dir) / ITEM if (Path(ckpt_dir) / ITEM).is_dir() else Path(ckpt_dir)
    decl = model.params(cfg)
    # restore in the dtype the checkpoint holds (the exemplar's dtype must match: no silent casts)
    first = flatten_with_names(decl, is_leaf=is_param)[0][0][0]
    array = item / f"params.{first}" / "zarr.json"
    dtype = (
        getattr(torch, _read_json(array).get("data_type", "float32"), torch.float32)
        if array.is_file()
        else torch.float32
    )
    return model, cfg, restore_params(item, init(decl, 0, device="meta", dtype=dtype))


def export_dcp(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    model: Model | None = None,
    cfg: Any = None,
    dtype: torch.dtype | None = None,
) -> Any:
    """Write a functitan checkpoint's weights as a DCP checkpoint in torchtitan's names (a model-only
    ``step-<N>`` as torchtitan saves one: ``torch.distributed.checkpoint.load`` into its model's state dict
    reads it). ``model`` and ``cfg`` default to the record beside the checkpoint."""
    model, cfg, params = saved_params(ckpt_dir, model, cfg)
    keys = torchtitan_keys(model, cfg)
    flat: dict[str, torch.Tensor] = {}
    for name, x in flatten_with_names(params)[0]:
        k = keys[name]
        value = k.to_theirs(x) if k.to_theirs is not None else x
        value = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        for key in (k.key, *k.also):
            flat[key] = value.contiguous()
    with Checkpointer(format=DcpFormat()) as ck:
        ck.save_sync(out_dir, _nest(flat))  # its leaves' dotted names are the flat keys again
    return cfg


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}``: a checkpoint's leaf names join keys with ".", so a flat state dict's
    dotted keys are written as the nested tree they name."""
    tree: dict[str, Any] = {}
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    return tree
