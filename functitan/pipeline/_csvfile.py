"""Custom schedules from CSV files, in torch.distributed.pipelining's compute-only format.

One row per rank (row 1 is rank 0), no header; each cell is `{stage}{letter}{microbatch}` with torch's
letters, so files move both ways between functitan and torch (`_PipelineScheduleRuntime.load_csv` /
`_dump_csv(..., format="compute_only")`):

    F  forward                          -> Action("F", ...)
    I  input-gradient backward          -> Action("B", ...)   (zero-bubble "B")
    W  weight-gradient backward         -> Action("W", ...)
    B  full backward (input and weight) -> Action("BW", ...)  (careful: torch's "B" is our "BW")

Empty cells (torch writes an idle step as "") are skipped. Example for 1F1B with p=2, m=2:

    0F0,0F1,0B0,0B1
    1F0,1B0,1F1,1B1

The number of ranks is the number of rows, the stage placement follows from where each stage's cells
are, and the number of microbatches is the largest microbatch index + 1.
"""

from __future__ import annotations

import csv
import os
import re

from functitan.pipeline._schedule import Action, Schedule

_CELL = re.compile(r"(\d+)([FIWB])(\d+)")
_FROM_TORCH = {"F": "F", "I": "B", "W": "W", "B": "BW"}
_TO_TORCH = {v: k for k, v in _FROM_TORCH.items()}


def _parse_row(path: str, line: int, cells: list[str]) -> list[Action]:
    row = []
    for col, cell in enumerate(cells, start=1):
        text = cell.strip()
        if not text:
            continue
        match = _CELL.fullmatch(text)
        if match is None:
            raise ValueError(
                f"{path}: row {line} (rank {line - 1}), cell {col}: cannot parse {cell!r}; expected "
                f"{{stage}}{{F|I|W|B}}{{microbatch}} like '0F3' (I = input-gradient B, B = full backward BW)"
            )
        stage, letter, mb = match.groups()
        row.append(Action(_FROM_TORCH[letter], int(stage), int(mb)))
    return row


def load_csv(path: str | os.PathLike, *, name: str | None = None) -> Schedule:
    """Read a schedule written in the format above; `name` defaults to the file name.

    The result is not validated here; call `validate` (simulate and with_comms do).

    Raises:
        ValueError: naming the file, row and cell of a malformed cell, or when a stage appears in
            two rows, stage numbers have gaps, or ranks hold different numbers of stages.
    """
    path = os.fspath(path)
    with open(path, newline="") as f:
        rows = [_parse_row(path, i, cells) for i, cells in enumerate(csv.reader(f), start=1)]
    if not any(rows):
        raise ValueError(f"{path}: no actions; expected one row of actions per rank")
    stage_to_rank: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for a in row:
            if stage_to_rank.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"{path}: stage {a.stage} appears in row {stage_to_rank[a.stage] + 1} and row {rank + 1}; "
                    f"each stage must live on one rank (one row)"
                )
    stages = sorted(stage_to_rank)
    if stages != list(range(len(stages))):
        raise ValueError(f"{path}: stages {stages} are not 0..n-1; every stage between needs actions")
    held = [sum(1 for r in stage_to_rank.values() if r == rank) for rank in range(len(rows))]
    if len(set(held)) != 1:
        raise ValueError(f"{path}: rows hold {held} stages each; every rank must hold the same number")
    microbatches = 1 + max(a.microbatch for row in rows for a in row)
    return Schedule(
        name=name or os.path.splitext(os.path.basename(path))[0],
        pp=len(rows),
        stages_per_rank=held[0],
        microbatches=microbatches,
        stage_to_rank=tuple(stage_to_rank[s] for s in stages),
        actions=tuple(tuple(row) for row in rows),
    )


def save_csv(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write `schedule` in the format above (one row per rank); `load_csv` reads it back equal."""
    with open(os.fspath(path), "w", newline="") as f:
        writer = csv.writer(f)
        for row in schedule.actions:
            writer.writerow(f"{a.stage}{_TO_TORCH[a.kind]}{a.microbatch}" for a in row)
