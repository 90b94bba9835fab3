"""Multi-rank test launcher: runs ``fn(rank, world_size, *args)`` on W gloo ranks in fresh processes.

Ranks are started with torch.multiprocessing (not Lightning's launcher, which re-executes sys.argv and would
re-run pytest). Process groups get a short timeout so a deadlock fails within a minute. ``fn`` must be a
module-level function (picklable); a return value of rank 0 is handed back.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT = datetime.timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
        out = fn(rank, world_size, *args)
        # plain pickle bytes: torch's queue pickler would share tensors by file descriptor, gone once we exit
        queue.put((rank, "ok", pickle.dumps(out) if rank == 0 else None))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> Any:
    """Run ``fn`` on ``world_size`` gloo ranks; raise with every failing rank's traceback; return rank 0's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
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
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    if alive or len(results) != world_size:
        raise AssertionError(f"distributed test hung or crashed: {len(results)}/{world_size} ranks reported")
    return pickle.loads(next(out for r, status, out in results if r == 0))
