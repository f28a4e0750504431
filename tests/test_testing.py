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
