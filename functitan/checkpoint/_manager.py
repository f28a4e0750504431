"""A directory of step checkpoints: save every ``interval`` steps, keep some, restore the newest good one.

Layout (Orbax's CheckpointManager layout, single item named ``default``)::

    <root>/100/default/{_METADATA,_COMMIT,<arrays>}
    <root>/200/default/...
    <root>/300.tmp-3f2a.../      a save in flight, or one cut short by a crash: never read
    <root>/100.tmp-deleting-.../ a retention delete in flight, or one cut short by a crash

Leftovers of both kinds are removed when a manager starts on ``root`` (the start of a run, when no save
of this run is in flight). A step directory appears by one atomic rename, after all of its files are
written, so a listed step is a complete one; ``restore_latest`` still checks the files' sizes (and each
chunk's crc32c while reading) and falls back to the previous step, with a warning, when the newest is
damaged. The damaged step is then re-saved when the run reaches it again (replacing it at the commit),
and never counts toward ``keep_last``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import UserNotice
from ..tree import combine, partition
from . import _layout as L
from ._restore import CheckpointError, _read_json, restore
from ._save import Checkpointer, SaveHandle, _Group, _move_aside

__all__ = ["CheckpointManager"]

ITEM = "default"
_LEFTOVER = re.compile(r"^\d+" + re.escape(L.TMP_MARK))  # <step>.tmp-<uuid>, <step>.tmp-deleting-<uuid>


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class CheckpointManager:
    """Periodic, asynchronous, atomic checkpoints of a train state under ``root``.

    Args:
        root: the run's checkpoint directory (created if missing).
        interval: save when ``step % interval == 0``.
        keep_last: keep the newest ``keep_last`` complete checkpoints ...
        keep_every: ... and, for good, every step that is a multiple of ``keep_every``.
        exclude: key paths not saved (e.g. ``("opt_state",)`` for a weights-only run); on restore they
            come back from the exemplar unchanged.
        async_save: return from ``maybe_save`` once staged (True) or once committed (False).
        when_busy: a save due while the previous one is still writing (at most one is in flight): ``"wait"``
            for it, so the newest commit never trails the loop by more than one interval plus the save in
            flight (the time waited adds up in ``wait_s``); ``"skip"`` that save instead (the loop never waits,
            the newest commit may trail further). A forced save (the last step, a signal) always waits.
        mesh: the mesh whose ranks take part (default: all ranks). With a ``pp`` axis of size > 1 each
            pipeline rank saves and restores only its stages' leaves, under the same key paths as the whole
            model; the checkpoint is the one an unpipelined run writes, so any layout restores it.

    Every rank constructs the manager and calls ``maybe_save`` / ``restore_latest`` at the same points.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        interval: int,
        keep_last: int,
        keep_every: int | None = None,
        exclude: tuple[str, ...] = (),
        async_save: bool = True,
        mesh: DeviceMesh | None = None,
        timeout_s: float = 1800.0,
        when_busy: str = "wait",
    ) -> None:
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy={when_busy!r}: 'wait' for the save in flight, or 'skip' the next one")
        if interval < 1:
            raise ValueError(f"interval={interval}: save every N >= 1 steps")
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: keep at least the newest checkpoint")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every={keep_every}: a positive step multiple, or None")
        if isinstance(exclude, str):
            exclude = (exclude,)
        self.root = os.path.abspath(os.fspath(root))
        self.interval, self.keep_last, self.keep_every = interval, keep_last, keep_every
        self.exclude = tuple(exclude)
        self.async_save = async_save
        self.when_busy = when_busy
        self.wait_s = 0.0  # seconds maybe_save waited for the previous save to commit (see pop_wait_s)
        self.skipped: list[int] = []  # steps not saved because the previous save was still writing ("skip")
        self._group = _Group(mesh, timeout_s)
        names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
        self._partial = mesh is not None and "pp" in names and mesh.size(names.index("pp")) > 1  # part of the tree
        self._ck = Checkpointer(mesh=mesh, timeout_s=timeout_s, group=self._group)
        self._last_saved: int | None = None
        self._damaged: set[int] = set()  # steps restore_latest found damaged: re-saved in place, never kept
        if self._group.leader:
            os.makedirs(self.root, exist_ok=True)
            self._remove_leftovers()
        self._group.barrier()

    def _remove_leftovers(self) -> None:
        """Remove what crashed saves and deletes left behind (``<step>.tmp-*``); nothing of this run is in flight."""
        for entry in os.listdir(self.root):
            if _LEFTOVER.match(entry):
                shutil.rmtree(os.path.join(self.root, entry), ignore_errors=True)

    # ------------------------------------------------------------------------------------- listing

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, str(step))

    def all_steps(self) -> list[int]:
        """The complete checkpoints' steps, oldest first."""
        if not os.path.isdir(self.root):
            return []
        steps = []
        for entry in os.listdir(self.root):
            if entry.isdigit() and os.path.isdir(os.path.join(self.root, entry, ITEM)):
                steps.append(int(entry))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (None when there is none). Its files are not checked."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------------------------- saving

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0 and step != self._last_saved

    def maybe_save(
        self, state: Any, *, step: int | None = None, force: bool = False, defer_staging: bool = False
    ) -> SaveHandle | None:
        """Save ``state`` if ``step`` (default ``state.step``) is a multiple of ``interval`` (or ``force``).

        Blocks only to wait for the previous save and to copy this rank's shards into staging buffers;
        with ``defer_staging`` (an asynchronous manager) the copy too runs in the background, and the caller
        must call ``staged()`` before it changes any of ``state``'s tensors in place: the trainer passes
        ``staged`` to its donated step as ``before_update``. A step that already has a checkpoint (e.g. the
        one just resumed from) is not saved again, unless ``restore_latest`` found it damaged: then the new
        checkpoint replaces it at the commit.
        """
        step = int(state.step if step is None else step)
        replace = step in self._damaged
        if not (force or self.should_save(step)) or (step in self._existing(step) and not replace):
            return None
        if step == self._last_saved and not replace:  # saved just now (maybe still in flight): not twice
            return None
        if self._ck.busy():  # at most one save in flight: wait for it (the lag bound), or skip this one
            if self.when_busy == "skip" and not force:
                self.skipped.append(step)
                return None
            t0 = time.perf_counter()
            self._ck.wait()
            self.wait_s += time.perf_counter() - t0
        self._last_saved = step
        self._damaged.discard(step)
        tree = partition(state, lambda n, x: not _under(n, self.exclude))[0] if self.exclude else state
        # a synchronous save writes the live values directly: nothing can change them meanwhile
        handle = self._ck.save(
            self.step_dir(step),
            tree,
            _item=ITEM,
            after_commit=self._retain,
            defer_staging=defer_staging,
            _stage_copy=self.async_save,
            _replace=replace,
        )
        if not self.async_save:
            handle.wait()
        return handle

    def _existing(self, step: int) -> set[int]:
        return {step} if os.path.isdir(self.step_dir(step)) else set()

    def _retain(self) -> None:
        """On the leader, after a commit: delete what the retention policy drops.

        Steps found damaged (and not re-saved since) neither count toward ``keep_last`` nor are kept.
        """
        steps = self.all_steps()
        intact = [s for s in steps if s not in self._damaged]
        keep = set(intact[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in intact if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                self._delete(self.step_dir(s))

    def _delete(self, path: str) -> None:
        # rename first: a crash mid-delete must not leave a half-deleted directory under a step's name
        shutil.rmtree(_move_aside(path), ignore_errors=True)

    def pop_wait_s(self) -> float:
        """The seconds ``maybe_save`` waited for a previous save since the last call (the metric
        ``checkpoint_wait_s``: how much the bound on the checkpoint's lag cost the loop)."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def staged(self) -> None:
        """Block until the save in flight (if any) has copied this rank's values into its staging buffers:
        the fence before they change in place (immediate unless ``maybe_save`` deferred staging)."""
        self._ck.staged()

    def wait(self) -> None:
        """Block until the save in flight is committed (re-raising its failure)."""
        self._ck.wait()

    def close(self) -> None:
        """Finish the save in flight and release the staging buffers; call before destroying the process group."""
        self._ck.close()

    # ------------------------------------------------------------------------------------- restoring

    def restore(
        self, step_or_path: int | str | os.PathLike, exemplar: Any, *, only: str | None = None, in_place: bool = False
    ) -> Any:
        """Restore one checkpoint (a step of this root, or a path) into ``exemplar``.

        ``only="params"`` reads just that subtree (``exemplar`` is then the params tree): a weights-only load
        for fine-tuning. Excluded key paths come back from the exemplar. ``in_place``: fill the exemplar's
        own CPU tensors (see ``functitan.checkpoint.restore``).
        """
        if isinstance(step_or_path, int):
            path = os.path.join(self.step_dir(step_or_path), ITEM)
        else:
            path = os.fspath(step_or_path)
            if os.path.isdir(os.path.join(path, ITEM)):
                path = os.path.join(path, ITEM)
        if only is not None:
            if _under(only, self.exclude):
                raise ValueError(f"only={only!r}: that key path is excluded from these checkpoints ({self.exclude})")
            self._check_covered(path, exemplar, only)
            return restore(path, exemplar, only=only, in_place=in_place, partial=self._partial)
        kept, rest = partition(exemplar, lambda n, x: not _under(n, self.exclude)) if self.exclude else (exemplar, None)
        self._check_covered(path, kept, None)
        value = restore(path, kept, in_place=in_place, partial=self._partial)
        return combine(value, rest) if self.exclude else value

    def _check_covered(self, path: str, exemplar: Any, only: str | None) -> None:
        """Pipeline ranks restore parts of the tree: check that together they restore all of it."""
        if not self._partial or self._group.pg is None:
            return
        names = {f"{only}.{n}" if only else n for n, _, _ in L.named_leaves(exemplar)[0]}
        gathered: list[Any] = [None] * len(self._group.ranks)
        dist.all_gather_object(gathered, sorted(names), group=self._group.pg)
        union = set().union(*map(set, gathered))
        meta_file = os.path.join(path, L.METADATA)
        if not os.path.isfile(meta_file):
            return  # restore() names the problem
        stored = {n for n in restore_names(meta_file) if only is None or n == only or n.startswith(only + ".")}
        extra = sorted(stored - union)
        if extra:
            raise ValueError(
                f"{extra[0]}: in the checkpoint ({meta_file}) but restored by no pipeline rank; extra keys: {extra[:8]}. "
                f"Fix: restore into the model the checkpoint was saved from (e.g. the same n_layers)"
            )

    def restore_latest(self, exemplar: Any, *, only: str | None = None, in_place: bool = False) -> Any | None:
        """Restore the newest checkpoint that is intact; None when the root has none.

        A damaged newest checkpoint (truncated or corrupted file) is skipped with a ``warnings.warn``, and
        the previous one restored. Every rank takes the same decision (they agree after each attempt).
        Errors in the exemplar (missing keys, shape mismatch) are raised, not skipped.
        """
        errors: list[tuple[int, str | None]] = []  # (step, the damage found)
        for step in reversed(self.all_steps()):
            value, error = None, None
            try:
                value = self.restore(step, exemplar, only=only, in_place=in_place)
            except CheckpointError as exc:
                error = exc
            found = self._first_error(error)
            if found is None:
                if errors:
                    damaged = "; ".join(f"checkpoint step {s} in {self.root} is damaged ({e})" for s, e in errors)
                    warnings.warn(
                        f"{damaged}; restored step {step} instead (a damaged step is saved again when the run "
                        f"reaches it)",
                        UserNotice,
                        stacklevel=2,
                    )
                self._last_saved = step
                self._damaged = {s for s, _ in errors}
                return value
            errors.append((step, found))
        if errors:
            raise CheckpointError(
                f"no intact checkpoint in {self.root}: " + "; ".join(f"step {s}: {e}" for s, e in errors)
            )
        return None

    def _first_error(self, error: CheckpointError | None) -> str | None:
        """The first rank's damage found in a step (None when every rank read it): the same on every rank, and
        naming the file, so each rank's message says which file it was (not "damaged on another rank")."""
        if self._group.pg is None:
            return None if error is None else str(error)
        found: list[Any] = [None] * len(self._group.ranks)
        dist.all_gather_object(found, None if error is None else str(error), group=self._group.pg)
        return next((e for e in found if e is not None), None)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def restore_names(meta_file: str) -> list[str]:
    """The leaf names (dotted key paths) a checkpoint's ``_METADATA`` lists."""
    return list(L.names_in_metadata(_read_json(meta_file)))


def _steps_in(d: Path) -> str:
    steps = sorted((e.name for e in d.iterdir() if e.name.isdigit()), key=int) if d.is_dir() else []
    return f" (steps in {d}: {', '.join(steps)})" if steps else ""


def check_checkpoint_path(path: str | os.PathLike) -> None:
    """A path given as a checkpoint (``export hf``, ``checkpoint.load_path``) that holds none is one line that
    lists the steps beside or under it: a run directory is the usual mistake. A torch DCP directory
    (torchtitan's ``step-<N>``) is one."""
    from ._dcp import is_dcp_dir

    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"checkpoint {path} does not exist{_steps_in(p.parent)}; pass a step directory such as "
            f"runs/<run>/checkpoints/<step>, or import hf's output"
        )
    if not ((p / L.METADATA).is_file() or (p / ITEM / L.METADATA).is_file() or is_dcp_dir(p)):
        raise CheckpointError(
            f"{path} is not a functitan checkpoint (no _METADATA in it or in {path}/default)"
            f"{_steps_in(p / 'checkpoints') or _steps_in(p)}; pass a step directory such as "
            f"runs/<run>/checkpoints/<step> (or a torch DCP one with its .metadata: torchtitan's step-<N>)"
        )


def restore_params(
    path: str | os.PathLike, exemplar: Any, *, partial: bool = False, model: tuple[Any, Any] | None = None
) -> Any:
    """A weights-only load of the ``params`` subtree from a checkpoint: a manager's step directory, its item
    directory, or ``import_hf``'s output; or a torch DCP directory in torchtitan's names (torchtitan's
    ``step-<N>``, ``export dcp``'s output), read through ``model``'s key map (``(Model, cfg)``) and cast to the
    exemplar's dtypes as an HF load is. ``exemplar`` is the params tree with the target placements
    (``partial``: a pipeline rank's part of it)."""
    from ._dcp import is_dcp_dir, read_dcp, torchtitan_keys

    check_checkpoint_path(path)
    path = os.fspath(path)
    if is_dcp_dir(path):
        if model is None:
            raise ValueError(f"{path} is a DCP checkpoint: pass model=(Model, cfg) to read it in torchtitan's names")
        return read_dcp(path, exemplar, torchtitan_keys(*model), cast=True)
    if os.path.isdir(os.path.join(path, ITEM)):
        path = os.path.join(path, ITEM)
    return restore(path, exemplar, only="params", partial=partial)
