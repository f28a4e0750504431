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
