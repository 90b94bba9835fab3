#!/usr/bin/env python
"""Fused MoE kernels (lightning_moe.moe.kernels) against the PyTorch reference path: correctness and speed.

For each shape (Qwen3-30B-A3B: T 16384, k 8, D 2048, F 768, E 128; DeepSeek-V3: T 8192, k 8, D 7168, F 2048,
E 256), bf16 activations, fp32 combine weights, routing = random top-k of softmax scores:

* combine (``_UnpermuteRows``: forward, and backward to y and the weights), permute (``_PermuteRows``: the gather,
  and its backward k-sum), SwiGLU on the [R, F] grouped-GEMM output (forward, backward to g and u). Each runs under
  ``LIGHTNING_MOE_KERNELS=torch`` and ``=triton``; both are compared with an fp32 computation on the same bf16
  inputs (max abs error relative to the largest reference value). "ok" = the kernel is within
  max(1.05 x the torch path's error, 2**-8) (bf16 rounding: 2**-8 relative; the kernel rounds once; 2**-7 under
  the CPU interpreter, which rounds fp32 -> bf16 towards zero).
* timings: CUDA events, median of ``--iters`` after ``--warmup`` calls, forward and backward separately.
* the MoELayer forward+backward at the Qwen3 shape (learned routing as initialised), kernels off vs on (outputs and
  gradients compared), and the bare grouped GEMMs of the same routed rows (3 forward, 6 backward GEMMs) for the
  ratio the performance issue tracks.

Run (repository root):
    python -m bench kernels_check                          # one GPU, well under 2 minutes
    python -m bench kernels_check --device cpu --small     # smoke test (Triton's interpreter, seconds)
    python -m bench kernels_check --fp8-fused --shapes qwen3 --no-layer   # + FP8 fused vs unfused (needs torchao)
Options: --json PATH writes the rows; --shapes qwen3,deepseek; --no-layer; --fp8-fused.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/kernels_check.py ...` runs `python -m bench kernels_check ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import contextlib
import os
import sys
import statistics
import time
import traceback
from typing import Optional


def _args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--shapes", default="qwen3,deepseek")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-layer", action="store_true")
    p.add_argument("--fp8-fused", action="store_true",
                   help="also the FP8 rowwise layer, quantization fused (lightning_moe.lowp.fp8_fused) vs unfused")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


ARGS: argparse.Namespace  # set by main()

# The Triton interpreter is chosen when triton is first imported, which importing lightning_moe may do: read
# --device from the command line before that (main() sets it too, for a call in a process that has not imported it).
if any(a in ("--device=cpu",) for a in sys.argv) or any(
        a == "--device" and b == "cpu" for a, b in zip(sys.argv, sys.argv[1:])):
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

from bench.core.env import environment
from bench.core.schema import save as save_result

from lightning_moe.config import MoEConfig  # noqa: E402
from lightning_moe.moe import kernels  # noqa: E402
from lightning_moe.moe.dispatch import LocalDispatcher  # noqa: E402
from lightning_moe.moe.dispatch.rows import _PermuteRows, _UnpermuteRows  # noqa: E402
from lightning_moe.moe.experts import _GatherGateUp  # noqa: E402
from lightning_moe.moe.record import MoERecorder  # noqa: E402
from lightning_moe.moe.router_gemm import router_logits  # noqa: E402
from lightning_moe.moe.layer import MoELayer  # noqa: E402
from lightning_moe.moe.router import RoutingResult  # noqa: E402

# name: (T, k, D, F, E)
SHAPES = {
    "qwen3": (16384, 8, 2048, 768, 128),
    "deepseek": (8192, 8, 7168, 2048, 256),
}
SMALL = {
    "qwen3": (48, 4, 72, 40, 8),
    "deepseek": (20, 3, 136, 24, 6),
}


@contextlib.contextmanager
def backend(name: str):
    old = os.environ.get(kernels.ENV_VAR)
    os.environ[kernels.ENV_VAR] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(kernels.ENV_VAR, None)
        else:
            os.environ[kernels.ENV_VAR] = old


def timed(fn, dev: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ARGS.iters calls after ARGS.warmup calls."""
    for _ in range(ARGS.warmup):
        fn()
    times = []
    for _ in range(ARGS.iters):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def routing_maps(T, k, E, dev):
    """pos_TK / asg_R / counts of a random top-k routing, from the local dispatcher itself."""
    logits = torch.randn(T, E, device=dev)
    probs, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    zero = torch.zeros((), device=dev)
    routing = RoutingResult(probs / probs.sum(-1, keepdim=True), ids, torch.zeros(E, dtype=torch.long, device=dev),
                            zero, zero)
    x = torch.zeros(T, 1, device=dev)
    _, counts, ctx = LocalDispatcher().dispatch(x, routing, E)
    return routing.probs, ctx.pos_TK, ctx.asg_R, counts


