"""Errors a user fixes, and how a command shows them: one line, exit code 2, no traceback.

``UserError`` is the base of the errors whose message is the whole story (a config value, a path, a checkpoint,
a run that diverged): ``ConfigError``, ``CheckpointError``, ``NonFiniteLossError``. It is a ValueError, like
every validation error in functitan (``raise ValueError("<key>: found ..., expected ...; fix")``), so callers
that catch ValueError keep working. A command's ``main`` runs its body under ``user_errors_exit``:

* a ``ValueError`` (``UserError`` included) or an ``OSError`` (a path that is missing or unwritable) prints
  ``functitan: error: <message>`` on stderr and exits 2; ``--debug`` shows the traceback instead;
* anything else is a bug and keeps its traceback.

On a rank of a multi-process job the line also goes to ``$FUNCTITAN_ERROR_DIR/rank{RANK}.txt`` when the
launcher set that variable; the launcher shows the first failing rank's line once (functitan.elastic).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from ._worker_report import ERROR_DIR

__all__ = [
    "UserError",
    "USER_ERRORS",
    "EXIT_USER_ERROR",
    "report_error",
    "user_errors_exit",
    "pop_debug",
    "unknown_command",
    "UserNotice",
]

EXIT_USER_ERROR = 2
USER_ERRORS = (ValueError, OSError)


class UserError(ValueError):
    """An error the user fixes; its message names the key, file or value and the fix. Every such error class
    derives from it (ConfigError, CheckpointError, PlanError, ...; tests/test_cli.py checks each module)."""


class PeersGone(UserError):
    """A step cannot go on because the job's peers are gone for good (``elastic.live``: no quorum). The trainer
    saves the steps committed so far, then reports it with the checkpoint's path added (one line, exit 2)."""


class UserNotice(RuntimeWarning):
    """A warning whose message is the whole story (a damaged checkpoint fallen back from): a command shows it as
    one ``functitan: warning:`` line, without Python's file:line and source line."""


def report_error(message: str) -> None:
    """Print ``functitan: error: <message>`` (one line) and leave it for the launcher in ``$FUNCTITAN_ERROR_DIR``."""
    line = " ".join(str(message).split("\n"))
    print(f"functitan: error: {line}", file=sys.stderr, flush=True)
    error_dir = os.environ.get(ERROR_DIR)
    if error_dir:
        rank = os.environ.get("RANK", "0")
        tmp = Path(error_dir) / f".rank{rank}.{uuid.uuid4().hex[:6]}"
        tmp.write_text(line + "\n")
        tmp.replace(Path(error_dir) / f"rank{rank}.txt")  # atomic: the launcher never reads half a line


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc) or type(exc).__name__


def pop_debug(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """``(whether --debug was given, argv without it)``."""
    args = list(argv)
    return "--debug" in args, [a for a in args if a != "--debug"]


def user_errors_exit(body: Callable[[], int], *, debug: bool = False) -> int:
    """Run a command's ``body``; a user error becomes one line on stderr and exit code 2 (see the module doc).

    A ``UserNotice`` warning prints as one ``functitan: warning:`` line, not Python's two lines with the source
    line that warned; ``--debug`` keeps Python's format."""
    try:
        with contextlib.nullcontext() if debug else _one_line_warnings():
            return body()
    except USER_ERRORS as exc:
        if debug:
            raise
        report_error(_message(exc))
        return EXIT_USER_ERROR


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
        if not issubclass(category, UserNotice):  # torch's, a library's: Python's format
            return previous(message, category, filename, lineno, file, line)
        print(f"functitan: warning: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def unknown_command(prog: str, name: str, known: Iterable[str]) -> int:
    """A command (or subcommand) name that is none of ``known``: one line with the nearest name, exit code 2.

    ``prog``: the command so far, ``"functitan"`` or ``"functitan data"``."""
    known = list(known)
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}?" if near else f"the commands: {', '.join(known)}"
    of = "" if prog == "functitan" else f" of {prog}"  # one prefix for every error, whichever command
    print(f"functitan: error: unknown command {name!r}{of}; {hint} ({prog} --help)", file=sys.stderr)
    return EXIT_USER_ERROR
