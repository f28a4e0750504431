"""Frozen dataclass configs from TOML files and ``--section.key=value`` overrides.

A job config is a frozen dataclass whose fields are section dataclasses (``training``, ``optimizer``, ...),
each holding only its component's fields. ``parse_config(JobConfig, argv)`` reads ``--config FILE.toml``,
then applies command-line overrides in order. Types come from the field annotations (int, float, bool, str,
tuple[str, ...], ``Literal[...]`` and ``X | None``). Unknown keys are errors that suggest the nearest known key.
Values are checked where they are declared: each section's ``__post_init__`` calls ``check`` (and the job's
checks the fields that depend on each other), so a bad value fails at parse time, naming its key.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import inspect
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from .errors import UserError

__all__ = [
    "parse_config",
    "config_help",
    "flat_keys",
    "apply_overrides",
    "check_value",
    "to_dict",
    "to_toml",
    "ConfigError",
    "check",
]

T = TypeVar("T")


class ConfigError(UserError):
    """A bad config key or value; the message names the key and the fix."""


def check(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise ``ConfigError("<key>=<value>: <expected>")`` unless ``ok``.

    In a section's ``__post_init__`` ``key`` is the field name; ``apply_overrides`` prefixes the section
    (``steps=0: ...`` -> ``training.steps=0: ...``).
    """
    if not ok:
        raise ConfigError(f"{key}={value!r}: {expected}")


def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


OPEN_FIELD = "overrides"  # a section field of this name takes every key the section does not declare


def _is_open(tp: Any) -> bool:
    return typing.get_origin(tp) in (dict, typing.Mapping, collections.abc.Mapping)


