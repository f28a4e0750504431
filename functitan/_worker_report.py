"""What a worker of ``functitan train --nproc N`` leaves for the launcher that started it, in the folder
``$FUNCTITAN_ERROR_DIR`` the launcher made (nothing without it: one process, or a plain torchrun):

* ``checkpoints``: where this run's checkpoints go (rank 0), so the launcher's last line can name the newest
  step when the job dies before it finishes;
* ``stopped-rank{RANK}``: this worker saved and stopped after a signal, at the step written in it.

(``rank{RANK}.txt``, a rank's user error, is written by functitan.errors.) The trainer writes these files and
the launcher (functitan.elastic) reads them; neither imports the other.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ERROR_DIR", "CHECKPOINTS", "STOPPED", "report_run", "report_stopped"]

ERROR_DIR = "FUNCTITAN_ERROR_DIR"  # the environment variable naming the launcher's folder
CHECKPOINTS = "checkpoints"
STOPPED = "stopped-rank"  # + RANK


def report_run(checkpoints: str | os.PathLike | None) -> None:
    """On rank 0 of a launched job: where this run's checkpoints go (None: none are saved)."""
    error_dir = os.environ.get(ERROR_DIR)
    if error_dir and os.environ.get("RANK", "0") == "0":
        (Path(error_dir) / CHECKPOINTS).write_text("" if checkpoints is None else str(Path(checkpoints).resolve()))


def report_stopped(step: int) -> None:
    """On a rank: this worker stopped cleanly after a signal, at ``step``."""
    error_dir = os.environ.get(ERROR_DIR)
    if error_dir:
        (Path(error_dir) / f"{STOPPED}{os.environ.get('RANK', '0')}").write_text(f"{step}\n")
