"""How every ``functitan <cmd>`` builds its parser, so all nine read and fail the same way.

The commands were built three ways (argparse with and without ``parse_known_args``, a hand-written loop) and
failed in five styles: argparse's two-line ``usage: ... error: ...`` next to ``functitan: error: ...``, and a
flag prefix such as ``--gpus`` silently taken as ``--gpus-per-node``. Here, once:

* ``CommandParser``: ``prog`` is ``functitan <cmd>`` (what the user types); ``allow_abbrev=False`` (a prefix is
  refused: it would change meaning the day a second flag shares it); an argparse error (unknown or missing
  argument, bad value) is a ``UserError``, so ``run`` prints it as the one ``functitan: error: ...`` line with
  exit code 2 like every other user error, and ``--debug`` shows its traceback; the examples go in the
  epilog, printed as written.
* ``run``: ``--debug`` taken off the arguments and the body run under ``functitan.errors.user_errors_exit``.
* ``config_flag``: a flag that means a config key is named after that key: ``--seq-len`` (the dash alias made
  from ``training.seq_len``) and ``--training.seq_len`` (the key itself, as ``functitan train`` takes it) are
  one option with one meaning; its help, type and check are the key's own (``functitan.job_config``).
* ``model_flags``: the help of ``--model.name``, ``--model.flavor`` and ``--model.<field>``; they are parsed by
  ``functitan.job_config.parse_model_args``, the parser ``functitan train`` uses.

    parser = CommandParser("plan", description="...", examples="example:\\n  functitan plan --nodes 8")
    config_flag(parser, "training.seq_len", default=None)
    return run(argv, lambda args: _body(parser.parse_args(args)))
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .errors import UserError, pop_debug, user_errors_exit

__all__ = ["CommandParser", "run", "config_flag", "dash_alias", "model_flags"]


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` for ``functitan <command>``: no abbreviations, examples verbatim, errors as
    ``UserError``. ``command`` is the name after ``functitan`` (``"data prepare"``); a subparser made with
    ``add_subparsers().add_parser`` is one too (argparse passes its ``prog``)."""

    def __init__(self, command: str | None = None, *, examples: str = "", **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        if command is not None:
            kwargs.setdefault("prog", f"functitan {command}")
        if examples:
            kwargs.setdefault("epilog", examples)
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


def run(argv: Sequence[str] | None, body: Callable[[list[str]], int]) -> int:
    """``body(argv without --debug)`` as a command's exit status: a user error is one line and exit code 2
    (``--debug``: its traceback). ``argv`` None: ``sys.argv[1:]``."""
    debug, args = pop_debug(sys.argv[1:] if argv is None else argv)
    return user_errors_exit(lambda: body(args), debug=debug)


def dash_alias(key: str) -> str:
    """The dash flag of a config key: ``training.seq_len`` -> ``--seq-len``."""
    return "--" + key.rpartition(".")[2].replace("_", "-")


class _ConfigValue(argparse.Action):
    """Converts and checks a flag's value as its config key (``config.check_value``); an error names the flag as
    typed and the key it sets."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, key: str, **kwargs: Any) -> None:
        self.key = key
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        from .config import ConfigError, check_value
        from .job_config import JobConfig

        try:
            value = check_value(JobConfig, self.key, values)
        except ConfigError as e:
            flag = option_string or self.option_strings[0]
            message = str(e).removeprefix(f"{self.key}=")  # "<value>: what is expected"
            named = "" if flag == f"--{self.key}" else f" ({flag} is {self.key})"
            raise UserError(f"{flag}={message}{named}") from None
        setattr(namespace, self.dest, value)


_DEFAULT: Any = object()


def config_flag(
    parser: Any,
    key: str,
    *,
    default: Any = _DEFAULT,
    note: str = "",
    also: Sequence[str] = (),
    dest: str = "",
    metavar: str = "",
) -> None:
    """Add the option that sets the config key ``key``: ``dash_alias(key)``, ``--<key>`` and the older
    spellings ``also`` (``--batch`` for ``training.batch_size``). Help, type and check are the key's own;
    ``default`` (the key's unless given) and ``note`` are what this command adds. ``parser``: a parser or one of
    its argument groups; ``dest``: the namespace attribute (default: the key's last part); ``metavar``: the
    value's name in the help (default: NAME for a choice, else its type: INT, TEXT)."""
    from .config import flat_keys
    from .job_config import JobConfig

    tp, key_default, text = flat_keys(JobConfig)[key]
    default = key_default if default is _DEFAULT else default
    flags = list(dict.fromkeys([dash_alias(key), f"--{key}", *also]))
    choices = typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()
    words = [text.rstrip("."), note, f"one of {', '.join(map(str, choices))}" if choices else ""]
    shown = f"default {default}; " if default is not None else ""
    parser.add_argument(
        *flags,
        action=_ConfigValue,
        key=key,
        dest=dest or key.rpartition(".")[2],
        default=default,
        metavar=metavar or ("NAME" if choices else _metavar(tp)),
        help=f"{'; '.join(w for w in words if w)} ({shown}the config key {key})".lstrip(),
    )


def _metavar(tp: Any) -> str:
    """``INT`` for ``int`` and ``int | None``, ``TEXT`` for ``str``."""
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    name = getattr(inner[0] if inner else tp, "__name__", "value")
    return "TEXT" if name == "str" else name.upper()


def model_flags(parser: argparse.ArgumentParser) -> None:
    """The help of the model's flags, in a group of their own. They never reach ``parser``: the command takes
    them off first with ``functitan.job_config.parse_model_args``."""
    from .config import flat_keys
    from .job_config import JobConfig

    keys = flat_keys(JobConfig)
    group = parser.add_argument_group(
        "model", "--model.<field>=value sets any field of the model's config (e.g. --model.n_layers=2)"
    )
    for key in ("model.name", "model.flavor"):
        group.add_argument(f"--{key}", metavar=key.split(".")[1].upper(), help=keys[key][2])
