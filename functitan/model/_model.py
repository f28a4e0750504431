"""The model interface: everything the trainer, the CLI, pipelines, checkpoints, HF interop, metrics and the
planner need from a model, passed as one value.

A model family is a module exposing ``MODEL = Model(...)``; the trainer receives that value (``--model.name``
resolves it, see ``load_model``). Nothing in ``functitan`` imports a model: the library receives one.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch
from torch import Tensor

from ._pieces import Pieces, composed

__all__ = ["Model", "HFMap", "TensorKey", "config_to_dict", "config_from_dict", "transformers_major"]


def transformers_major(version: str | None = None) -> int:
    """The major version of transformers (installed, or ``version``); 4 when it is not installed (the 4.x
    config layout is read by 4.x and 5.x alike)."""
    if version is None:
        try:
            version = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return 4
    return int(version.split(".")[0])


@dataclass(frozen=True, kw_only=True)
class TensorKey:
    """Where one of our parameters lives in another framework's state dict (Hugging Face's, torchtitan's), and
    how its layout differs.

    ``to_theirs(ours) -> theirs`` and ``from_theirs(theirs) -> ours`` convert the whole tensor (a transpose for
    GPT-2's Conv1D, a reshape for a fused projection, a permutation of rotary rows); None means the same layout.
    """

    key: str
    to_theirs: Callable[[Tensor], Tensor] | None = None
    from_theirs: Callable[[Tensor], Tensor] | None = None
    also: tuple[str, ...] = ()  # keys an export writes it under too (a tied ``lm_head.weight``); loads read ``key``
    # theirs is these keys stacked along dim 0 (one per routed expert: ``...experts.{j}.gate_proj.weight``); ``key``
    # then only names the group in messages
    stacked: tuple[str, ...] = ()

    def keys(self) -> tuple[str, ...]:
        """The keys this tensor is stored under in their state dict (``stacked``'s, else ``key``)."""
        return self.stacked or (self.key,)

    def split(self, theirs: Tensor) -> dict[str, Tensor]:
        """``{key: tensor}`` of a whole tensor in their layout: its rows along dim 0 when ``stacked``."""
        if not self.stacked:
            return {self.key: theirs}
        return {k: part for k, part in zip(self.stacked, theirs.unbind(0))}

    def join(self, sd: Mapping[str, Tensor]) -> Tensor:
        """The whole tensor in their layout from their state dict ``sd`` (missing keys raise KeyError)."""
        if not self.stacked:
            return sd[self.key]
        return torch.stack([sd[k] for k in self.stacked])


@dataclass(frozen=True, kw_only=True)
class HFMap:
    """A model's Hugging Face counterpart: its architecture, config conversion and tensor names.

    Args:
        architecture: the transformers class name (``"LlamaForCausalLM"``), written to and checked in config.json.
        config_to_hf: ``cfg -> config.json dict`` (without ``dtype``; the exporter adds it).
        config_from_hf: ``config.json dict -> cfg``; raises ValueError naming a key the model does not implement.
        tensors: ``cfg -> {our dotted name: TensorKey}`` for every parameter of ``cfg``.
        tied: ``cfg -> {HF key: HF key it must equal}`` for tied weights HF may also save (``lm_head.weight``).
        ignored: HF keys that carry no parameter (regular expressions, e.g. old rotary buffers).
        base_prefix: the prefix of the base model's keys (``"transformer."`` for GPT-2); a state dict saved from
            the base model alone (the hub's ``gpt2`` checkpoint) has keys without it, and is read all the same.
    """

    architecture: str
    config_to_hf: Callable[[Any], dict[str, Any]]
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    tensors: Callable[[Any], dict[str, TensorKey]]
    tied: Callable[[Any], dict[str, str]] = lambda cfg: {}
    ignored: tuple[str, ...] = ()
    base_prefix: str = ""


def _from_pieces(*args: Any, **kwargs: Any) -> Tensor:
    """The default of ``Model.apply`` / ``loss``: replaced by the one composed from ``Model.pieces``."""
    raise TypeError("this Model gives neither pieces nor its own apply / loss")


@dataclass(frozen=True, kw_only=True)
class Model:
    """One model family as a value: what the trainer and every tool take instead of importing a module.

    Config objects are frozen dataclasses with at least ``vocab_size`` (the trainer sets it from the tokenizer).

    Args:
        name: the family's name (``"llama"``), recorded with each run and checkpoint.
        configs: named flavors (``{"debug": Cfg(...), "8b": Cfg(...)}``); ``config(flavor, **overrides)``.
        params: ``cfg -> tree of Param``: the one declaration of every parameter (shape, names, init).
        pieces: ``Pieces(embed=, block=, head=, first_keys=, last_keys=)`` (``functitan.model.Pieces``): the
            library composes ``apply``, ``loss`` and ``stages`` from them; each may still be given to override.
        loss: ``(params, batch, cfg, layout) -> scalar``: mean loss over this rank's ``batch``
            (``batch["inputs"]``, ``batch["targets"]``), on compute params routed through the Layout; or a
            ``TokenLoss(sum, count)``, which the trainer normalises over the step's tokens (every rank and
            microbatch: exact under a varying mask); either may come as ``(loss, aux dict)``, whose 0-d entries
            the trainer reports as ``aux/<key>`` metrics (docs/models.md, "The loss contract").
        apply: ``(params, tokens, cfg, layout) -> logits (batch, seq, vocab)``.
        flops_per_token: ``(cfg, seq_len) -> float``: training FLOPs per token (forward + backward), for MFU
            and the planner.
        stages: ``(cfg, layout, *, seq_len, dtype) -> pipeline.StageModel``; None: no pipeline parallelism.
        check_layout: ``(cfg, *, tp, seq_len, sequence_parallel) -> None``: raises ValueError naming a layout
            that works when this one cannot split the model; None: only the generic checks.
        hf: the Hugging Face mapping, or None (no HF import/export).
        torchtitan: ``cfg -> {our dotted name: TensorKey}`` in torchtitan's state-dict names, the keys of its DCP
            checkpoints (``--checkpoint.load_path=<torchtitan step-N>``, ``functitan export dcp``); or None.
    """

    name: str
    configs: Mapping[str, Any]
    params: Callable[[Any], Any]
    flops_per_token: Callable[[Any, int], float]
    pieces: Pieces | None = None
    loss: Callable[..., Tensor] = _from_pieces
    apply: Callable[..., Tensor] = _from_pieces
    stages: Callable[..., Any] | None = None
    check_layout: Callable[..., None] | None = None
    hf: HFMap | None = None
    torchtitan: Callable[[Any], dict[str, TensorKey]] | None = None
    config_type: type = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.configs:
            raise ValueError(f"model {self.name!r} declares no configs; give at least one flavor")
        types = {type(c) for c in self.configs.values()}
        if len(types) != 1 or not dataclasses.is_dataclass(next(iter(types))):
            raise TypeError(f"model {self.name!r}: configs must be instances of one dataclass, found {types}")
        object.__setattr__(self, "config_type", types.pop())
        if "vocab_size" not in {f.name for f in dataclasses.fields(self.config_type)}:
            raise TypeError(f"model {self.name!r}: {self.config_type.__name__} needs a vocab_size field")
        if self.pieces is not None:  # what the model does not give itself comes from its pieces
            apply, loss, stages = composed(self.pieces, self.params)
            for name, derived in (("apply", apply), ("loss", loss)):
                if getattr(self, name) is _from_pieces:
                    object.__setattr__(self, name, derived)
            if self.stages is None:
                object.__setattr__(self, "stages", stages)
        missing = [name for name in ("apply", "loss") if getattr(self, name) is _from_pieces]
        if missing:
            raise TypeError(
                f"model {self.name!r} gives no {' and no '.join(missing)}; give pieces=Pieces(embed=, block=, head=, "
                f"...) (docs/models.md), or {', '.join(missing)} itself"
            )
        for what, fn, args in (
            ("loss", self.loss, "params, batch, cfg, layout"),
            ("apply", self.apply, "params, tokens, cfg, layout"),
        ):
            try:
                inspect.signature(fn).bind(*args.split(", "))
            except TypeError:
                raise TypeError(
                    f"model {self.name!r}: {what} {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot be "
                    f"called as {what}({args}); the trainer and every tool call it so"
                ) from None
            except ValueError:  # a builtin or C function without a signature: called as is
                pass

    def config(self, flavor: str, **overrides: Any) -> Any:
        """The named flavor with field overrides (strings from the command line are converted by type).

        An unknown flavor or field raises ValueError with the known ones and the nearest match.
        """
        if flavor not in self.configs:
            raise ValueError(
                f"model.flavor={flavor!r} is not a {self.name} flavor; choose one of {sorted(self.configs)}"
                + _nearest(flavor, list(self.configs))
            )
        return self.replace(self.configs[flavor], **overrides)

    def replace(self, cfg: Any, **overrides: Any) -> Any:
        """``cfg`` with fields replaced; an unknown field raises ValueError naming the nearest one."""
        known = {f.name for f in dataclasses.fields(self.config_type) if f.init}
        hints = typing.get_type_hints(self.config_type)
        values = {}
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(
                    f"model.{key} is not a field of {self.name}'s config ({self.config_type.__name__})"
                    + _nearest(key, sorted(known))
                    + f"; fields: {sorted(known)}"
                )
            values[key] = _convert(f"model.{key}", hints[key], value)
        return dataclasses.replace(cfg, **values)


def _nearest(key: str, known: list[str]) -> str:
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _convert(key: str, tp: Any, value: Any) -> Any:
    if not isinstance(value, str) or tp is str:
        return value
    from ..config import _convert as convert_scalar

    return convert_scalar(key, tp, value)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a (nested) frozen config dataclass."""
    return dataclasses.asdict(cfg)


def config_from_dict(cls: type, d: Mapping[str, Any]) -> Any:
    """The inverse of ``config_to_dict``: nested dataclass fields (``X | None`` too) are rebuilt by type."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {unknown}; known: {sorted(known)}")
    values = {}
    for k, v in d.items():
        tp = hints[k]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or (
            [tp] if dataclasses.is_dataclass(tp) else []
        )
        if isinstance(v, Mapping) and inner:
            v = config_from_dict(typing.cast(type, inner[0]), v)
        elif isinstance(v, list):
            v = tuple(v)
        values[k] = v
    return cls(**values)