def _attributes(cls: type) -> dict[str, str]:
    """``{field: text}`` of the ``Attributes:`` section of a class's (Google-style) docstring, as plain text."""
    out: dict[str, str] = {}
    inside, name = False, ""
    for line in inspect.cleandoc(cls.__doc__ or "").replace("``", "").splitlines():
        if not inside:
            inside = line == "Attributes:"
            continue
        if line and not line.startswith(" "):  # the next section, or prose
            break
        head, colon, text = line.strip().partition(": ")
        if line.startswith("    ") and not line.startswith("     ") and colon and head.isidentifier():
            name, out[head] = head, text
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def flat_keys(cls: type) -> dict[str, tuple[type, Any, str]]:
    """``{"section.key": (type, default, help)}`` for every leaf field of a job config class.

    The help is the field's ``metadata["help"]``, else its entry under ``Attributes:`` in the section's
    docstring. A section's ``overrides: Mapping[str, Any]`` field is not a key itself: it collects the
    section's other keys (``--model.n_layers=2`` lands in ``model.overrides``; the model checks them against
    its config)."""
    out: dict[str, tuple[type, Any, str]] = {}
    for sec_name, sec_cls in _sections(cls).items():
        hints = typing.get_type_hints(sec_cls)
        documented = _attributes(sec_cls)
        for f in dataclasses.fields(sec_cls):
            if f.name == OPEN_FIELD and _is_open(hints[f.name]):
                continue
            default = (
                f.default
                if f.default is not dataclasses.MISSING
                else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            )  # type: ignore[misc]
            text = f.metadata.get("help") or documented.get(f.name, "")
            out[f"{sec_name}.{f.name}"] = (hints[f.name], default, text)
    return out


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(key: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _convert(key, args[0], value)
    if origin is tuple:
        (inner, *_rest) = typing.get_args(tp) or (str,)
        items = [v for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
        return tuple(_convert(key, inner, v.strip() if isinstance(v, str) else v) for v in items)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")
        return value
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} is not a valid {_type_name(tp)}") from None
    return value


def _suggest(key: str, known: Sequence[str]) -> str:
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if not near and "." in key:
        leaf = key.split(".", 1)[1]
        near = [k for k in known if k.endswith("." + leaf)][:1]
    return f"; did you mean {near[0]!r}?" if near else "; run with --help to list every key"


def _open_sections(cls: type) -> set[str]:
    return {
        sec
        for sec, tp in _sections(cls).items()
        if any(
            f.name == OPEN_FIELD and _is_open(h)
            for f, h in ((f, typing.get_type_hints(tp)[f.name]) for f in dataclasses.fields(tp))
        )
    }


def _is_open_key(key: str, keys: dict, open_sections: set[str]) -> bool:
    """A key an open section (``overrides``) collects: ``model.n_layers``."""
    sec, _, name = key.partition(".")
    return key not in keys and sec in open_sections and bool(name) and "." not in name


def _check_known(key: str, keys: dict, open_sections: set[str], source: str) -> None:
    if key not in keys and not _is_open_key(key, keys, open_sections):
        raise ConfigError(f"unknown config key {key!r} ({source}){_suggest(key, list(keys))}")


def apply_overrides(cfg: T, overrides: dict[str, Any], *, source: str = "command line") -> T:
    """A new config with ``{"section.key": value}`` applied (values as strings or TOML-typed)."""
    keys = flat_keys(type(cfg))
    open_sections = _open_sections(type(cfg))
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        sec, _, name = key.partition(".")
        if _is_open_key(key, keys, open_sections):
            extra = dict(by_section.get(sec, {}).get(OPEN_FIELD, getattr(getattr(cfg, sec), OPEN_FIELD)))
            extra[name] = value  # checked and converted by the section's owner (the model's config)
            by_section.setdefault(sec, {})[OPEN_FIELD] = extra
            continue
        _check_known(key, keys, open_sections, source)
        by_section.setdefault(sec, {})[name] = _convert(key, keys[key][0], value)
    changes = {}
    for sec, fields in by_section.items():
        try:
            changes[sec] = dataclasses.replace(getattr(cfg, sec), **fields)
        except ConfigError as e:  # from check(): "<field>=<value>: ..." -> "<section>.<field>=<value>: ..."
            raise ConfigError(f"{sec}.{e}") from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return dataclasses.replace(cast(Any, cfg), **changes)  # cfg: a dataclass instance of the parser's class


def check_value(cls: type, key: str, value: Any) -> Any:
    """What ``--<key>=<value>`` sets, alone: ``value`` converted to the key's type and checked by its section
    (``ConfigError`` naming ``<section>.<field>`` otherwise). A command's flag that means a config key checks its
    value here (functitan._command.config_flag), so the flag and ``functitan train`` agree on what is valid."""
    keys = flat_keys(cls)
    _check_known(key, keys, set(), "a command's flag")
    sec, _, name = key.partition(".")
    converted = _convert(key, keys[key][0], value)
    try:
        _sections(cls)[sec](**{name: converted})
    except ConfigError as e:  # from check(): "<field>=<value>: ..."
        raise ConfigError(f"{sec}.{e}") from None
    except ValueError as e:  # a section's own message, which names its key
        raise ConfigError(str(e)) from None
    return converted


def _bare_is_true(keys: dict[str, tuple[type, Any, str]], key: str) -> bool:
    """Whether ``--key`` alone stands for ``--key=true``: a bool key, a model field (typed by the model), or an
    unknown key (refused by name later); not a key that needs a value."""
    if key == "config":
        return False
    if key in keys:
        return keys[key][0] is bool or typing.get_args(keys[key][0]) == (bool, type(None))
    return True


def _toml_overrides(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not a text file (byte 0x{e.object[e.start]:02x} at offset {e.start} is not "
            f"UTF-8); pass a TOML file such as configs/debug.toml"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {str(path)!r} is a directory; pass a TOML file such as configs/debug.toml"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    out: dict[str, Any] = {}
    for sec, fields in data.items():
        if not isinstance(fields, dict):
            raise ConfigError(f"{path}: top-level key {sec!r} must be a [section] table")
        for k, v in fields.items():
            out[f"{sec}.{k}"] = v
    return out


def config_help(cls: type, prog: str = "functitan train", epilog: str = "") -> str:
    """The ``--help`` text: every key with its type and default, then ``epilog`` (e.g. examples)."""
    lines = [f"usage: {prog} [--config FILE.toml] [--section.key=value ...]", ""]
    current = None
    for key, (tp, default, text) in flat_keys(cls).items():
        sec = key.split(".")[0]
        if sec != current:
            lines.append(f"[{sec}]")
            current = sec
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        lines.append(f"  --{key:<34} {_type_name(tp):<18} default: {shown!r}" + (f"  {text}" if text else ""))
        if key == "model.flavor":
            lines.append(
                f"  --{'model.<field>':<34} {'':<18} any field of the model's config (e.g. --model.n_layers=2)"
            )
    if epilog:
        lines += ["", epilog.rstrip()]
    return "\n".join(lines)


def parse_config(
    cls: type[T], argv: Sequence[str] | None = None, *, prog: str = "functitan train", epilog: str = ""
) -> T:
    """Build ``cls()`` then apply ``--config FILE`` and ``--section.key=value`` / ``--section.key value``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(config_help(cls, prog, epilog))
        raise SystemExit(0)
    keys, open_sections = flat_keys(cls), _open_sections(cls)
    overrides: dict[str, Any] = {}  # the files', then the command line's, applied at once: checked once, complete
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key=value")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = body, argv[i + 1]
            i += 1
        elif _bare_is_true(keys, body):
            key, value = body, "true"  # a bare --section.flag turns it on
        else:
            example = "configs/debug.toml" if body == "config" else "VALUE"
            raise ConfigError(f"--{body} needs a value, e.g. --{body}={example}")
        if key == "config":
            from_file = _toml_overrides(Path(value))
            for k in from_file:
                _check_known(k, keys, open_sections, value)
                overrides.pop(k, None)
            overrides.update(from_file)
        else:
            overrides.pop(key, None)  # a later value wins
            overrides[key] = value
        i += 1
    return apply_overrides(cls(), overrides)


def _toml_value(key: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):  # TOML spells the non-finite ones nan, inf, -inf (Python's repr: nan, inf, -inf)
        return repr(v)
    if isinstance(v, int):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(key, x) for x in v) + "]"
    raise TypeError(f"{key}: {type(v).__name__} has no TOML form")


def to_toml(cfg: Any, *, every_key_of: Sequence[str] = ()) -> str:
    """``cfg`` as a TOML file that ``parse_config(type(cfg), ["--config", FILE])`` reads back to an equal config:
    the keys that differ from the defaults, and every key of the sections named in ``every_key_of``. A section's
    open ``overrides`` are its own keys (``[model] n_layers = 2``); None (TOML has none) is left out, which is
    only exact where None is the default, as it is for every None-able key of functitan's configs."""
    default, mine = to_dict(type(cfg)()), to_dict(cfg)
    out = []
    for section, values in mine.items():
        keys = {}
        for k, v in values.items():
            if k == OPEN_FIELD and isinstance(v, dict):
                keys.update({f: x for f, x in v.items() if x is not None})
            elif v is not None and (v != default[section].get(k) or section in every_key_of):
                keys[k] = v
        if keys:
            out += [f"[{section}]", *(f"{k} = {_toml_value(f'{section}.{k}', v)}" for k, v in keys.items()), ""]
    return "\n".join(out)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready nested dict of a config (for run records)."""
    return dataclasses.asdict(cfg)
