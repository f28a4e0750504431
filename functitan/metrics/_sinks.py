"""Where metrics go: a console progress line, a JSONL file, TensorBoard, W&B; one tiny interface for all.

A sink is anything with ``write(step, metrics)`` and ``close()``; ``metrics`` maps a name to a number or
None (absent, e.g. MFU on an unknown GPU). The trainer holds one ``MultiSink`` from ``make_sinks``. The console
and metrics.jsonl keep the plain keys (``loss``, ``mfu``); TensorBoard and W&B file them under a group
(``train/loss``, ``perf/mfu``: ``GROUPS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

__all__ = ["Sink", "ConsoleSink", "JsonlSink", "TensorBoardSink", "WandbSink", "MultiSink", "make_sinks", "GROUPS"]

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


# The group of each metric key in TensorBoard and W&B, whose tag is "<group>/<key>" (both draw a group's panels
# together). A key with a "/" of its own (aux/<key>, eval/loss) is its own tag, and so is a key not listed here.
GROUPS: dict[str, tuple[str, ...]] = {
    "train": ("loss", "loss_avg", "grad_norm", "lr", "skipped"),
    "perf": (
        "tokens_per_s",
        "tokens_per_s_per_device",
        "tflops",
        "mfu",
        "mfu_above_peak",
        "step_time_s",
        "data_time_s",
        "checkpoint_wait_s",
    ),
    "memory": (
        "mem_max_alloc_gib",
        "mem_max_reserved_gib",
        "mem_max_reserved_pct",
        "mem_alloc_retries",
        "mem_ooms",
        "mem_max_rss_gib",
        "mem_max_rss_since_start_gib",
    ),
    "data": ("data_epoch", "data_seq", "batch_tokens", "world_size"),
    "elastic": ("replicas", "retries", "units"),  # elastic.live
}
_GROUP_OF = {key: group for group, keys in GROUPS.items() for key in keys}


def _tag(key: str) -> str:
    """``loss`` -> ``train/loss``, ``mfu`` -> ``perf/mfu``; ``eval/loss`` and an unlisted key as they are."""
    group = _GROUP_OF.get(key)
    return f"{group}/{key}" if group else key


def _config_views(config: Any) -> tuple[dict[str, Any] | None, str | None]:
    """``(a JSON-ready dict, a TOML text)`` of a run's config (a dataclass such as ``JobConfig``, or a mapping)."""
    if config is None:
        return None, None
    from ..config import to_dict, to_toml  # the metrics package imports no config at import time

    if isinstance(config, Mapping):
        as_dict = json.loads(json.dumps(dict(config), default=str))
        return as_dict, json.dumps(as_dict, indent=2)
    as_dict = json.loads(json.dumps(to_dict(config), default=str))
    try:
        return as_dict, to_toml(config, every_key_of=tuple(as_dict))
    except TypeError:  # a value set from Python that TOML cannot spell (a model override's object): as JSON
        return as_dict, json.dumps(as_dict, indent=2)


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
    ("eval/loss", "eval", lambda v: f"{v:.4f}"),
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

    Each key is a tag under its group (``train/loss``, ``perf/mfu``, ``memory/mem_max_rss_gib``: ``GROUPS``).
    None values are skipped (TensorBoard has no "absent"). Flushed every write: the log interval is
    already coarse, and a crashed run keeps its curves.

    Args:
      logdir: the event-file folder (created).
      config: the run's config (a ``JobConfig``, any dataclass config, or a mapping): written once as the text
        ``config`` (TOML, every key; TensorBoard's Text tab).
    """

    def __init__(self, logdir: str | os.PathLike, *, config: Any = None):
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is slow to import

        self.logdir = os.fspath(logdir)
        self._writer = SummaryWriter(log_dir=self.logdir)
        self._previous_hook = threading.excepthook
        threading.excepthook = self._quiet_writer_thread
        text = _config_views(config)[1]
        if text is not None:  # indented: a code block in TensorBoard's markdown, the TOML as written
            self._named(lambda: self._writer.add_text("config", "\n".join("    " + s for s in text.splitlines()), 0))

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
                    self._writer.add_scalar(_tag(key), float(value), global_step=int(step))
            self._writer.flush()

        self._named(add)

    def close(self) -> None:
        try:
            self._named(self._writer.close)
        finally:
            if threading.excepthook == self._quiet_writer_thread:
                threading.excepthook = self._previous_hook


class WandbSink:
    """Scalars to a Weights & Biases run, under TensorBoard's tags (``train/loss``, ``perf/mfu``: ``GROUPS``).

    The W&B run is named after the run directory, its config is the job's, and its id is kept in
    ``<run_dir>/wandb_id``: the same command resuming the run (its ``metrics.run_name``) continues the same W&B
    run. W&B's own files go to ``<run_dir>/wandb/`` unless ``WANDB_DIR`` says otherwise. None values are skipped.

    Args:
      run_dir: the run directory (created).
      project: the W&B project.
      entity: the W&B team or user; None: the logged-in user's default.
      mode: ``online``, ``offline`` (sync later with ``wandb sync``) or ``disabled``; None: W&B's own choice
        (``WANDB_MODE``, else ``wandb offline`` / ``wandb online`` in that directory, else online).
      config: the run's config (a ``JobConfig``, any dataclass config, or a mapping): the W&B run's config.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        project: str = "functitan",
        entity: str | None = None,
        mode: str | None = None,
        config: Any = None,
    ):
        try:
            import wandb  # imported here: an optional extra, slow to import
        except ImportError:
            raise ImportError("metrics.wandb=true needs wandb: pip install 'functitan[wandb]'") from None
        from ..errors import UserError

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb_id"
        known = id_file.read_text().strip() if id_file.exists() else None
        try:
            self._run = wandb.init(
                project=project,
                entity=entity,
                name=run_dir.name,
                id=known,
                resume="allow" if known else None,
                mode=mode,  # type: ignore[arg-type]  # checked by MetricsConfig
                config=_config_views(config)[0],
                # read at each start: W&B reads its environment once per process
                dir=os.environ.get("WANDB_DIR") or str(run_dir),
            )
        except wandb.errors.Error as e:  # no API key, a bad entity or project: the user's to fix
            raise UserError(
                f"metrics.wandb=true: W&B did not start: {' '.join(str(e).split())} (or train without it: "
                "--metrics.wandb_mode=offline keeps the run here for `wandb sync`)"
            ) from None
        if known is None:
            id_file.write_text(self._run.id + "\n")

    def write(self, step: int, metrics: Metrics) -> None:
        logged = {_tag(k): v for k, v in ((k, _scalar(k, v)) for k, v in metrics.items()) if v is not None}
        self._run.log(logged, step=int(step))

    def close(self) -> None:
        self._run.finish()


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


