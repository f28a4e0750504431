"""``--model.name`` -> a ``Model`` value, without a registry: installed plugins are package entry points.

A name resolves, in order, as:
- a file, ``path/to/my_model.py`` or ``path/to/my_model.py:ATTR`` (a model outside any package);
- a module, ``pkg.my_model`` or ``pkg.my_model:ATTR``;
- a plugin name (``llama``, ``gpt2``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``): an entry point of the group
  ``functitan.models`` that any installed package may declare (functitan's own models declare theirs in
  pyproject.toml).
``ATTR`` defaults to ``MODEL``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib import metadata
from pathlib import Path

from ._model import Model

__all__ = ["load_model", "model_for_architecture", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "functitan.models"


def _plugins() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_model(name: str | Model) -> Model:
    """The Model that ``name`` names (see the module docstring); a Model is returned as is."""
    if isinstance(name, Model):
        return name
    where, _, attr = name.partition(":")
    attr = attr or "MODEL"
    if where.endswith(".py") or "/" in where:
        module = _load_file(Path(where))
    elif "." in where:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise ValueError(f"model.name={name!r}: module {where!r} not found ({e}); check the module path") from None
    else:
        plugins = _plugins()
        if where not in plugins:
            raise ValueError(
                f"model.name={name!r} is not an installed model; choose one of {sorted(plugins)}, or "
                f"give a module ('pkg.mod:MODEL') or a file ('path/to/model.py:MODEL')"
            )
        value = plugins[where].load()
        return _check(value, name)
    if not hasattr(module, attr):
        raise ValueError(
            f"model.name={name!r}: {where} has no attribute {attr!r}; define "
            f"`{attr} = functitan.model.Model(...)` there or name the attribute after ':'"
        )
    return _check(getattr(module, attr), name)


def _load_file(path: Path):
    if not path.is_file():
        raise ValueError(f"model.name: file {str(path)!r} does not exist")
    resolved = path.resolve()
    mod_name = f"functitan_user_model_{abs(hash(str(resolved))):x}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"model.name: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:  # the user's file: one line naming it, not a traceback into importlib
        del sys.modules[mod_name]
        raise ValueError(
            f"model.name={str(path)!r}: a syntax error at line {e.lineno}: {e.msg}; fix the model file"
        ) from None
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module


def _check(value: object, name: str) -> Model:
    if not isinstance(value, Model):
        raise ValueError(  # the user's file or plugin: a user error, one line
            f"model.name={name!r} resolves to a {type(value).__name__}, not a functitan.model.Model; assign "
            "`MODEL = functitan.model.Model(...)` there (docs/models.md)"
        )
    return value


def model_for_architecture(architecture: str) -> tuple[str, Model]:
    """``(plugin name, Model)`` of the installed model whose Hugging Face architecture is ``architecture``."""
    known = {}
    for name, ep in sorted(_plugins().items()):
        model = _check(ep.load(), name)
        if model.hf is not None:
            known[model.hf.architecture] = name
            if model.hf.architecture == architecture:
                return name, model
    raise ValueError(
        f"no installed model reads Hugging Face architecture {architecture!r}; known: {sorted(known)}. "
        f"Name a model with an HFMap for it (--model NAME)"
    )
