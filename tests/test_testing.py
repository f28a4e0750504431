import os
import signal
import time

import torch
import torch.distributed as dist

from functitan.testing import run_distributed


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_run_distributed_returns_rank_ordered_results():
    out = run_distributed(_allreduce_rank, 3)
    assert out == [(0, 6.0), (1, 6.0), (2, 6.0)]


def _fail_on_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return 0


def test_run_distributed_reports_the_failing_rank():
    import pytest

    with pytest.raises(RuntimeError, match="(?s)rank 1.*boom on purpose"):
        run_distributed(_fail_on_one, 2, timeout=60)


def test_run_distributed_retries_when_the_port_was_taken(monkeypatch):
    import socket

    import functitan.testing as T

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()  # the rendezvous port is taken between choosing and binding it
    ports = iter([busy.getsockname()[1]])
    real = T.free_port
    monkeypatch.setattr(T, "free_port", lambda: next(ports, None) or real())
    try:
        assert run_distributed(_allreduce_rank, 2, timeout=120) == [(0, 3.0), (1, 3.0)]
    finally:
        busy.close()


def _exit_on_one():
    if dist.get_rank() == 1:
        os._exit(3)  # dies without reporting, as a crash or the OOM killer would
    return 0  # rank 0 reports: the parent used to wait for rank 1's report until the timeout


def test_run_distributed_raises_at_once_when_a_rank_dies_without_reporting():
    import multiprocessing

    import pytest

    before = set(multiprocessing.active_children())  # the session's worker pools are children too
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*exit code 3"):
        run_distributed(_exit_on_one, 2, timeout=300)
    assert time.monotonic() - start < 30  # not the 300 s timeout
    assert set(multiprocessing.active_children()) <= before


def _exit_on_one_in_a_collective():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()  # gloo sees the peer gone and raises on rank 0: a consequence, not the cause
    return 0


def test_run_distributed_names_the_rank_that_died_when_another_fails_because_of_it():
    import multiprocessing

    import pytest

    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*exit code 3.*rank 0:"):
        run_distributed(_exit_on_one_in_a_collective, 2, timeout=300)
    assert set(multiprocessing.active_children()) <= before


def _segfault_on_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return 0


def test_run_distributed_names_the_signal_and_the_traceback_of_a_killed_rank():
    import pytest

    with pytest.raises(RuntimeError, match="(?s)rank 1:.*signal SIGSEGV.*_segfault_on_one"):
        run_distributed(_segfault_on_one, 2, timeout=300)


# ---- the worker pool: one process group for many calls --------------------------------------------------------


def _dirty():
    """Change everything a test function might change in its process, and report what it found first."""
    found = (
        os.environ.get("FUNCTITAN_POOL_PROBE"),
        os.getcwd(),
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.rand(1).item(),
        len(torch.distributed.distributed_c10d._world.pg_map),
        os.getpid(),
    )
    os.environ["FUNCTITAN_POOL_PROBE"] = "dirty"
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    dist.new_group([0, 1])
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return found, t.item()


def _destroy_the_group():
    dist.destroy_process_group()  # as a CLI's main() does at its end
    return "done"


def test_a_pool_runs_many_calls_on_one_group_and_each_finds_a_fresh_process():
    from functitan.testing import WorkerPool

    with WorkerPool(2) as pool:
        first = pool.run(_dirty)
        second = pool.run(_dirty)
        assert [r[1] for r in first] == [3.0, 3.0] and [r[1] for r in second] == [3.0, 3.0]
        for (before, _), (after, _) in zip(first, second):
            assert after[:6] == before[:6]  # environment, cwd, dtype, threads, RNG, groups: as at the start
            assert after[6] == before[6]  # the same process served both calls
        assert first[0][0][0] is None and first[0][0][5] == 1  # no probe, only the default group
        start = time.monotonic()
        for _ in range(20):
            assert pool.run(_allreduce_rank) == [(0, 3.0), (1, 3.0)]
        assert (time.monotonic() - start) / 20 < 0.25  # a call costs what the function costs
        assert pool.run(_destroy_the_group) == ["done", "done"]
        assert pool.run(_allreduce_rank) == [(0, 3.0), (1, 3.0)]  # a new pool took over


def test_a_pool_names_the_failing_rank_and_starts_afresh_for_the_next_call():
    import pytest

    from functitan.testing import WorkerPool

    with WorkerPool(2) as pool:
        pids = {r[0][6] for r in pool.run(_dirty)}
        with pytest.raises(RuntimeError, match="(?s)rank 1.*boom on purpose"):
            pool.run(_fail_on_one, timeout=60)
        with pytest.raises(RuntimeError, match="(?s)rank 1:.*exit code 3"):
            pool.run(_exit_on_one_in_a_collective, timeout=60)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out after 1.0s"):
            pool.run(time.sleep, 30, timeout=1.0)
        assert time.monotonic() - start < 10
        again = pool.run(_dirty)
        assert {r[0][6] for r in again}.isdisjoint(pids) and [r[1] for r in again] == [3.0, 3.0]


_OWNER = """
import sys, time
sys.path.insert(0, {tests!r})
from functitan.testing import WorkerPool
from test_testing import _dirty
pool = WorkerPool(2)
print(" ".join(str(r[0][6]) for r in pool.run(_dirty)), flush=True)
time.sleep(600)
"""


def test_pool_workers_exit_when_the_process_that_owns_them_is_killed(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-c", _OWNER.format(tests=os.path.dirname(__file__))]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as owner:
        try:
            pids = [int(p) for p in owner.stdout.readline().split()]
            assert len(pids) == 2
        finally:
            owner.kill()  # SIGKILL: no atexit, no finalizer runs in the owner
            owner.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") and "zombie" not in _state(p) for p in pids):
        assert time.monotonic() < deadline, f"pool workers {pids} outlived their owner"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return "zombie"


def _patch_the_trainer():
    import functitan.train as train

    found = train.make_train_step.__module__
    train.make_train_step = _patch_the_trainer  # a test's injection, not undone
    return found, os.getpid()


def test_a_pool_rank_whose_library_was_patched_is_replaced():
    from functitan.testing import WorkerPool

    with WorkerPool(1) as pool:
        (first, pid), *_ = pool.run(_patch_the_trainer)
        (second, other), *_ = pool.run(_patch_the_trainer)
    assert first == second == "functitan.step" and pid != other  # the next call found the library as installed


def _leave_idle_threads(n: int) -> int:
    """Leave ``n`` threads waiting forever (what a gloo group that outlives its call leaves) and report the pid."""
    import threading

    never = threading.Event()
    for _ in range(n):
        threading.Thread(target=never.wait, daemon=True).start()
    return os.getpid()


def test_a_pool_rank_whose_threads_grew_is_replaced():
    from functitan.testing import POOL_THREADS_GROWTH, WorkerPool

    with WorkerPool(1) as pool:
        a, *_ = pool.run(_leave_idle_threads, 2)  # a few: the same process serves on
        b, *_ = pool.run(_leave_idle_threads, POOL_THREADS_GROWTH)  # past the limit: it retires after this call
        c, *_ = pool.run(_leave_idle_threads, 0)
    assert a == b != c