def make_sinks(
    run_dir: str | os.PathLike, total_steps: int, *, rank: int, metrics: Any = None, config: Any = None
) -> MultiSink:
    """The sinks of one rank: rank 0 gets console, ``<run_dir>/metrics.jsonl`` and ``<run_dir>/tb``, and W&B
    when ``metrics.wandb`` says so.

    Other ranks get an empty ``MultiSink``: the metrics they would log are already reduced onto rank 0,
    and N processes writing one terminal or file only garbles it.

    Args:
      metrics: the ``[metrics]`` section (``functitan.job_config.MetricsConfig``); its ``wandb*`` keys add a
        ``WandbSink``. None: no W&B.
      config: the run's config (a ``JobConfig``): TensorBoard's ``config`` text and the W&B run's config.
    """
    if rank != 0:
        return MultiSink(())
    run_dir = os.fspath(run_dir)
    makers: list[Callable[[], Sink]] = [
        lambda: ConsoleSink(total_steps),
        lambda: JsonlSink(os.path.join(run_dir, "metrics.jsonl")),
        lambda: TensorBoardSink(os.path.join(run_dir, "tb"), config=config),
    ]
    if metrics is not None and metrics.wandb:
        makers.append(
            lambda: WandbSink(
                run_dir,
                project=metrics.wandb_project,
                entity=metrics.wandb_entity,
                mode=metrics.wandb_mode,
                config=config,
            )
        )
    made: list[Sink] = []
    try:
        for make in makers:
            made.append(make())
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the start is the one to see
            MultiSink(made).close()  # a sink that fails to start leaves no writer thread of the others behind
        raise
    return MultiSink(made)
