"""Reproduces the gloo heap corruption that ``lightning_moe.collectives`` works around (not a test: it crashes).

Two ranks loop over the allgather dispatcher's pattern: two functional all-gathers issued back to back (routing
metadata, then the rows), work on other tensors while both are in flight, then the backward (a reduce-scatter).
With ``--mode inflight`` a rank dies within seconds to a minute on torch 2.13.0 (CPU, 2 cores):
``malloc(): unaligned tcache chunk detected`` (SIGABRT) or a SIGSEGV, its peer then gets gloo's "Connection reset by
peer". ``--mode settled`` (what ``lightning_moe.collectives`` does on CPU: each collective waited for at issue) and
``--mode c10d`` (the same two gathers in flight through ``dist.all_gather_into_tensor(async_op=True)``) finish.

    python tests/repro_gloo_two_in_flight.py --mode inflight --iters 20000   # exits non-zero, a rank killed
    python tests/repro_gloo_two_in_flight.py --mode settled --iters 20000    # "ok"

Measured 2026-12-07 (torch 2.13.0+cpu, 2 cores, OMP_NUM_THREADS=1, 20000 iterations): ``inflight`` died in 3 of 3
runs, 7 to 50 s in; ``settled`` and ``c10d`` finished 3 of 3 runs each (about 50-60 s).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def _rank(rank: int, world: int, port: int, mode: str, iters: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    w_DD = torch.randn(64, 64)
    for i in range(iters):
        T = 30 + (i * 7) % 40  # the padded token count changes from call to call, as in the dispatcher
        meta_TM = torch.full((T, 4), float(1000 * rank + i))
        x_TD = torch.full((T, 64), float(rank + i), requires_grad=True)
        if mode == "c10d":
            meta_g, x_g = meta_TM.new_empty(world * T, 4), x_TD.detach().new_empty(world * T, 64)
            works = [dist.all_gather_into_tensor(meta_g, meta_TM, async_op=True),
                     dist.all_gather_into_tensor(x_g, x_TD.detach(), async_op=True)]
            other = (x_TD @ w_DD).relu().sum()
            for work in works:
                work.wait()
            y = x_g @ w_DD
            dist.reduce_scatter_tensor(torch.empty(T, 64), y.contiguous())
            other.backward()
        else:
            meta_g = _gather(meta_TM, 0, group)
            if mode == "settled":
                meta_g = meta_g.wait()
            x_g = _gather(x_TD, 0, group)
            if mode == "settled":
                x_g = x_g.wait()
            other = (x_TD @ w_DD).relu().sum()  # the shared experts' work while the gathers are in flight
            ((x_g @ w_DD).sum() + other).backward()
        assert meta_g[0, 0].item() == i and meta_g[T, 0].item() == 1000 + i, "wrong data gathered"
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("inflight", "settled", "c10d"), default="inflight")
    parser.add_argument("--iters", type=int, default=20000)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args.mode, args.iters)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    print("ok" if codes == [0, 0] else f"rank exit codes {codes}")
    sys.exit(0 if codes == [0, 0] else 1)


if __name__ == "__main__":
    main()
