"""Traces and memory snapshots of chosen steps: one context manager around the training loop.

``Profiler(cfg.profile, run_dir, rank=..., device=..., start=...)`` traces the steps ``profile.steps`` with
torch.profiler (a Chrome trace per step and rank, with the step before each as its warmup) and, on CUDA, records
the caching allocator's history for the memory snapshots of ``profile.memory_snapshot_steps`` and of a step that
runs out of memory. Everything goes to ``<run_dir>/profile/``; with nothing asked for it does nothing, and
torch.profiler is imported only when a step is traced.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import UserNotice

__all__ = ["Profiler"]

_HISTORY_ENTRIES = 100_000  # allocation events a CUDA memory snapshot keeps (the newest)


class Profiler:
    """Profiles the steps a ``[profile]`` section names, into ``<run_dir>/profile/``.

    Call ``step(n)`` once step ``n`` is done (its logging and checkpointing included: the trace of a step is one
    turn of the loop)::

        with Profiler(cfg.profile, run_dir, rank=rank, device=device, start=state.step) as profiler:
            while state.step < steps:
                state = ...  # one step
                profiler.step(state.step)

    Writes ``step-<N>-rank<R>.json`` for each step of ``cfg.steps`` (a Chrome trace: ui.perfetto.dev or
    chrome://tracing); on CUDA ``memory-step-<N>-rank<R>.pickle`` after each step of ``cfg.memory_snapshot_steps``
    and, with ``cfg.memory_snapshot_on_oom``, ``memory-oom-step-<N>-rank<R>.pickle`` when step N raises
    ``torch.OutOfMemoryError`` (the error goes on, with the file's name added as a note). A snapshot opens in
    https://pytorch.org/memory_viz. Memory snapshots are CUDA's (``torch.cuda.memory``): on another device rank 0
    says so once and none is written.

    Args:
      cfg: the ``[profile]`` section (``functitan.job_config.ProfileConfig``): ``steps``, ``with_stack``,
        ``memory_snapshot_steps``, ``memory_snapshot_on_oom``.
      run_dir: the run directory; the files go to its ``profile/`` folder (created on the first file).
      rank: this process's rank, in each file's name (every rank writes its own).
      device: the training device: CUDA adds the kernels to the traces.
      start: the step the loop continues from (0, or the step a checkpoint resumed at).
    """

    def __init__(self, cfg: Any, run_dir: str | os.PathLike, *, rank: int, device: torch.device, start: int = 0):
        self.folder = Path(run_dir) / "profile"
        self._steps = frozenset(cfg.steps)
        self._with_stack = bool(cfg.with_stack)
        self._snapshots = frozenset(cfg.memory_snapshot_steps)
        self._on_oom = bool(cfg.memory_snapshot_on_oom)
        self._rank, self._device = rank, torch.device(device)
        self._next = start + 1  # the step the loop runs next
        self._done = start  # the step a trace handed to _save is of
        self._prof: Any = None
        self._history = False  # recording the CUDA allocator's history

    # --- the loop's side ---

    def __enter__(self) -> Profiler:
        wants_memory = bool(self._snapshots) or self._on_oom
        if wants_memory and self._device.type != "cuda":
            if self._rank == 0:
                warnings.warn(
                    UserNotice(
                        f"profile.memory_snapshot_steps / memory_snapshot_on_oom: memory snapshots are CUDA's "
                        f"(torch.cuda.memory); none is written on {self._device.type}"
                    ),
                    stacklevel=2,
                )
        elif wants_memory:
            torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES)
            self._history = True
        if any(s >= self._next for s in self._steps):
            self._start_tracing()
        return self

    def step(self, done: int) -> None:
        """Step ``done`` is over: save what it was traced or snapshotted for, and get ready for the next."""
        self._next, self._done = done + 1, done
        if self._history and done in self._snapshots:
            self._dump(self.folder / f"memory-step-{done}-rank{self._rank}.pickle")
        if self._prof is not None:
            self._prof.step()  # saves step `done`'s trace (on_trace_ready) if it was one; the schedule asks _next
            if not any(s >= self._next for s in self._steps):
                self._prof.stop()  # nothing left to trace: no profiler hooks on the remaining steps
                self._prof = None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if self._prof is not None:
                self._done = self._next  # a trace cut short by an error is of the step in progress
                self._prof.stop()
                self._prof = None
            if self._history and self._on_oom and isinstance(exc, torch.OutOfMemoryError):
                path = self.folder / f"memory-oom-step-{self._next}-rank{self._rank}.pickle"
                self._dump(path)
                exc.add_note(
                    f"functitan: the CUDA memory snapshot of step {self._next}: {path} (pytorch.org/memory_viz)"
                )
        finally:
            if self._history:
                torch.cuda.memory._record_memory_history(enabled=None)
                self._history = False

    # --- torch's side ---

    def _start_tracing(self) -> None:
        from torch import profiler as tp  # imported here: only a traced run pays for it

        def action(_: int) -> Any:  # the profiler's own step count is ignored: steps are the trainer's
            if self._next in self._steps:
                return tp.ProfilerAction.RECORD_AND_SAVE
            return tp.ProfilerAction.WARMUP if self._next + 1 in self._steps else tp.ProfilerAction.NONE

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self._device.type == "cuda" else [])
        self._prof = tp.profile(
            activities=activities,
            schedule=action,
            on_trace_ready=self._save,
            record_shapes=True,
            with_stack=self._with_stack,
        )
        self._prof.step_num = self._next  # its "ProfilerStep#N" marks are the trainer's step numbers
        self._prof.start()

    def _save(self, prof: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.folder / f"step-{self._done}-rank{self._rank}.json"))

    def _dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
