"""Pipeline schedules as plain data: actions, schedules, their dependencies and communication.

A schedule is one ordered list of compute actions per pipeline rank. Nothing else is stored: which
tensor crosses which link follows from stage adjacency (stage ``s`` sends activations to ``s + 1`` and
``s + 1`` sends input gradients back to ``s``), so the validator, the simulator and the executor all
derive the order of work from the same two functions here (`dependencies`, `walk`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

# "F": forward. "B": input-gradient backward only (zero-bubble schedules; a "W" must follow).
# "W": weight-gradient backward. "BW": full backward (input and weight gradients together).
KINDS = ("F", "B", "W", "BW")
BACKWARD_KINDS = ("B", "BW")  # the kinds that produce the input gradient sent to stage - 1


class Action(NamedTuple):
    """One compute step: run `kind` for `microbatch` on `stage` (a global stage index)."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.microbatch})"


class Comm(NamedTuple):
    """One point-to-point transfer as seen from one rank.

    `stage` is the local stage: the producer for a "send", the consumer for a "recv". `kind` says
    which tensor moves: "F" an activation from stage s to s + 1, "B" an input gradient from s to s - 1.
    """

    op: str  # "send" | "recv"
    peer: int
    kind: str  # "F" | "B"
    stage: int
    microbatch: int

    def __str__(self) -> str:
        what = "activation" if self.kind == "F" else "gradient"
        arrow = "to" if self.op == "send" else "from"
        return f"{self.op} {what} (stage {self.stage}, mb {self.microbatch}) {arrow} rank {self.peer}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Per-rank ordered compute actions for `pp` ranks, each holding `stages_per_rank` stages.

    Attributes:
        name: a label for pictures and messages ("1f1b", "zb_v", a CSV file name, ...).
        pp: number of pipeline ranks.
        stages_per_rank: v, the number of model chunks (stages) each rank holds.
        microbatches: m, the number of microbatches in one step.
        stage_to_rank: rank of each global stage; length pp * stages_per_rank. Loop placement
            (0, 1, .., p-1, 0, 1, ..) for interleaved schedules, V placement (0, .., p-1, p-1, .., 0)
            for ZB-V.
        actions: actions[rank] is that rank's ordered tuple of `Action`s.

    The constructor only normalizes containers to tuples; `validate` checks the meaning.
    """

    name: str
    pp: int
    stages_per_rank: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        rows = tuple(tuple(a if isinstance(a, Action) else Action(*a) for a in row) for row in self.actions)
        object.__setattr__(self, "actions", rows)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The global stages that `rank` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)


def loop_placement(pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage s on rank s % pp: Megatron / torch interleaved placement."""
    return tuple(s % pp for s in range(pp * stages_per_rank))


def v_placement(pp: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank r holds stages r and 2p - 1 - r (ZB-V)."""
    return tuple(range(pp)) + tuple(reversed(range(pp)))


def dependencies(action: Action, num_stages: int, split: frozenset[tuple[int, int]]) -> tuple[Action, ...]:
    """The actions that must finish before `action` may start.

    Args:
        action: the action to start.
        num_stages: total number of stages.
        split: the (stage, microbatch) pairs whose backward is split into B and W; the others use BW.

    F(s) needs F(s-1); a backward of s needs its own F and the input gradient of s+1 (which is B or BW
    of s+1, whichever that stage uses); W needs its B.
    """
    kind, s, mb = action

    def bwd(stage: int) -> Action:
        return Action("B" if (stage, mb) in split else "BW", stage, mb)

    if kind == "F":
        return (Action("F", s - 1, mb),) if s > 0 else ()
    if kind == "W":
        return (Action("B", s, mb),)
    deps = (Action("F", s, mb),)
    return deps + ((bwd(s + 1),) if s + 1 < num_stages else ())


def split_pairs(schedule: Schedule) -> frozenset[tuple[int, int]]:
    """The (stage, microbatch) pairs that `schedule` runs as separate B and W."""
    return frozenset((a.stage, a.microbatch) for row in schedule.actions for a in row if a.kind in ("B", "W"))


def walk(schedule: Schedule, run: Callable[[int, Action, tuple[Action, ...]], None]) -> list[int]:
    """Execute every rank's list in order, in lockstep rounds; an action runs once its dependencies ran.

    Each round visits ranks 0..p-1 and lets each run at most its next action, like torch's lowering of
    a compute schedule to one with communication. Calls `run(rank, action, deps)` for each action in a
    dependency-respecting order. Returns the per-rank count of actions run: all of them unless the
    schedule deadlocks (or an action's dependency is missing from the schedule).
    """
    split = split_pairs(schedule)
    done: set[Action] = set()
    pos = [0] * schedule.pp
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(schedule.actions):
            if pos[rank] == len(row):
                continue
            action = row[pos[rank]]
            deps = dependencies(action, schedule.num_stages, split)
            if all(d in done for d in deps):
                run(rank, action, deps)
                done.add(action)
                pos[rank] += 1
                progress = True
    return pos
