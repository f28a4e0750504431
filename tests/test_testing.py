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

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*exit code 3"):
        run_distributed(_exit_on_one, 2, timeout=300)
    assert time.monotonic() - start < 30  # not the 300 s timeout
    assert not multiprocessing.active_children()


def _exit_on_one_in_a_collective():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()  # gloo sees the peer gone and raises on rank 0: a consequence, not the cause
    return 0


def test_run_distributed_names_the_rank_that_died_when_another_fails_because_of_it():
    import multiprocessing

    import pytest

    with pytest.raises(RuntimeError, match="(?s)rank 1:.*exit code 3.*rank 0:"):
        run_distributed(_exit_on_one_in_a_collective, 2, timeout=300)
    assert not multiprocessing.active_children()


def _segfault_on_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return 0


def test_run_distributed_names_the_signal_and_the_traceback_of_a_killed_rank():
    import pytest

    with pytest.raises(RuntimeError, match="(?s)rank 1:.*signal SIGSEGV.*_segfault_on_one"):
        run_distributed(_segfault_on_one, 2, timeout=300)
