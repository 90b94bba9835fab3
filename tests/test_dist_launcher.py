import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")


def test_allreduce_two_ranks():
    assert run_distributed(_allreduce, 2) == 3.0


def test_failure_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail, 2, timeout=60)
