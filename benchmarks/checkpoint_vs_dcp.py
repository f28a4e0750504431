"""functitan.checkpoint vs torch.distributed.checkpoint (DCP) vs torch.save, on 2 gloo processes.

About 500 MB of state (params + Adam mu/nu, fp32, FSDP Shard(0) over 2 ranks). Measures:
  (a) what the training loop loses per save: ``blocked_*`` = (the save call + the next training step) - a
      step without a save in flight (the median of ``PLAIN_STEPS`` right before), so it counts the staging
      copy, the step's wait at the staging fence and the step's slowdown by the background write. The step
      is the trainer's (``make_train_step(donate=True)``: fused AdamW in place on the same params, mu and
      nu; forward and backward of a least-squares loss on each rank's shards). ``functitan_async``: the save
      stages before it returns; ``functitan_async_deferred``: it stages in the background
      and the step's update waits at ``before_update=ckpt.staged`` (the trainer); DCP ``async_save``
      (stages in the call). ``call_*`` / ``fence_*``: the save call's and the fence's share; the ratios divide
      by a synchronous save's time (``staging_call_over_sync_save``: the call alone, the figure reported
      before the step was counted; ``deferred_call_over_sync_save``: the same for the trainer's call, staging
      deferred, the time the loop is blocked per save). ``lost_until_commit_*``: ``blocked_*`` plus what the steps after it lose
      until the save has committed on every rank (their time beyond as many plain steps; ``steps_in_flight``
      of them): the whole cost of a save to the loop, which on a host whose cores the ranks' compute already
      fills includes the CPU time of the background write. All repetitions of (a) run first, then those of
      (b) and (c);
  (b) save throughput (GB/s, to fsync'd files): functitan Checkpointer.save_sync (steady state) and
      module-level save_sync (one-off: sets up a commit group), DCP save, torch.save per rank;
  (c) load time into the same sharding and resharded (FSDP Shard(0) -> TP Shard(1)), functitan and DCP
      alternating, ``--load-rounds`` rounds per repetition after one unrecorded read of each, two ways:
      in place into existing tensors (what a trainer and ``dcp.load`` do), and into new tensors ("_new":
      functitan's default ``restore``; DCP has no such mode, so its peer allocates empty tensors and loads
      into them, the allocation inside the timed region on both sides: every byte lands in fresh memory).
Each number is the median over the repetitions (loads: over reps x load rounds) of the slowest rank;
``ratios_per_run`` holds each repetition's (load round's) ratio of the slowest ranks. Writes
benchmarks/results/checkpoint_vs_dcp.json.

    python benchmarks/checkpoint_vs_dcp.py [--mb 500] [--reps 3] [--load-rounds 2] [--dir /tmp/ckpt_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from functitan import _dtensor as _dt
from functitan import optim
from functitan.checkpoint import Checkpointer, CheckpointManager, restore, save_sync
from functitan.step import make_train_step
from functitan.testing import run_distributed
from functitan.train_state import TrainState

ROWS, COLS = 2048, 1280  # one fp32 matrix = 10.5 MB
BATCH = 128  # rows of the step's input: forward + backward ~ 84M FLOPs per row and rank (~0.15 s on one core)
PLAIN_STEPS = 3  # a step without a save in flight: the median of this many, right before the one with a save


def _state(mesh, n: int, placement) -> dict:
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(ROWS, COLS, generator=g) for i in range(n)}
    dt = lambda t: distribute_tensor(t, mesh, [placement], src_data_rank=None)  # noqa: E731
    return {
        "params": {k: dt(v) for k, v in params.items()},
        "mu": {k: dt(torch.zeros_like(v) + 0.1) for k, v in params.items()},
        "nu": {k: dt(torch.zeros_like(v) + 0.2) for k, v in params.items()},
    }


def _grad_fn(params: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A least-squares loss on each weight's local shard, gradient by hand: the forward and backward the step
    overlaps a deferred staging copy with (each rank computes with its own shard; the step's norm all-reduces)."""
    loss, grads = x.new_zeros(()), {}
    for k, w in params.items():
        local = _dt.local(w)  # (ROWS / 2, COLS)
        y = x @ local.T  # (BATCH, ROWS / 2)
        loss = loss + y.square().mean()
        grads[k] = _dt.wrap((y.T @ x).mul_(2 / y.numel()), _dt.spec(w))
    return loss, grads