def check_op(rows, shape_name, op, run, inputs, dev):
    """run(*inputs) -> output; grads of every input from a random output gradient. Compares torch and triton with
    an fp32 run of the torch path, times forward and backward of both."""
    leaves = lambda dtype=None: [t.detach().clone().to(dtype if (dtype and t.is_floating_point()) else t.dtype)
                                 .requires_grad_(t.is_floating_point()) for t in inputs]
    with backend("torch"):
        ref_in = leaves(torch.float32)
        ref_out = run(*ref_in)
        g_out = torch.randn_like(ref_out).to(inputs[0].dtype)
        ref_grads = torch.autograd.grad(ref_out, [t for t in ref_in if t.requires_grad], g_out.float())
    res = {}
    for name in ("torch", "triton"):
        with backend(name):
            xs = leaves()
            diff = [t for t in xs if t.requires_grad]
            out = run(*xs)
            grads = torch.autograd.grad(out, diff, g_out, retain_graph=True)
            errs = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
            t_fwd = timed(lambda: run(*xs), dev)
            t_bwd = timed(lambda: torch.autograd.grad(out, diff, g_out, retain_graph=True), dev)
            res[name] = (errs, t_fwd, t_bwd)
            del out, grads
    labels = ["out"] + [f"grad{i}" for i in range(len(ref_grads))]
    # Triton's interpreter rounds fp32 -> bf16 towards zero (a GPU to nearest): one ulp allowed there
    floor = 2.0**-7 if dev.type == "cpu" else 2.0**-8
    for i, label in enumerate(labels):
        e_t, e_k = res["torch"][0][i], res["triton"][0][i]
        ok = e_k <= max(1.05 * e_t, floor)
        rows.append(dict(shape=shape_name, op=f"{op} {label}", err_torch=e_t, err_triton=e_k, ok=ok))
    for phase, j in (("fwd", 1), ("bwd", 2)):
        rows.append(dict(shape=shape_name, op=f"{op} {phase} time", torch_ms=res["torch"][j],
                         triton_ms=res["triton"][j]))


def check_shape(rows, name, dev):
    T, k, D, Fh, E = (SMALL if ARGS.small else SHAPES)[name]
    torch.manual_seed(0)
    probs, pos, asg, _ = routing_maps(T, k, E, dev)
    R = asg.shape[0]
    bf = torch.bfloat16
    flags = (bool((pos < 0).any()), bool((asg >= 0).all()))
    y = torch.randn(R, D, device=dev, dtype=bf)
    check_op(rows, name, "combine", lambda y_, p_: _UnpermuteRows.apply(y_, p_, pos, asg, *flags), [y, probs], dev)
    x = torch.randn(T, D, device=dev, dtype=bf)
    check_op(rows, name, "permute", lambda x_: _PermuteRows.apply(x_, asg, pos, *flags), [x], dev)
    del y, x
    g, u = (torch.randn(R, Fh, device=dev, dtype=bf) for _ in range(2))
    check_op(rows, name, "swiglu", kernels.swiglu, [g, u], dev)
    p_R = torch.rand(R, device=dev)
    check_op(rows, name, "swiglu x row weights", kernels.swiglu, [g, u, p_R], dev)
    del g, u, p_R
    # the router GEMM: fp32 F.linear (torch) vs the split-bf16 tensor-core GEMM (router_gemm, "triton" switch)
    x = torch.randn(T, D, device=dev, dtype=bf)
    w = torch.randn(E, D, device=dev) * 0.02
    check_op(rows, name, "router logits", router_logits, [x, w], dev)
    # ... and inside a compiled region (MoEParallelStrategy(compile=True) compiles the router)
    check_op(rows, name, "router logits compiled", torch.compile(lambda x_, w_: router_logits(x_, w_) * 1.0), [x, w],
             dev)
    # gate + up GEMMs on gathered rows: the dispatcher's gather + torch._grouped_mm autograd (torch) vs
    # _GatherGateUp (gathers again in backward, keeps no rows; its dx summed into tokens by one k-sum)
    e_loc = min(E, 64) if not ARGS.small else E  # the expert weights of all E experts would not matter more
    probs_s, pos_s, asg_s, counts_s = routing_maps(T, k, e_loc, dev)
    offs = torch.cumsum(counts_s, 0, dtype=torch.int32)
    w1, w3 = (torch.randn(e_loc, Fh, D, device=dev, dtype=bf) * 0.02 for _ in range(2))

    def gate_up(x_, w1_, w3_):
        if kernels.backend() == "torch":
            x_RD = _PermuteRows.apply(x_, asg_s, pos_s, False, True)
            g_, u_ = (torch._grouped_mm(x_RD, w_.transpose(-2, -1), offs=offs) for w_ in (w1_, w3_))
        else:
            g_, u_ = _GatherGateUp.apply(x_, asg_s, pos_s, w1_, w3_, offs)
        return torch.cat([g_, u_], 1)

    check_op(rows, name, "gather + gate/up GEMMs", gate_up, [x, w1, w3], dev)


