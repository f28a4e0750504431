"""Where metrics go: a console progress line, a JSONL file, TensorBoard; one tiny interface for all.

A sink is anything with ``write(step, metrics)`` and ``close()``; ``metrics`` maps a name to a number or
None (absent, e.g. MFU on an unknown GPU). The trainer holds one ``MultiSink`` from ``make_sinks``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TextIO

__all__ = ["Sink", "ConsoleSink", "JsonlSink", "TensorBoardSink", "MultiSink", "make_sinks"]

Metrics = Mapping[str, "float | int | None"]


class Sink(Protocol):
    def write(self, step: int, metrics: Metrics) -> None: ...

    def close(self) -> None: ...


def _scalar(key: str, value) -> float | int | None:
    """A plain Python number (or None) from a number, a bool or a one-element tensor."""
    if value is None or isinstance(value, (int, float)):
        return value
    item = getattr(value, "item", None)  # torch.Tensor / numpy scalar, without importing either
    if item is not None:
        try:
            return item()
        except (ValueError, RuntimeError):
            pass
    raise TypeError(
        f"metric {key!r}: expected an int, a float, None or a one-element tensor, got {type(value).__name__} "
        f"{value!r}; log a scalar (e.g. loss.item()) or leave the metric out"
    )


# --- console -------------------------------------------------------------------------------------------


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f}{suffix}"
    return f"{x:.1f}"


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# (metric key, label, format); a field shows when its key is in the metrics; None prints "n/a".
_FIELDS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("loss", "loss", lambda v: f"{v:.4f}"),
    ("loss_avg", "avg", lambda v: f"{v:.4f}"),
    ("grad_norm", "gnorm", lambda v: f"{v:.3f}"),
    ("lr", "lr", lambda v: f"{v:.2e}"),
    ("tokens_per_s", "tok/s", _si),
    ("tflops", "TFLOP/s", lambda v: f"{v:.1f}"),
    ("mfu", "MFU", lambda v: f"{v:.1f}%"),
    ("mfu_above_peak", "achieved/peak", lambda v: f"{v:.2f} (peak underestimated)"),
    ("mem_max_reserved_gib", "mem", lambda v: f"{v:.2f}GiB"),
    ("mem_max_rss_gib", "rss", lambda v: f"{v:.2f}GiB"),
    ("mem_max_rss_since_start_gib", "rss", lambda v: f"{v:.2f}GiB"),
)


class ConsoleSink:
    """A live progress bar with ETA on a terminal; one plain line per write elsewhere (CI logs, files).

    On a TTY the line is redrawn in place with a carriage return and cut to the terminal width; otherwise
    each write prints a full line, so logs stay greppable. Shows loss, loss_avg (the mean since the last line),
    grad norm, lr, tokens/s, TFLOP/s, MFU ("n/a" when None) and peak memory when they are among the metrics.

    Args:
      total_steps: the step the run ends at (for the bar and the ETA).
      stream: where to print; default ``sys.stdout`` at each write (so redirection after creation works).
      clock: seconds, monotonic; for tests.
    """

    def __init__(self, total_steps: int, *, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        if total_steps < 1:
            raise ValueError(f"ConsoleSink: total_steps must be >= 1, got {total_steps}")
        self.total_steps = total_steps
        self._stream = stream
        self._clock = clock
        self._start: tuple[int, float] | None = None  # (step, time) of the first write, for the ETA
        self._live = False  # a TTY line is on screen without its newline

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _eta(self, step: int) -> str:
        now = self._clock()
        if self._start is None:
            self._start = (step, now)
        step0, t0 = self._start
        if step <= step0:
            return "eta ?"
        return "eta " + _hms((now - t0) / (step - step0) * max(self.total_steps - step, 0))

    def format(self, step: int, metrics: Metrics) -> str:
        """The text of one line, without bar or carriage return."""
        parts = [f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"]
        for key, label, fmt in _FIELDS:
            if key in metrics:
                value = _scalar(key, metrics[key])
                parts.append(f"{label} {'n/a' if value is None else fmt(value)}")
        parts.append(self._eta(step))
        return " | ".join(parts)

    def write(self, step: int, metrics: Metrics) -> None:
        line = self.format(step, metrics)
        out = self._out()
        if out.isatty():
            frac = min(max(step / self.total_steps, 0.0), 1.0)
            bar = "#" * int(20 * frac)
            line = f"[{bar:<20}] {100 * frac:3.0f}% {line}"
            width = shutil.get_terminal_size((120, 24)).columns - 1
            out.write("\r" + line[:width].ljust(width))
            self._live = True
        else:
            out.write(line + "\n")
        out.flush()

    def close(self) -> None:
        if self._live:
            self._out().write("\n")
            self._out().flush()
            self._live = False


# --- files ---------------------------------------------------------------------------------------------


class JsonlSink:
    """One JSON object per write, ``{"step": ..., "time": <unix s>, **metrics}``, flushed at once.

    Appends, so a resumed run continues the same file. Non-finite floats are written as ``NaN`` /
    ``Infinity`` (Python's json, pandas and jq >= 1.7 read them): a diverged loss must stay visible.

    Args:
      path: the ``.jsonl`` file; its folder is created.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Metrics) -> None:
        record: dict[str, float | int | None] = {"step": int(step), "time": time.time()}
        record.update({k: _scalar(k, v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars to TensorBoard event files via ``torch.utils.tensorboard.SummaryWriter``.

    None values are skipped (TensorBoard has no "absent"). Flushed every write: the log interval is
    already coarse, and a crashed run keeps its curves.

    Args:
      logdir: the event-file folder (created).
    """

    def __init__(self, logdir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is slow to import

        self.logdir = os.fspath(logdir)
        self._writer = SummaryWriter(log_dir=self.logdir)
        self._previous_hook = threading.excepthook
        threading.excepthook = self._quiet_writer_thread

    def _quiet_writer_thread(self, args: threading.ExceptHookArgs) -> None:
        """The event writer's thread dies of an OSError (a full disk) with a traceback of its own; the error comes
        back from the next ``write``/``close``, as one line naming the folder. Other threads: the usual hook."""
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            self._previous_hook(args)

    def _named(self, call: Callable[[], object]) -> None:
        try:
            call()
        except OSError as e:  # the writer's own error names no file
            raise OSError(e.errno, f"writing TensorBoard events: {e.strerror or e}", self.logdir) from None

    def write(self, step: int, metrics: Metrics) -> None:
        def add() -> None:
            for key, value in metrics.items():
                value = _scalar(key, value)
                if value is not None:
                    self._writer.add_scalar(key, float(value), global_step=int(step))
            self._writer.flush()

        self._named(add)

    def close(self) -> None:
        try:
            self._named(self._writer.close)
        finally:
            if threading.excepthook == self._quiet_writer_thread:
                threading.excepthook = self._previous_hook


# --- composition ---------------------------------------------------------------------------------------


class MultiSink:
    """Writes to every sink in order; ``close`` closes them all even if one fails (then re-raises)."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks = tuple(sinks)

    def write(self, step: int, metrics: Metrics) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - close the rest, report the first failure
                error = error or e
        if error is not None:
            raise error

    def __enter__(self) -> MultiSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_sinks(run_dir: str | os.PathLike, total_steps: int, *, rank: int) -> MultiSink:
    """The sinks of one rank: rank 0 gets console, ``<run_dir>/metrics.jsonl`` and ``<run_dir>/tb``.

    Other ranks get an empty ``MultiSink``: the metrics they would log are already reduced onto rank 0,
    and N processes writing one terminal or file only garbles it.
    """
    if rank != 0:
        return MultiSink(())
    run_dir = os.fspath(run_dir)
    return MultiSink(
        (
            ConsoleSink(total_steps),
            JsonlSink(os.path.join(run_dir, "metrics.jsonl")),
            TensorBoardSink(os.path.join(run_dir, "tb")),
        )
    )
