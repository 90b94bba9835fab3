"""Multi-rank test launcher: runs ``fn(rank, world_size, *args)`` on W gloo ranks in fresh processes.

Usage (a multi-rank test)::

    from _dist import run_distributed

    def _worker(rank, world_size, path):        # module level (picklable); runs on every rank
        ...                                      # the gloo process group is already initialised
        return result                            # rank 0's return value (picklable) comes back

    def test_something(tmp_path):
        assert run_distributed(_worker, 2, str(tmp_path)) == expected   # raises with every failing rank's traceback

Ranks are started with torch.multiprocessing (not Lightning's launcher, which re-executes sys.argv and would
re-run pytest). Process groups get a short timeout so a deadlock fails within a minute; ``timeout`` bounds the whole
call. Every call gets fresh rank processes (no state carries from one test to the next), forked from a
"forkserver" process that imported torch, lightning and lightning_moe (and what ranks import lazily, ``WARM``) once
for the whole session: importing them takes 6-13 s a process on a 2-core machine, forking a warm process well under
one. Each rank gets the caller's os.environ at the time of the call (the server's own was fixed when it started),
then the rank variables.
Tests that use this launcher are marked ``dist`` (tests/conftest.py).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT = datetime.timedelta(seconds=60)
# imported once by the fork server; every rank is forked from it. (transformers: test_hf's workers need it.)
PRELOAD = ("torch", "lightning", "lightning_moe", "transformers")
# also imported by the fork server (not checked, an ImportError is ignored): what a rank's first Trainer run or
# checkpoint imports lazily, 1-2 s of every fresh rank process otherwise
WARM = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
        "torch.distributed.elastic.multiprocessing.errors", "lightning_moe.data", "lightning_moe.parallel.context_parallel")

_ctx = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(list(PRELOAD + WARM))
    return _ctx


def _module_files() -> dict[str, str]:
    """Where this process's preloaded packages come from (those it has imported)."""
    return {name: getattr(sys.modules[name], "__file__", None) for name in PRELOAD if name in sys.modules}


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, environ: dict,
            parent_files: dict, log: str) -> None:
    # the server's stdout and stderr are those of the test that started it: write to this call's log instead
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    # a rank killed by a signal (a segfault in a backend thread) leaves its threads' Python stacks in its log
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        # the server imported the packages before this process's sys.path was set: they must be the caller's
        mine = _module_files()
        wrong = {k: (v, mine[k]) for k, v in parent_files.items() if k in mine and mine[k] != v}
        if wrong:
            raise RuntimeError(f"the fork server imported other copies than the test process (test, server): {wrong}")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
        # gloo's connect can still be in progress on a peer when init returns here; a rank whose fn returns at once
        # and exits would then break the peer's init ("Connection closed by peer")
        dist.barrier()
        out = fn(rank, world_size, *args)
        # plain pickle bytes: torch's queue pickler would share tensors by file descriptor, gone once we exit
        queue.put((rank, "ok", pickle.dumps(out) if rank == 0 else None))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> Any:
    """Run ``fn`` on ``world_size`` gloo ranks; raise with every failing rank's traceback; return rank 0's result."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = _free_port()
    environ, files = dict(os.environ), _module_files()
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as logs:
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, environ, files,
                                                   f"{logs}/rank{r}.log")) for r in range(world_size)]
        try:
            return _collect(procs, queue, world_size, timeout)
        finally:  # the ranks' output goes to the test's captured output (shown when it fails)
            for r in range(world_size):
                if os.path.exists(f"{logs}/rank{r}.log"):
                    with open(f"{logs}/rank{r}.log", errors="replace") as f:
                        text = f.read()
                    if text:
                        sys.stderr.write(f"---- rank {r} output ----\n{text}")


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _collect(procs: list, queue: Any, world_size: int, timeout: float) -> Any:
    for p in procs:
        p.start()
    # read results while the ranks run: a rank blocks on a large result until the pipe is drained
    deadline = time.monotonic() + timeout
    results = []
    while len(results) < world_size and time.monotonic() < deadline:
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        results.append(queue.get())
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = [f"rank {r}:\n{msg}" for r, status, msg in results if status == "error"]
    # a rank that died by a signal before reporting is the cause of its peers' errors (connection reset): name it
    # first (a crash after every rank reported, in the backend's teardown, fails nothing)
    reported = {r for r, _, _ in results}
    killed = [f"rank {r} died by {_signal_name(p.exitcode)} before reporting (its threads' stacks: its output below)"
              for r, p in enumerate(procs) if r not in reported and p.exitcode is not None and p.exitcode < 0]
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(killed + errors))
    if alive or len(results) != world_size:
        raise AssertionError(f"distributed test hung or crashed: {len(results)}/{world_size} ranks reported"
                             + "".join(f"; {k}" for k in killed))
    return pickle.loads(next(out for r, status, out in results if r == 0))
