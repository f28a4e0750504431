"""Live membership: data-parallel replica groups join and leave while the others keep stepping (torchft).

Each replica group (one process, or a torchrun group with its own FSDP/TP mesh) runs ``functitan train
--elastic.live=true --elastic.lighthouse=http://HOST:PORT``; a torchft lighthouse (``torchft_lighthouse``)
forms a quorum of the live groups at every step. One step:

1. quorum: the groups that are up; a group that is behind (a new one, or a restarted one) receives the train
   state -- params, optimizer state, step, data position, rng -- from a live peer over HTTP, not from disk;
2. the global batch of ``training.batch_size`` sequences at the step's data position is cut into units of
   ``elastic.microbatch_size`` sequences per rank; the n groups of the quorum take the units in turn, so a
   group runs more microbatches when fewer groups are up: the global batch and the data stream do not change;
3. each group's gradient, weighted by its share, is summed across groups (one allreduce of a flat buffer),
   so every group holds the gradient of the mean loss over the whole global batch; clip and update as usual;
4. commit vote: the new state is kept only if every group of the quorum finished the step. Otherwise (a
   peer died mid-step) the same step runs again, at the same data position, with the new quorum.

A killed group is dropped when the lighthouse misses its heartbeats (``--heartbeat_timeout_ms``) or a
collective with it times out (``elastic.timeout_s``). Requires the ``elastic`` extra (torchft).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._preempt import Preempted, Preemption
from ..step import make_train_step
from ..train_state import TrainState
from ._noquorum import NoQuorum

__all__ = ["LiveStepper", "live_stepper", "share"]


def share(units: int, n: int, rank: int) -> range:
    """The units of a step that participant ``rank`` of ``n`` takes: contiguous, sizes differing by at most one.

    >>> [list(share(5, 2, r)) for r in range(2)]
    [[0, 1, 2], [3, 4]]
    """
    base, extra = divmod(units, n)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


class LiveStepper:
    """``advance(state) -> (state, metrics, data position)``: one committed global step under a torchft quorum.

    Args:
        cfg: the job config (``elastic``, ``training`` sections).
        loss_grad: ``(params, batch) -> (mean loss over the batch, grads)`` for one microbatch.
        optimizer, max_norm, on_nonfinite: as for ``make_train_step``.
        loader: the trainer's loader (advances the data position by one global batch).
        device: where the batches go.
    """

    def __init__(
        self,
        cfg: Any,
        loss_grad: Any,
        optimizer: Any,
        *,
        max_norm: float,
        on_nonfinite: str,
        loader: Any,
        device: torch.device,
    ):
        import torchft  # the elastic extra (ElasticConfig checked that it is installed, and the section's values)

        ecfg, tcfg = cfg.elastic, cfg.training
        self.group_rank = dist.get_rank() if dist.is_initialized() else 0
        self.group_size = dist.get_world_size() if dist.is_initialized() else 1
        unit = ecfg.microbatch_size * self.group_size  # the group's size is known only here, once it runs
        if tcfg.batch_size % unit:
            raise ValueError(
                f"training.batch_size={tcfg.batch_size} must be a multiple of elastic.microbatch_size="
                f"{ecfg.microbatch_size} x {self.group_size} ranks per replica group = {unit}"
            )
        self.units, self.unit, self.global_batch = tcfg.batch_size // unit, unit, tcfg.batch_size
        self.loader, self.device, self.loss_grad = loader, device, loss_grad
        self.mb_loader = copy.copy(loader)  # shares the token cache; reads one microbatch of one rank
        self.mb_loader.batch_size, self.mb_loader.dp_rank, self.mb_loader.dp_size = ecfg.microbatch_size, 0, 1
        self.train_step = make_train_step(self._grad_fn, optimizer, max_norm=max_norm, on_nonfinite=on_nonfinite)
        self.state: TrainState | None = None  # the state the manager sends to, or loads from, a peer

        timeout = timedelta(seconds=ecfg.timeout_s)
        if "MASTER_ADDR" in os.environ:  # a torchrun group: its store
            store_addr, store_port, self._store = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
        else:  # one process: a store of our own
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self._store.port
        host = ecfg.advertise_host or socket.gethostname()
        self.ecfg, self.replica_id = ecfg, ecfg.replica_id or f"{host}-{os.getpid()}"
        self._pg = torchft.ProcessGroupGloo(timeout=timeout)
        self.manager = torchft.Manager(
            pg=self._pg,
            min_replica_size=ecfg.min_replicas,
            load_state_dict=self._load,
            state_dict=self._state_dict,
            use_async_quorum=False,
            replica_id=self.replica_id,
            store_addr=store_addr,
            store_port=store_port,
            rank=self.group_rank,
            world_size=self.group_size,
            lighthouse_addr=ecfg.lighthouse,
            hostname=host,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ecfg.quorum_timeout_s),
        )

    # -- the state a peer sends or receives --------------------------------------------------------------

    def _current(self) -> TrainState:
        """The state torchft sends or heals into: set by `advance` before each quorum (the only time it asks)."""
        if self.state is None:
            raise RuntimeError("elastic: torchft asked for the training state before advance() set it")
        return self.state

    def _state_dict(self) -> dict[str, Any]:
        s = self._current()
        return {
            "step": s.step,
            "data_state": dict(s.data_state),
            "rng": s.rng,
            "params": optree.tree_map(_local, s.params, none_is_leaf=True),
            "opt_state": optree.tree_map(_local, s.opt_state, none_is_leaf=True),
        }

    def _load(self, sd: dict[str, Any]) -> None:
        def into(mine: Any, theirs: Any) -> Any:
            if isinstance(mine, torch.Tensor):
                _local(mine).copy_(theirs)
                return mine
            return theirs

        s = self._current()
        with torch.no_grad():
            params = optree.tree_map(into, s.params, sd["params"], none_is_leaf=True)
            opt_state = optree.tree_map(into, s.opt_state, sd["opt_state"], none_is_leaf=True)
        self.state = s._replace(
            step=int(sd["step"]), data_state=dict(sd["data_state"]), rng=sd["rng"], params=params, opt_state=opt_state
        )

    # -- one step ----------------------------------------------------------------------------------------

    def _grad_fn(self, params: Any, batches: list[Any]) -> tuple[torch.Tensor, Any]:
        """This group's share of the global batch -> the gradient of the global mean loss, summed over groups."""
        weight = self.unit / self.global_batch  # one unit's share of the global mean
        loss, acc = torch.zeros((), device=self.device), None
        for mb in batches:
            mb_loss, grads = self.loss_grad(params, mb)
            loss = loss + mb_loss.detach().float() * weight
            acc = grads if acc is None else optree.tree_map(torch.add, acc, grads)
        if acc is None:  # no unit this step (more groups than units): contribute zeros
            acc = optree.tree_map(torch.zeros_like, params)
        leaves, treedef = optree.tree_flatten(acc)
        flat = torch.cat([_local(g).detach().reshape(-1).float() for g in leaves] + [loss.reshape(1)])
        flat[:-1].mul_(weight)
        self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:  # a peer failed mid-step: the vote will discard this step
            self._hang_up()
            flat.zero_()
        out, offset = [], 0
        for g in leaves:
            n = _local(g).numel()
            local = flat[offset : offset + n].view_as(_local(g)).to(_local(g).dtype)
            out.append(
                DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())
                if isinstance(g, DTensor)
                else local
            )
            offset += n
        return flat[-1], optree.tree_unflatten(treedef, out)

    def _hang_up(self) -> None:
        """Close this group's connections now that its collective failed, so that a peer still blocked on a message
        from us fails at once instead of waiting out ``elastic.timeout_s``.

        A ring allreduce that loses one peer fails fast only where a rank waits on the dead one; a rank waiting on a
        survivor that already failed and left for the next quorum waits for the timeout, and that quorum waits for
        it (1 of 6 kills here: 30 s with elastic.timeout_s=30). gloo's ``abort`` leaves the sockets open; only the
        process group's destruction closes them, so torchft's wrapper drops it (``abort`` sets its group to None)
        and the collector frees it. The next quorum has a new id (the lighthouse bumps it for a failed commit, and
        for a lost member), so torchft configures a fresh group there."""
        self._pg.abort()
        gc.collect()

    def advance(
        self, state: TrainState, preemption: Preemption, before_update: Any = None
    ) -> tuple[TrainState, dict[str, Any], dict[str, int]] | None:
        """Run the next global step until a quorum commits it; returns the new state, metrics and its data position.

        None when a stop signal arrives while waiting for a quorum (the peers may be gone for good).
        ``before_update``: the fence before ``state``'s tensors change in place; the step here is functional,
        but healing from a peer copies into them, so it is called first.
        """
        if before_update is not None:
            before_update()
        retries = 0
        if self.manager.current_step() != state.step:  # restored from disk: a peer that is ahead heals us
            self.manager.load_state_dict({"step": state.step, "batches_committed": self.manager.batches_committed()})
        while True:
            self.state = state
            try:
                with preemption.interruptible():
                    self.manager.start_quorum()  # may replace self.state with a live peer's (healing)
            except Preempted:
                return None
            except TimeoutError as exc:  # the lighthouse formed no quorum in time: the peers are gone
                raise NoQuorum.of(self.ecfg, self.replica_id, exc) from None
            state = self.state
            n, rank = self.manager.num_participants(), self.manager.participating_rank()
            position = state.data_state
            seq = position["seq"] + self.group_rank * self.mb_loader.batch_size
            batches = [
                self.mb_loader.next({"epoch": position["epoch"], "seq": seq + u * self.unit})[0]
                for u in (share(self.units, n, rank) if rank is not None else ())
            ]
            _, after = self.loader.next(position)  # the position one global batch later
            new, out = self.train_step(state._replace(data_state=after), batches)
            if self.manager.should_commit():
                self.state = new
                return new, {**out, "replicas": n, "retries": retries, "units": len(batches)}, position
            retries += 1

    def close(self) -> None:
        self.manager.shutdown(wait=False)


@contextlib.contextmanager
def live_stepper(
    cfg: Any, train_step: Any, loader: Any, device: torch.device, *, loss_grad: Any, optimizer: Any
) -> Iterator[Any]:
    """The trainer's stepper for ``elastic.live`` (``functitan.train.run(cfg, stepper=live_stepper)``): each
    global step on the replica groups of a torchft quorum. ``train_step`` (the job's own step) is not used: the
    stepper builds one over ``loss_grad``, the per-microbatch gradient, to share the batch out across groups."""
    live = LiveStepper(
        cfg,
        loss_grad,
        optimizer,
        max_norm=cfg.optimizer.max_norm,
        on_nonfinite=cfg.training.on_nonfinite,
        loader=loader,
        device=device,
    )
    try:
        yield live.advance
    finally:
        live.close()
