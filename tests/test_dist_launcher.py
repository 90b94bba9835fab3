import os
import signal

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


def _segfault_rank_1(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # what a crash in a backend thread looks like from outside
    dist.all_reduce(torch.ones(1))  # rank 0 waits for the dead peer: its error is the consequence, not the cause


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


def test_a_rank_killed_by_a_signal_is_named_with_its_stacks(capsys):
    """A rank that segfaults reports nothing itself: the failure must name it and its signal (not only the peer's
    "connection reset"), and its log must hold the Python stacks of its threads at the crash."""
    with pytest.raises(AssertionError, match="rank 1 died by SIGSEGV before reporting") as err:
        run_distributed(_segfault_rank_1, 2, timeout=90)
    assert "rank 0" in str(err.value)  # the peer's own error is still there, after the cause
    out = capsys.readouterr().err
    assert "Fatal Python error: Segmentation fault" in out and "_segfault_rank_1" in out, out