def bare_grouped_gemm_ms(layer, x_RD, counts, dev) -> float:
    """The routed experts' GEMMs alone: gate and up (forward), down on the gate output, and their backward."""
    ex = layer.experts
    w1, w2, w3 = (w.detach().to(x_RD.dtype).requires_grad_() for w in (ex.w1, ex.w2, ex.w3))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = x_RD.detach().requires_grad_()

    def step():
        gg = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        uu = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        yy = torch._grouped_mm(gg, w2.transpose(-2, -1), offs=offs)
        torch.autograd.backward([yy, uu], [torch.ones_like(yy), torch.ones_like(uu)])
        x.grad = w1.grad = w2.grad = w3.grad = None

    return timed(step, dev)


def check_layer(rows, dev):
    T, k, D, Fh, E = (SMALL if ARGS.small else SHAPES)["qwen3"]
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(num_experts=E, top_k=k, expert_hidden_size=Fh, aux_loss_type="aux"), D).to(dev)
    layer.experts.to(torch.bfloat16)
    x = torch.randn(1, T, D, device=dev, dtype=torch.bfloat16)
    gy = torch.randn_like(x)
    res = {}
    for name in ("torch", "triton"):
        with backend(name):
            xi = x.detach().clone().requires_grad_()

            def step():
                layer.zero_grad(set_to_none=True)
                xi.grad = None
                recorder = MoERecorder()
                out = layer(xi, recorder=recorder)
                aux = recorder.records[0].aux_loss
                torch.autograd.backward([out, aux], [gy, torch.ones_like(aux)])
                return out

            out = step()
            res[name] = [out.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()]
            res[name + "_ms"] = timed(step, dev)
    labels = ["out", "grad x"] + [f"grad {n}" for n, _ in layer.named_parameters()]
    for label, a, b in zip(labels, res["triton"], res["torch"]):
        e = rel_err(a, b)
        rows.append(dict(shape="qwen3", op=f"layer {label} (triton vs torch)", err_triton=e, ok=e <= 2.0**-6))
    with torch.no_grad():
        routing = layer.router(x.view(T, D), None, seq_len=T)
        x_RD, counts, _ = LocalDispatcher().dispatch(x.view(T, D), routing, E)
    bare = bare_grouped_gemm_ms(layer, x_RD, counts, dev)
    rows.append(dict(shape="qwen3", op="layer fwd+bwd time", torch_ms=res["torch_ms"], triton_ms=res["triton_ms"],
                     bare_gemm_ms=bare))


