#!/usr/bin/env python
"""DeepEP dispatcher (``dispatcher="deepep"``, issue 14) on 2 GPUs: correctness against the all-to-all dispatcher,
and the time of dispatch + combine and of the MoE layer, ep = 2.

Builds nothing: ``deep_ep`` must be installed (docs/deepep.md). Run from the repository root:

    torchrun --nproc_per_node 2 -m bench deepep_check --out bench/results/deepep_check.json
    torchrun --nproc_per_node 2 -m bench deepep_check --cpu --small    # CPU smoke of this script: gloo, fp32, the
                                                                       # tests' pure-torch Buffer stand-in, no DeepEP

Per shape (bench/moe_layer.py's: ``qwen3`` = Qwen3-30B-A3B's MoE layer, 16384 tokens a GPU; ``deepseek_v3``, 8192
tokens a GPU, with its shared expert) and routing (``learned``: the router as initialised; ``forced``:
``MoEConfig.force_balance``, round-robin), one bf16 layer whose experts are split over the 2 ranks
(``Shard(0)``, as ``apply_ep`` does), the same weights on both ranks, each rank its own tokens; its ``dispatcher``
attribute is swapped between ``AllToAllDispatcher`` and ``DeepEPDispatcher`` (nothing else changes):

* check: one forward + backward with each; the DeepEP run's output, input gradient, router gradient and local
  expert-weight gradients against the all-to-all run's, as max |diff| / max |reference|. Tolerance (bf16): 2**-7
  for the output and input gradient (DeepEP sums each rank's local assignments first, rounds that partial sum to
  bf16, then sums the ranks: one extra bf16 rounding), 2**-8 for the weight gradients (the same rows reach the
  experts in the same order, so these should agree to the last bit). CPU smoke: 1e-4.
* timing (CUDA events, median of ``--iters`` after ``--warmup``; the slower rank's median): ``comm``: the
  dispatcher alone, ``dispatch`` then ``combine`` of the dispatched rows (forward, and forward + backward), on the
  layer's routing of the input; ``layer``: the layer's forward + backward. The table shows DeepEP / all-to-all.

JSON (``--out``, rank 0): args, environment, per shape and routing the check's numbers and every timing.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/deepep_check.py ...` runs `python -m bench deepep_check ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from bench.core.env import environment
from bench.core.schema import save as save_result
from bench.core.text import err as _err, log
from bench.core.timer import time_steps
from bench.moe_layer import SMALL_TOKENS, SHAPES, build_ours, fwd_bwd_step, model_config

TESTS = Path(__file__).resolve().parent.parent / "tests"

SHAPE_NAMES = ("qwen3", "deepseek_v3")
TOL_Y = 2.0**-7  # output and input gradient (one extra bf16 rounding of per-rank partial sums)
TOL_W = 2.0**-8  # weight gradients (expected bitwise equal)
TOL_CPU = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPE_NAMES), help=f"comma list of {', '.join(SHAPE_NAMES)}")
    p.add_argument("--routing", default="learned,forced", help="comma list of learned, forced")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--num-sms", type=int, default=None, help="Buffer.set_num_sms (DeepEP's default: 20)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU with the tests' pure-torch Buffer (smoke test)")
    p.add_argument("--small", action="store_true", help="toy shapes (bench/moe_layer.py's --small)")
    p.add_argument("--out", default=None, help="JSON path (rank 0)")
    return p.parse_args(argv)


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref32 = ref.detach().float()
    return float((got.detach().float() - ref32).abs().max()) / max(float(ref32.abs().max()), 1e-30)


def slowest(ms: float, device: torch.device) -> float:
    """The largest of the ranks' medians (the step waits for the slower rank)."""
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _tests_fake_buffer() -> Any:
    """``FakeBuffer`` of tests/test_deepep_dispatcher.py (a pure-torch DeepEP Buffer), loaded from its file with the
    tests' own helper modules it imports (``_dist``, ``_lane``)."""
    for name in ("_dist", "_lane", "test_deepep_dispatcher"):
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
    return sys.modules["test_deepep_dispatcher"].FakeBuffer


def make_dispatchers(args: argparse.Namespace, group: dist.ProcessGroup) -> dict[str, Any]:
    from lightning_moe.moe.dispatch import AllToAllDispatcher, DeepEPDispatcher

    if args.cpu:
        deepep = DeepEPDispatcher(group, buffer=_tests_fake_buffer()(group))  # the tests' stand-in: no DeepEP on CPU
    else:
        deepep = DeepEPDispatcher(group, num_sms=args.num_sms)
    return {"alltoall": AllToAllDispatcher(group), "deepep": deepep}


