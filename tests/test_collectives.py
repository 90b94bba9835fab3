"""``lightning_moe.collectives`` on CPU (gloo): every functional collective comes back waited for (gloo corrupts the
heap with two in flight: ``tests/repro_gloo_two_in_flight.py``), with the right values and gradients."""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from _dist import run_distributed


def _worker(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from lightning_moe import collectives as C

    group = dist.group.WORLD
    problems = []
    x_TD = torch.full((3, 2), float(rank + 1), requires_grad=True)
    outs = {
        "all_gather": C.all_gather(x_TD.detach(), 0, group),
        "all_gather_autograd": C.all_gather_autograd(x_TD, 0, group),
        "reduce_scatter_autograd": C.reduce_scatter_autograd(x_TD.repeat(world_size, 1), "sum", 0, group),
        "all_to_all_single_autograd": C.all_to_all_single_autograd(x_TD[:2], [1] * world_size, [1] * world_size, group),
        "all_reduce": C.all_reduce(x_TD.detach(), "sum", group),
    }
    for name, out in outs.items():
        if isinstance(out, AsyncCollectiveTensor):
            problems.append(f"{name} came back in flight")
    ranks = torch.arange(1, world_size + 1, dtype=torch.float32)
    expect = {
        "all_gather": ranks.repeat_interleave(3)[:, None].expand(-1, 2),
        "all_gather_autograd": ranks.repeat_interleave(3)[:, None].expand(-1, 2),
        "reduce_scatter_autograd": torch.full((3, 2), ranks.sum().item()),
        "all_to_all_single_autograd": ranks[:, None].expand(-1, 2),
        "all_reduce": torch.full((3, 2), ranks.sum().item()),
    }
    for name, want in expect.items():
        if not torch.equal(outs[name], want):
            problems.append(f"{name}: {outs[name].tolist()} != {want.tolist()}")
    # gradients flow through the settled results: d/dx of sum(gather) summed over ranks is world_size per element
    (outs["all_gather_autograd"].sum() + outs["reduce_scatter_autograd"].sum()
     + outs["all_to_all_single_autograd"].sum()).backward()
    want_grad = torch.full((3, 2), float(world_size + world_size))
    want_grad[:2] += 1
    if not torch.equal(x_TD.grad, want_grad):
        problems.append(f"grad {x_TD.grad.tolist()} != {want_grad.tolist()}")
    return "; ".join(problems) or "ok"


def test_functional_collectives_come_back_settled_on_cpu_with_values_and_gradients():
    assert run_distributed(_worker, 2) == "ok"


def test_settle_leaves_plain_tensors_alone():
    from lightning_moe.collectives import settle

    t = torch.ones(2)
    assert settle(t) is t