def _train_state(state: dict) -> tuple[TrainState, object]:
    """The trainer's donated step (fused AdamW in place) over ``state``'s params, with its mu / nu as Adam's moments."""
    opt = optim.adamw(1e-4, weight_decay=0.0)
    adam, *rest = opt.init(state["params"])
    opt_state = (adam._replace(mu=state["mu"], nu=state["nu"]), *rest)
    step = make_train_step(_grad_fn, opt, donate=True)
    return TrainState(step=0, params=state["params"], opt_state=opt_state, data_state={}, rng=0), step


def _fresh(tree: dict) -> dict:
    """New, uninitialised DTensors like ``tree``'s (DCP's peer of a restore into new tensors)."""
    return {
        k: {n: _dt.wrap(torch.empty_like(_dt.local(v)), _dt.spec(v)) for n, v in sub.items()} for k, sub in tree.items()
    }


def _timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    dist.barrier()
    return dt


def _fsync_tree(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _clear(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _bench(root: str, n: int, reps: int, load_rounds: int, blocked_only: bool) -> dict:
    rank = dist.get_rank()
    fsdp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    state = _state(fsdp, n, Shard(0))
    tp_ex = _state(fsdp, n, Shard(1))  # the reshard target: another dim
    same_ex = _state(fsdp, n, Shard(0))
    out: dict[str, list[float]] = {}
    add = lambda k, v: out.setdefault(k, []).append(v)  # noqa: E731
    # DCP's async_save runs collectives from a background thread: give it its own group, as we do ours
    dcp_pg = dist.new_group(backend="gloo")
    ck = Checkpointer()
    ck.save_sync(f"{root}/warm", state)  # set up the commit group and the plan once
    ts, train_step = _train_state(state)  # the trainer's donated step on the same tensors
    x = torch.randn(BATCH, COLS, generator=torch.Generator().manual_seed(rank))
    mgr = CheckpointManager(f"{root}/mgr", interval=1, keep_last=1)

    def step(fence=None) -> None:
        nonlocal ts
        ts, _ = train_step(ts, x, before_update=fence)

    step()
    mgr.maybe_save(ts, defer_staging=True)  # allocate and touch the manager's staging buffers
    step(mgr.staged)
    mgr.wait()
    plain = lambda: statistics.median(_timed(step) for _ in range(PLAIN_STEPS))  # noqa: E731

    def until_commit(done, key: str) -> float:
        """Run steps while the save is in flight on any rank; return their time beyond as many plain steps
        (the background write's cost to the loop after the step ``blocked_*`` counts)."""
        k, t = 0, time.perf_counter()
        while True:
            busy = torch.tensor([0.0 if done() else 1.0])
            dist.all_reduce(busy)  # the ranks agree on the number of steps (each step has collectives)
            if not busy.item():
                break
            step()
            k += 1
        add(f"steps_in_flight_{key}", float(k))
        return time.perf_counter() - t - k * out[f"step_plain_{key}"][-1]

    for r in range(reps):
        p = f"{root}/r{r}"
        # (a) what the loop loses to a save: (save call + the next step) - a step without a save in flight;
        # functitan staging before the call returns and deferred (the trainer), then DCP
        for key, defer in (("functitan_async", False), ("functitan_async_deferred", True)):
            add(f"step_plain_{key}", plain())
            call = fence = 0.0
            handle = None

            def staged() -> None:
                nonlocal fence
                t = time.perf_counter()
                mgr.staged()
                fence = time.perf_counter() - t

            def ft_async():
                nonlocal call, handle
                t = time.perf_counter()
                handle = mgr.maybe_save(ts, defer_staging=defer)  # noqa: B023 - called in this iteration
                call = time.perf_counter() - t
                step(staged)  # the update waits for a deferred staging copy (no wait otherwise)

            add(f"blocked_{key}", _timed(ft_async) - out[f"step_plain_{key}"][-1])
            add(f"call_{key}", call)
            add(f"fence_{key}", fence)
            add(f"lost_until_commit_{key}", out[f"blocked_{key}"][-1] + until_commit(handle.done, key))
            add(f"commit_{key}", _timed(mgr.wait))
        add("step_plain_dcp_async", plain())
        fut = None

        def dcp_async():
            nonlocal fut, call
            t = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=f"{p}/dcp_async", process_group=dcp_pg)
            call = time.perf_counter() - t
            step()

        add("blocked_dcp_async", _timed(dcp_async) - out["step_plain_dcp_async"][-1])
        add("call_dcp_async", call)
        add("lost_until_commit_dcp_async", out["blocked_dcp_async"][-1] + until_commit(fut.done, "dcp_async"))
        _timed(lambda: fut.result())
        if blocked_only:  # the ratios' unit, measured here for a quick look
            add("save_functitan_sync", _timed(lambda: ck.save_sync(f"{p}/ft_sync", state)))
        _clear(p)
    mgr.close()
    if blocked_only:
        ck.close()
        return out
    # (b) and (c) after all of (a), as they were measured before the step was counted: (a) writes 3 more
    # checkpoints per repetition, and the disk's throughput right after them is not that of a quiet disk
    os.sync()
    _timed(lambda: time.sleep(5.0))
    for r in range(reps):
        p = f"{root}/r{r}"

        def torch_save():
            os.makedirs(f"{p}/torch", exist_ok=True)  # noqa: B023 - called in this iteration
            local = {k: {n_: v.to_local() for n_, v in sub.items()} for k, sub in state.items()}
            torch.save(local, f"{p}/torch/rank{rank}.pt")  # noqa: B023
            _fsync_tree(f"{p}/torch")  # noqa: B023

        saves = [
            ("save_functitan_sync", lambda: ck.save_sync(f"{p}/ft_sync", state)),  # noqa: B023
            ("save_functitan_oneoff", lambda: save_sync(f"{p}/ft_oneoff", state)),  # noqa: B023
            ("save_dcp", lambda: dcp.save(state, checkpoint_id=f"{p}/dcp")),  # noqa: B023
            ("save_torch", torch_save),
        ]
        # each save starts on a clean disk (the previous one's dirty pages written back first, untimed), and the
        # order alternates, so no side always pays for the writeback of the one before it
        for name, save in saves if r % 2 == 0 else saves[::-1]:
            os.sync()
            dist.barrier()
            add(name, _timed(save))
        # (c) loads: one unrecorded read of each checkpoint first (no load pays for the writeback of the
        # saves above, both are in the page cache), then rounds that alternate functitan and DCP
        _timed(lambda: restore(f"{p}/ft_sync", same_ex))
        _timed(lambda: dcp.load(same_ex, checkpoint_id=f"{p}/dcp"))
        # DCP loads in place into the exemplar's tensors; functitan does with in_place=True (what the trainer
        # uses), and builds new tensors by default ("_new": every byte page-faulted into fresh memory)
        for _ in range(load_rounds):
            add("load_functitan_same", _timed(lambda: restore(f"{p}/ft_sync", same_ex, in_place=True)))
            add("load_dcp_same", _timed(lambda: dcp.load(same_ex, checkpoint_id=f"{p}/dcp")))
            add("load_functitan_reshard", _timed(lambda: restore(f"{p}/ft_sync", tp_ex, in_place=True)))
            add("load_dcp_reshard", _timed(lambda: dcp.load(tp_ex, checkpoint_id=f"{p}/dcp")))
            add("load_functitan_same_new", _timed(lambda: restore(f"{p}/ft_sync", same_ex)))
            add("load_dcp_same_new", _timed(lambda: dcp.load(_fresh(same_ex), checkpoint_id=f"{p}/dcp")))
            add("load_functitan_reshard_new", _timed(lambda: restore(f"{p}/ft_sync", tp_ex)))
            add("load_dcp_reshard_new", _timed(lambda: dcp.load(_fresh(tp_ex), checkpoint_id=f"{p}/dcp")))
        _clear(p)
    ck.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=500.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--load-rounds", type=int, default=2, help="alternating load rounds per repetition")
    ap.add_argument("--dir", default="/tmp/ckpt_bench")
    ap.add_argument("--blocked-only", action="store_true", help="only (a) and the synchronous save; no JSON")
    args = ap.parse_args()
    n = max(1, round(args.mb * 1e6 / (3 * ROWS * COLS * 4)))
    nbytes = 3 * n * ROWS * COLS * 4
    shutil.rmtree(args.dir, ignore_errors=True)
    per_rank = run_distributed(_bench, 2, args.dir, n, args.reps, args.load_rounds, args.blocked_only, timeout=3600)
    shutil.rmtree(args.dir, ignore_errors=True)
    # slowest rank per repetition (load round), then the median over them
    runs = {k: [max(r[k][i] for r in per_rank) for i in range(len(per_rank[0][k]))] for k in per_rank[0]}
    med = {k: statistics.median(v) for k, v in runs.items()}
    gb = nbytes / 1e9
    # ratio name -> (numerator, denominator); a throughput ratio is the inverse of the time ratio
    ratios = {
        "blocked_functitan_over_dcp_async": ("blocked_functitan_async", "blocked_dcp_async"),
        "blocked_functitan_over_sync_save": ("blocked_functitan_async", "save_functitan_sync"),
        "blocked_deferred_over_sync_save": ("blocked_functitan_async_deferred", "save_functitan_sync"),
        "staging_call_over_sync_save": ("call_functitan_async", "save_functitan_sync"),
        # what the trainer's save call blocks (staging deferred to the step's fence), and DCP async_save's call
        "deferred_call_over_sync_save": ("call_functitan_async_deferred", "save_functitan_sync"),
        "deferred_call_over_dcp_async_call": ("call_functitan_async_deferred", "call_dcp_async"),
        "lost_until_commit_functitan_over_sync_save": ("lost_until_commit_functitan_async", "save_functitan_sync"),
        "lost_until_commit_deferred_over_sync_save": (
            "lost_until_commit_functitan_async_deferred",
            "save_functitan_sync",
        ),
        "lost_until_commit_functitan_over_dcp_async": (
            "lost_until_commit_functitan_async",
            "lost_until_commit_dcp_async",
        ),
        "throughput_functitan_over_dcp": ("save_dcp", "save_functitan_sync"),
        "throughput_functitan_over_torch_save": ("save_torch", "save_functitan_sync"),
        "load_functitan_over_dcp_same": ("load_functitan_same", "load_dcp_same"),
        "load_functitan_over_dcp_reshard": ("load_functitan_reshard", "load_dcp_reshard"),
        "load_functitan_new_over_dcp_new_same": ("load_functitan_same_new", "load_dcp_same_new"),
        "load_functitan_new_over_dcp_new_reshard": ("load_functitan_reshard_new", "load_dcp_reshard_new"),
        # new tensors against DCP in place (allocation against none): the figure reported before the DCP peer
        "load_functitan_new_over_dcp_same": ("load_functitan_same_new", "load_dcp_same"),
        "load_functitan_new_over_dcp_reshard": ("load_functitan_reshard_new", "load_dcp_reshard"),
    }
    ratios = {k: ab for k, ab in ratios.items() if all(x in med for x in ab)}
    if args.blocked_only:
        print(json.dumps({"seconds_median": med, "ratios": {k: med[a] / med[b] for k, (a, b) in ratios.items()}}))
        print(json.dumps({k: [x / y for x, y in zip(runs[a], runs[b])] for k, (a, b) in ratios.items()}))
        return
    res = {
        "state_MB": round(nbytes / 1e6, 1),
        "processes": 2,
        "reps": args.reps,
        "load_samples": args.reps * args.load_rounds,
        "torch": torch.__version__,
        "seconds_median": {k: round(v, 4) for k, v in med.items()},
        "throughput_GBps": {
            k: round(gb / med[k], 3)
            for k in (
                "save_functitan_sync",
                "save_functitan_oneoff",
                "save_dcp",
                "save_torch",
                "commit_functitan_async",
            )
        },
        "ratios": {k: round(med[a] / med[b], 3) for k, (a, b) in ratios.items()},
        "ratios_per_run": {k: [round(x / y, 3) for x, y in zip(runs[a], runs[b])] for k, (a, b) in ratios.items()},
        "note": "2 shared CPU cores, local disk, page cache warm for loads; numbers vary with load from other jobs",
    }
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/checkpoint_vs_dcp.json", "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