def check_fp8_fused(rows, dev):
    """The MoE layer with FP8 rowwise experts (torchao + torch._scaled_grouped_mm on a GPU, emulated on CPU), with
    the quantization fused into the SwiGLU kernel and the row gather (lightning_moe.lowp.fp8_fused) vs the unfused
    path (each GEMM quantizes its bf16 input): outputs and gradients, and fwd+bwd time of both ("torch ms" column:
    unfused, "triton ms": fused; the bf16 layer's time beside them). Qwen3 shape; --small: 16-aligned toy dims."""
    from lightning_moe.callbacks.low_precision import LowPrecisionGroupedMM

    T, k, D, Fh, E = (48, 4, 64, 48, 8) if ARGS.small else SHAPES["qwen3"]
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(num_experts=E, top_k=k, expert_hidden_size=Fh), D).to(dev)
    layer.experts.to(torch.bfloat16)
    x = torch.randn(1, T, D, device=dev, dtype=torch.bfloat16)
    gy = torch.randn_like(x)
    emulate = dev.type != "cuda"
    res = {}
    with backend("triton"):
        for name, gmm in (("bf16", None), ("unfused", LowPrecisionGroupedMM("fp8_rowwise", emulate, fuse=False)),
                          ("fused", LowPrecisionGroupedMM("fp8_rowwise", emulate))):
            if gmm is not None:
                layer.replan(grouped_mm=gmm)
            xi = x.detach().clone().requires_grad_()

            def step():
                layer.zero_grad(set_to_none=True)
                xi.grad = None
                out = layer(xi)
                out.backward(gy)
                return out

            out = step()
            res[name] = [out.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()]
            res[name + "_ms"] = timed(step, dev)
            res[name + "_plan"] = (layer.plan.fp8_fused, layer.plan.regather_rows)
    labels = ["out", "grad x"] + [f"grad {n}" for n, _ in layer.named_parameters()]
    for label, a, b in zip(labels, res["fused"], res["unfused"]):
        e = rel_err(a, b)
        rows.append(dict(shape="qwen3", op=f"fp8 layer {label} (fused vs unfused)", err_triton=e, ok=e <= 2.0**-6))
    rows.append(dict(shape="qwen3", op="fp8 plan fp8_fused, regather_rows", err_triton=0.0,
                     ok=res["fused_plan"] == (True, True) and res["unfused_plan"] == (False, False)))
    rows.append(dict(shape="qwen3", op="fp8 layer fwd+bwd time", torch_ms=res["unfused_ms"],
                     triton_ms=res["fused_ms"], bf16_ms=res["bf16_ms"]))


def main(argv: Optional[list[str]] = None) -> int:
    global ARGS
    ARGS = _args(argv)
    if ARGS.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (lightning_moe imports it lazily)
    dev = torch.device(ARGS.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --small")
        return 2
    if not kernels.triton_available():
        print(f"triton does not import: {kernels._import_triton()[1]}")
        return 2
    rows: list[dict] = []
    failures = []
    t0 = time.perf_counter()
    for name in ARGS.shapes.split(","):
        try:
            check_shape(rows, name, dev)
        except Exception:  # report and go on
            failures.append(f"{name}: {traceback.format_exc()}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not ARGS.no_layer:
        try:
            check_layer(rows, dev)
        except Exception:
            failures.append(f"layer: {traceback.format_exc()}")
    if ARGS.fp8_fused:
        try:
            check_fp8_fused(rows, dev)
        except Exception:
            failures.append(f"fp8 fused: {traceback.format_exc()}")

    print(f"\n{'shape':9} {'check':44} {'err torch':>10} {'err triton':>10} {'ok':>3} {'torch ms':>9} "
          f"{'triton ms':>9} {'speedup':>7}")
    for r in rows:
        err_t = f"{r['err_torch']:.2e}" if "err_torch" in r else ""
        err_k = f"{r['err_triton']:.2e}" if "err_triton" in r else ""
        ok = ("yes" if r["ok"] else "NO") if "ok" in r else ""
        tt = f"{r['torch_ms']:.3f}" if "torch_ms" in r else ""
        tk = f"{r['triton_ms']:.3f}" if "triton_ms" in r else ""
        sp = f"{r['torch_ms'] / r['triton_ms']:.2f}x" if "torch_ms" in r and r["triton_ms"] > 0 else ""
        print(f"{r['shape']:9} {r['op']:44} {err_t:>10} {err_k:>10} {ok:>3} {tt:>9} {tk:>9} {sp:>7}")
        if "bare_gemm_ms" in r:
            b = r["bare_gemm_ms"]
            print(f"{'':9} bare grouped GEMMs {b:.3f} ms: layer/bare torch {r['torch_ms'] / b:.2f}x, "
                  f"triton {r['triton_ms'] / b:.2f}x")
        if "bf16_ms" in r:
            print(f"{'':9} bf16 layer {r['bf16_ms']:.3f} ms: bf16/unfused {r['bf16_ms'] / r['torch_ms']:.2f}x, "
                  f"bf16/fused {r['bf16_ms'] / r['triton_ms']:.2f}x")
    bad = [r for r in rows if r.get("ok") is False]
    print(f"\n{len(rows)} rows, {len(bad)} failed checks, {len(failures)} errors, {time.perf_counter() - t0:.1f} s on "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu (Triton interpreter)'}, torch "
          f"{torch.__version__}")
    for f in failures:
        print(f)
    if ARGS.json:
        save_result(ARGS.json, {"env": environment(dev), "args": vars(ARGS), "checks": rows, "errors": failures},
                    "kernels_check")
    return 1 if bad or failures else 0
