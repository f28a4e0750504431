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

import os
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["UserError", "USER_ERRORS", "EXIT_USER_ERROR", "report_error", "user_errors_exit", "pop_debug"]

EXIT_USER_ERROR = 2
USER_ERRORS = (ValueError, OSError)


class UserError(ValueError):
    """An error the user fixes; its message names the key, file or value and the fix (base of ConfigError,
    CheckpointError and NonFiniteLossError)."""


def report_error(message: str) -> None:
    """Print ``functitan: error: <message>`` (one line) and leave it for the launcher in ``$FUNCTITAN_ERROR_DIR``."""
    line = " ".join(str(message).split("\n"))
    print(f"functitan: error: {line}", file=sys.stderr, flush=True)
    error_dir = os.environ.get("FUNCTITAN_ERROR_DIR")
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
    """Run a command's ``body``; a user error becomes one line on stderr and exit code 2 (see the module doc)."""
    try:
        return body()
    except USER_ERRORS as exc:
        if debug:
            raise
        report_error(_message(exc))
        return EXIT_USER_ERROR
