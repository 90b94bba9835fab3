"""GPU check of the eager dense FP8 linear (lightning_moe/lowp/fp8_linear.py): correctness vs emulation, where the
time goes (each piece timed alone + a torch.profiler table), and speed vs bf16 / torchao eager at the presets' dense
shapes. Self-contained; every section catches its own failure. Usage (repository root, torchao on PYTHONPATH):

    python bench/results/fp8_dense_check_h200.py --time-limit 75    (wrote fp8_dense_check_h200.txt beside it, 2026-12-02)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from lightning_moe.lowp import fp8_casts as fc  # noqa: E402
from lightning_moe.lowp import fp8_linear as fl  # noqa: E402
from lightning_moe.lowp.fp8_fused import Fp8WeightCache  # noqa: E402
from lightning_moe.lowp.fp8_grouped import quantize_rowwise  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def bench(fn, reps=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def section(name, fn, *a):
    log(f"\n##### {name}")
    try:
        fn(*a)
    except Exception:  # one failure must not end the run
        log(f"FAILED: {name}\n{traceback.format_exc()}")


def data(M, K, N, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, dtype=BF16, generator=g)
    w = torch.randn(N, K, device=DEV, dtype=BF16, generator=g) * K**-0.5
    dy = torch.randn(M, N, device=DEV, dtype=BF16, generator=g)
    return x, w, dy


def correctness():
    M, K, N = 4096, 2048, 4096
    x, w, dy = data(M, K, N)
    log(f"{'check':48s} {'rel err':>9s} {'tol':>7s}  ok")
    for recipe in fl.LINEAR_RECIPES:
        outs = {}
        for emulate in (False, True):
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fl.fp8_linear(xl, wl, recipe=recipe, emulate=emulate)
            y.backward(dy)
            outs[emulate] = (y.detach(), xl.grad, wl.grad)
        for name, a, b in zip(("y", "dx", "dw"), outs[False], outs[True]):
            e = rel(a, b)
            log(f"{recipe + ' ' + name + ' kernels vs emulation':48s} {e:9.2e} {1e-2:7.0e}  {'yes' if e < 1e-2 else 'NO'}")
        e = rel(outs[False][0], x.float() @ w.float().t())
        log(f"{recipe + ' y vs fp32 product (FP8 noise)':48s} {e:9.2e} {'':>7s}  {'yes' if 1e-3 < e < 0.2 else 'NO'}")
    wn = (1 + 0.1 * torch.randn(K, device=DEV)).to(BF16)
    cache = fl.Fp8InputCache(consumers=1)
    y = fl.fp8_rms_norm(x, wn, 1e-6, emulate=False, input_cache=cache)
    e = rel(y, fl._rms_norm(x, wn, 1e-6))
    log(f"{'rms_norm_quant y vs F.rms_norm':48s} {e:9.2e} {8e-3:7.0e}  {'yes' if e <= 8e-3 else 'NO'}")
    q, s = cache.read(y, "rowwise")
    qr, sr = quantize_rowwise(y)
    same = torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s.flatten(), sr)
    log(f"{'rms_norm_quant FP8 bytes == quantize(y)':48s} {'':>9s} {'':>7s}  {'yes' if same else 'NO'}")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    ref = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(),
                                      scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=0,
                                      round_scales_to_power_of_2=True)
    ref_r = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(),
                                        scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1,
                                        round_scales_to_power_of_2=True)
    qr_, sr_ = fc.cast_rowwise(x)
    ok = torch.equal(qr_.view(torch.uint8), ref_r._data.view(torch.uint8)) and \
        torch.equal(sr_, ref_r._scale.reciprocal().flatten())
    log(f"{'cast_rowwise bytes == torchao axiswise dim -1':48s} {'':>9s} {'':>7s}  {'yes' if ok else 'NO'}")
    ok = torch.equal(fc.transpose_fp8(qr_).view(torch.uint8), qr_.t().contiguous().view(torch.uint8))
    log(f"{'transpose_fp8 == .t().contiguous()':48s} {'':>9s} {'':>7s}  {'yes' if ok else 'NO'}")
    qc, sc = fc.cast_colwise(x)
    ok = torch.equal(qc.view(torch.uint8), ref._data.view(torch.uint8)) and \
        torch.equal(sc, ref._scale.reciprocal().flatten()) and qc.t().is_contiguous()
    log(f"{'cast_colwise bytes == torchao axiswise dim 0':48s} {'':>9s} {'':>7s}  {'yes' if ok else 'NO'}")
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig

        ref = hp_tensor_to_float8_dynamic(x, dt, LinearMMConfig())
        qq, qt, sinv = fc.cast_tensorwise(x, dt, rows=True, cols=True)
        ok = torch.equal(qq.view(torch.uint8), ref._data.view(torch.uint8)) and \
            torch.equal(qt.view(torch.uint8), ref._data.view(torch.uint8)) and torch.equal(sinv, ref._scale.reciprocal())
        log(f"{'cast_tensorwise ' + str(dt)[6:] + ' bytes == torchao':48s} {'':>9s} {'':>7s}  {'yes' if ok else 'NO'}")


def torchao_linear(w, recipe):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=DEV, dtype=BF16))
    with torch.no_grad():
        lin[0].weight.copy_(w)
    convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(recipe))
    return lin


def variants(x, w):
    """name -> (callable x -> y, params)."""
    wp = torch.nn.Parameter(w.clone())
    caches = {r: Fp8WeightCache() for r in fl.LINEAR_RECIPES}
    out = {"bf16": (lambda x: F.linear(x, wp), (wp,))}
    for r in fl.LINEAR_RECIPES:
        out[f"ours {r}"] = (lambda x, r=r: fl.fp8_linear(x, wp, recipe=r, emulate=False, weight_cache=caches[r]),
                            (wp,))
    for r in fl.LINEAR_RECIPES:
        try:
            lin = torchao_linear(w, r)
            out[f"torchao {r}"] = (lin, tuple(lin.parameters()))
        except Exception as e:
            log(f"torchao {r}: {e}")
    return out


def step(fn, params, x, dy):
    xl = x.requires_grad_()
    return lambda: torch.autograd.grad(fn(xl), (xl, *params), dy)


def pieces(M, K, N):
    """Each piece of ours rowwise / tensorwise alone (ms), to see where time goes."""
    from torchao.prototype.moe_training.kernels import (triton_fp8_per_group_colwise_scales_dual,
                                                         triton_fp8_rowwise_2d_scale_and_cast)

    x, w, dy = data(M, K, N)
    E4 = torch.float8_e4m3fn
    offs = torch.tensor([M], device=DEV, dtype=torch.int32)
    xq, xs = triton_fp8_rowwise_2d_scale_and_cast(x, output_dtype=E4, round_scales_to_power_of_2=True)
    wq, ws = triton_fp8_rowwise_2d_scale_and_cast(w, output_dtype=E4, round_scales_to_power_of_2=True)
    wtq, wts = triton_fp8_rowwise_2d_scale_and_cast(w.t().contiguous(), output_dtype=E4, round_scales_to_power_of_2=True)
    dq, ds = triton_fp8_rowwise_2d_scale_and_cast(dy, output_dtype=E4, round_scales_to_power_of_2=True)
    dcq, dcs, xcq, xcs = triton_fp8_per_group_colwise_scales_dual(dy, x, offs, E4, round_scales_to_power_of_2=True)
    one = torch.ones((), device=DEV)
    xt, _, st = fc.cast_tensorwise(x, E4)
    wt, _, swt = fc.cast_tensorwise(w, E4)
    rows = {
        "bf16 fwd GEMM": lambda: F.linear(x, w),
        "bf16 dgrad GEMM": lambda: dy @ w,
        "bf16 wgrad GEMM": lambda: dy.t() @ x,
        "rowwise quant x (torchao 2d kernel)": lambda: triton_fp8_rowwise_2d_scale_and_cast(
            x, output_dtype=E4, round_scales_to_power_of_2=True),
        "rowwise quant dy": lambda: triton_fp8_rowwise_2d_scale_and_cast(dy, output_dtype=E4,
                                                                         round_scales_to_power_of_2=True),
        "colwise dual dy + x (wgrad operands)": lambda: triton_fp8_per_group_colwise_scales_dual(
            dy, x, offs, E4, round_scales_to_power_of_2=True),
        "colwise ours dy + x (cast_colwise x2)": lambda: (fc.cast_colwise(dy), fc.cast_colwise(x)),
        "rowwise quant x (ours)": lambda: fc.cast_rowwise(x),
        "rowwise quant dy (ours)": lambda: fc.cast_rowwise(dy),
        "colwise w (ours, the dgrad operand)": lambda: fc.cast_colwise(w),
        "transpose fp8 x (ours)": lambda: fc.transpose_fp8(xq),
        "transpose fp8 x (torch .t().contiguous())": lambda: xq.t().contiguous(),
        "rowwise fwd _scaled_mm (fast accum)": lambda: torch._scaled_mm(
            xq, wq.t(), xs.reciprocal(), ws.reciprocal().reshape(1, -1), out_dtype=BF16, use_fast_accum=True),
        "rowwise dgrad _scaled_mm": lambda: torch._scaled_mm(
            dq, wtq.t(), ds.reciprocal(), wts.reciprocal().reshape(1, -1), out_dtype=BF16),
        "rowwise dgrad _scaled_mm (fast accum)": lambda: torch._scaled_mm(
            dq, wtq.t(), ds.reciprocal(), wts.reciprocal().reshape(1, -1), out_dtype=BF16, use_fast_accum=True),
        "rowwise wgrad _scaled_mm": lambda: torch._scaled_mm(
            dcq.t(), xcq, dcs.reciprocal().reshape(-1, 1), xcs.reciprocal().reshape(1, -1), out_dtype=BF16),
        "rowwise wgrad _scaled_mm (fast accum)": lambda: torch._scaled_mm(
            dcq.t(), xcq, dcs.reciprocal().reshape(-1, 1), xcs.reciprocal().reshape(1, -1), out_dtype=BF16,
            use_fast_accum=True),
        "tensorwise amax x (vector_norm inf)": lambda: torch.linalg.vector_norm(x, float("inf")),
        "tensorwise cast x (ours, rows)": lambda: fc.cast_tensorwise(x, E4),
        "tensorwise cast dy (ours, rows + cols)": lambda: fc.cast_tensorwise(dy, torch.float8_e5m2, cols=True),
        "tensorwise fwd _scaled_mm (fast accum)": lambda: torch._scaled_mm(xt, wt.t(), st, swt, out_dtype=BF16,
                                                                           use_fast_accum=True),
        "tensorwise fwd _scaled_mm": lambda: torch._scaled_mm(xt, wt.t(), st, swt, out_dtype=BF16),
        "scaled_mm tensorwise scale 1 (bare FP8 GEMM)": lambda: torch._scaled_mm(xt, wt.t(), one, one,
                                                                                out_dtype=BF16, use_fast_accum=True),
    }
    log(f"M={M} K={K} N={N}")
    for name, fn in rows.items():
        try:
            log(f"  {name:46s} {bench(fn):8.3f} ms")
        except Exception as e:
            log(f"  {name:46s} FAILED {type(e).__name__}: {str(e)[:150]}")


def profile(M, K, N):
    x, w, dy = data(M, K, N)
    for name, (fn, params) in variants(x, w).items():
        if not name.startswith("ours"):
            continue
        run = step(fn, params, x.clone(), dy)
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        log(f"--- {name}, M={M} K={K} N={N}, 5 steps (fwd + bwd)")
        log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


SHAPES = [  # (N, K, what)
    (4096, 2048, "qwen3 wq"), (512, 2048, "qwen3 wk/wv"), (2048, 4096, "qwen3 wo"),
    (1536, 7168, "dsv3 wq_a"), (24576, 1536, "dsv3 wq_b"), (576, 7168, "dsv3 wkv_a"), (32768, 512, "dsv3 wkv_b"),
    (7168, 16384, "dsv3 wo"), (18432, 7168, "dsv3 mlp w1/w3"), (7168, 18432, "dsv3 mlp w2"),
    (2048, 7168, "dsv3 shared w1/w3"), (7168, 2048, "dsv3 shared w2"),
]


def speed(ms, deadline):
    names = ["ours rowwise", "ours tensorwise", "torchao rowwise", "torchao tensorwise"]
    log("bf16_ms / fp8_ms (forward + dx + dw), CUDA events, median of 20 after 5 warm-up")
    log(f"{'shape':22s} {'N':>6s} {'K':>6s} {'M':>6s} {'bf16 ms':>8s} " + " ".join(f"{n:>18s}" for n in names))
    for M in ms:
        for N, K, what in SHAPES:
            if time.time() > deadline:
                log("(time limit: remaining shapes skipped)")
                return
            try:
                x, w, dy = data(M, K, N)
                vs = variants(x, w)
                t = {n: bench(step(fn, p, x.clone(), dy)) for n, (fn, p) in vs.items()}
                cells = " ".join(f"{t['bf16'] / t[n]:17.2f}x" if n in t else f"{'-':>18s}" for n in names)
                log(f"{what:22s} {N:6d} {K:6d} {M:6d} {t['bf16']:8.3f} {cells}")
                del x, w, dy, vs
            except Exception as e:
                log(f"{what:22s} {N:6d} {K:6d} {M:6d} FAILED {type(e).__name__}: {str(e)[:200]}")


def qkv(M):
    """Qwen3 attention input side: RMSNorm + wq / wk / wv sharing the input, bf16 vs ours rowwise (the norm
    quantizing for the three) vs ours rowwise with each projection quantizing."""
    D = 2048
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(M, D, device=DEV, dtype=BF16, generator=g)
    wn = torch.nn.Parameter(torch.ones(D, device=DEV, dtype=BF16))
    ws = [torch.nn.Parameter(torch.randn(n, D, device=DEV, dtype=BF16, generator=g) * D**-0.5)
          for n in (4096, 512, 512)]
    dys = [torch.randn(M, n, device=DEV, dtype=BF16, generator=g) for n in (4096, 512, 512)]
    wcs = [Fp8WeightCache() for _ in ws]

    def bf16(xl):
        y = fl._rms_norm(xl, wn, 1e-6)
        return [F.linear(y, w) for w in ws]

    def fused(xl):
        cache = fl.Fp8InputCache(consumers=3)
        y = fl.fp8_rms_norm(xl, wn, 1e-6, emulate=False, input_cache=cache)
        return [fl.fp8_linear(y, w, recipe="rowwise", emulate=False, weight_cache=c, input_cache=cache)
                for w, c in zip(ws, wcs)]

    def unshared(xl):
        y = fl._rms_norm(xl, wn, 1e-6)
        return [fl.fp8_linear(y, w, recipe="rowwise", emulate=False, weight_cache=c) for w, c in zip(ws, wcs)]

    xl = x.clone().requires_grad_()
    t = {}
    for name, fn in (("bf16", bf16), ("fused", fused), ("unshared", unshared)):
        t[name] = bench(lambda: torch.autograd.grad(fn(xl), (xl, wn, *ws), dys))
    log(f"qkv block M={M}: bf16 {t['bf16']:.3f} ms; rowwise + norm quantizing {t['bf16'] / t['fused']:.2f}x "
        f"({t['fused']:.3f} ms); rowwise, each projection quantizing {t['bf16'] / t['unshared']:.2f}x "
        f"({t['unshared']:.3f} ms)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--time-limit", type=float, default=100.0)
    p.add_argument("--ms", default="4096,16384")
    p.add_argument("--no-profile", action="store_true")
    a = p.parse_args()
    t0 = time.time()
    deadline = t0 + a.time_limit
    ms = [int(v) for v in a.ms.split(",")]
    log(f"fp8_dense_check on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    section("correctness (M=4096, K=2048, N=4096, bf16)", correctness)
    section("pieces, Qwen3 wq shape", pieces, 16384, 2048, 4096)
    if not a.no_profile:
        section("profile, Qwen3 wq shape", profile, 16384, 2048, 4096)
    for M in ms:
        section(f"qkv block M={M}", qkv, M)
    section("speed", speed, ms, deadline)
    log(f"\ndone in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
