import os

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


def _environ_and_print(rank, world_size, name):
    print(f"rank {rank} says hello")
    return os.environ.get(name), os.environ["RANK"], torch.get_num_threads()


def test_allreduce_two_ranks():
    assert run_distributed(_allreduce, 2) == 3.0


def test_failure_reported_and_the_next_call_runs():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail, 2, timeout=60)
    assert run_distributed(_allreduce, 4) == 10.0


def test_ranks_see_the_callers_environment_and_their_output_is_captured(monkeypatch, capsys):
    """The ranks are forked from a server started once: each call must still hand them the caller's os.environ of
    the moment. Ranks that return at once, without a collective, must not break a peer still connecting."""
    for value in ("first", "second"):
        monkeypatch.setenv("LIGHTNING_MOE_TEST_VALUE", value)
        assert run_distributed(_environ_and_print, 2, "LIGHTNING_MOE_TEST_VALUE") == (value, "0", 1)
    err = capsys.readouterr().err
    assert err.count("rank 0 says hello") == 2 and err.count("rank 1 says hello") == 2, err