def run_once(layer: Any, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    layer.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    out = {"y": y.detach(), "dx": xg.grad}
    for n, p in layer.named_parameters():
        if p.grad is not None:
            out["d" + n] = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    return out


def comm_steps(disp: Any, layer: Any, x_TD: torch.Tensor, dy_TD: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """dispatch -> combine of the dispatched rows (the experts left out), forward only and forward + backward."""
    with torch.no_grad():
        routing = layer.router(x_TD, None, seq_len=x_TD.shape[0])  # as the layer routes [1, T, D]
    probs = routing.probs.detach()
    E = layer.num_experts

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            rows, _, ctx = disp.dispatch(x_TD, dataclasses.replace(routing, probs=probs), E)
            return disp.combine(rows, ctx)

    xg = x_TD.detach().clone().requires_grad_()
    pg = probs.clone().requires_grad_()

    def fwd_bwd() -> torch.Tensor:
        xg.grad = pg.grad = None
        rows, _, ctx = disp.dispatch(xg, dataclasses.replace(routing, probs=pg), E)
        y = disp.combine(rows, ctx)
        y.backward(dy_TD)
        return y

    return {"comm_fwd": fwd, "comm_fwd_bwd": fwd_bwd}


def run_shape(name: str, routing_kind: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
              mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    from lightning_moe.parallel.parallelize import _shard_param

    cfg = model_config(name, args.small)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, force_balance=routing_kind == "forced"))
    T = SMALL_TOKENS if args.small else SHAPES[name]["tokens"]
    layer = build_ours(cfg, device, dtype, seed=0)  # the same global weights on every rank
    for w in ("w1", "w3", "w2"):
        _shard_param(layer.experts, w, mesh, [Shard(0)])
    rank = dist.get_rank()
    g = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, generator=g)
    dy = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, generator=g)
    res: dict[str, Any] = {"shape": name, "routing": routing_kind, "tokens_per_rank": T, "hidden": cfg.hidden_size,
                           "experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
                           "expert_hidden": cfg.moe.expert_hidden_size, "ep": dist.get_world_size(), "runs": {}}
    dispatchers = make_dispatchers(args, mesh.get_group())
    outs = {}
    for kind, disp in dispatchers.items():
        layer.replan(dispatcher=disp)
        outs[kind] = run_once(layer, x, dy)
    ref, got = outs["alltoall"], outs["deepep"]
    diffs = {k: rel_diff(got[k], ref[k]) for k in ref}
    tol = {k: (TOL_CPU if args.cpu else (TOL_Y if k in ("y", "dx") else TOL_W)) for k in ref}
    ok_local = all(diffs[k] <= tol[k] for k in ref) and set(ref) == set(got)
    ok = torch.tensor([int(ok_local)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    res["check"] = {"rel_max_abs_diff": diffs, "tolerance": tol, "ok_this_rank": ok_local, "ok": bool(ok.item())}
    del outs, ref, got
    x_TD, dy_TD = x.reshape(T, -1), dy.reshape(T, -1)
    for kind, disp in dispatchers.items():
        layer.replan(dispatcher=disp)
        steps = comm_steps(disp, layer, x_TD, dy_TD)
        steps["layer_fwd_bwd"] = fwd_bwd_step(layer, x.detach().clone().requires_grad_(), dy)
        for step_name, fn in steps.items():
            t = time_steps(fn, device, args.warmup, args.iters)
            res["runs"].setdefault(kind, {})[step_name] = {"ms": slowest(t["ms"], device), "ms_this_rank": t["ms"],
                                                          "peak_gib": t["peak_gib"]}
    del layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def table(results: list[dict[str, Any]]) -> str:
    cols = ("comm_fwd", "comm_fwd_bwd", "layer_fwd_bwd")
    lines = [f"{'shape':<12} {'routing':<8} {'check':<6} " + " ".join(f"{c + ' a2a/deepep ms (x)':>34}" for c in cols)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['shape']:<12} {r['routing']:<8} ERROR  {r['error']}")
            continue
        cells = []
        for c in cols:
            a, d = r["runs"]["alltoall"][c]["ms"], r["runs"]["deepep"][c]["ms"]
            cells.append(f"{a:>12.3f} / {d:>9.3f} ({d / a:5.2f}x)")
        ok = "ok" if r["check"]["ok"] else "FAIL"
        lines.append(f"{r['shape']:<12} {r['routing']:<8} {ok:<6} " + " ".join(f"{c:>34}" for c in cells))
        diffs, tol = r["check"]["rel_max_abs_diff"], r["check"]["tolerance"]
        worst = max(diffs, key=lambda k: diffs[k] / tol[k])
        lines.append(f"{'':<28} worst diff {worst}: {diffs[worst]:.2e} (tolerance {tol[worst]:.1e})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    else:
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        from lightning_moe.moe.dispatch.deepep import import_deep_ep

        import_deep_ep()  # fail early, naming the build recipe, when deep_ep is missing or broken
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world != 2:
        log(f"run under torchrun --nproc_per_node 2 (got a world of {world})")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    report: dict[str, Any] = {"args": vars(args), "env": environment(device), "results": []}
    if dist.get_rank() == 0:
        log(json.dumps(report["env"]))
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        for routing_kind in [r.strip() for r in args.routing.split(",") if r.strip()]:
            try:
                res = run_shape(name, routing_kind, args, device, dtype, mesh)
            except Exception as e:  # noqa: BLE001 - report, don't crash: the other shapes still run
                res = {"shape": name, "routing": routing_kind, "error": _err(e), "traceback": traceback.format_exc()}
                log(res["traceback"])
            report["results"].append(res)
            if dist.get_rank() == 0:
                log(table([res]))
    ok = all(r.get("check", {}).get("ok", False) for r in report["results"])
    if dist.get_rank() == 0:
        print(table(report["results"]), flush=True)
        print(f"deepep vs alltoall: {'OK' if ok else 'FAIL'}", flush=True)
        if args.out:
            save_result(args.out, report, "deepep_check")
    dist.destroy_process_group()
    return 0 if ok else 1
