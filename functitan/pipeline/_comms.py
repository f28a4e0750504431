"""Lower a compute schedule to per-rank programs with the point-to-point ops an executor posts."""

from __future__ import annotations

from functitan.pipeline._schedule import BACKWARD_KINDS, Action, Comm, Schedule, walk
from functitan.pipeline._validate import validate


def _send(schedule: Schedule, rank: int, action: Action) -> Comm | None:
    kind, s, mb = action
    to_rank = schedule.stage_to_rank
    if kind == "F" and s + 1 < schedule.num_stages and to_rank[s + 1] != rank:
        return Comm("send", to_rank[s + 1], "F", s, mb)
    if kind in BACKWARD_KINDS and s > 0 and to_rank[s - 1] != rank:
        return Comm("send", to_rank[s - 1], "B", s, mb)
    return None


def with_comms(schedule: Schedule) -> tuple[tuple[Action | Comm, ...], ...]:
    """Each rank's program: its compute actions with the sends and receives they imply, in posting order.

    Execution model (torch's pipelining runtime): a `Comm` "send" right after the action that produced
    the tensor is posted without blocking (isend; wait for it at the end of the step); a "recv" is
    posted without blocking (irecv) where it stands, and the compute action that consumes it (the next
    F or B/BW of that stage and microbatch) waits for it first. A transfer between two stages on the
    same rank is a local hand-off and gets no op.

    Receives are placed the way torch's `_add_send_recv` places them: the ranks execute in lockstep
    (`walk`) and a rank's receive is appended to its program when the sender posts the send. So on
    every link (src, dst) the receiver posts in the sender's order, which NCCL needs (it matches
    point-to-point ops by order, not by tag); with ZB-V the receiver needs messages in a different
    order than it receives them, so posting a receive only when its consumer runs would not do.

    Raises:
        ValueError: from `validate` when the schedule is broken or deadlocks.

    Example (1F1B, 2 ranks, 1 microbatch): rank 0 runs F(stage 0, mb 0), send activation to rank 1,
    recv gradient from rank 1, BW(stage 0, mb 0); rank 1 runs recv activation from rank 0,
    F(stage 1, mb 0), BW(stage 1, mb 0), send gradient to rank 0.
    """
    validate(schedule)
    programs: list[list[Action | Comm]] = [[] for _ in range(schedule.pp)]

    def run(rank: int, action: Action, deps: tuple[Action, ...]) -> None:
        programs[rank].append(action)
        send = _send(schedule, rank, action)
        if send is not None:
            programs[rank].append(send)
            peer_stage = send.stage + 1 if send.kind == "F" else send.stage - 1
            programs[send.peer].append(Comm("recv", rank, send.kind, peer_stage, send.microbatch))

    walk(schedule, run)
    return tuple(tuple(p) for p in programs)
