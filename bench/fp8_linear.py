#!/usr/bin/env python
"""The eager dense FP8 linear (``lightning_moe/lowp/fp8_linear.py``, issue 23) on the GPU: its kernels against its
emulation (the numerics the CPU tests pin to torchao's), and its speed against bf16 and torchao's eager
``Float8Linear`` at the bench presets' dense shapes.

1. Correctness (M=4096, K=2048, N=4096, bf16): output and both gradients of the kernel path against
   ``emulate=True`` (relative max error; the FP8 operands are the same values, the GEMMs' accumulation order and
   fast accumulation differ); the RMSNorm that quantizes its output against ``F.rms_norm`` and the rowwise
   quantization of its y (the FP8 bytes must match exactly).
2. Speed (CUDA events, median of ``--reps`` after ``--warmup``; forward + both gradients via ``torch.autograd.grad``):
   bf16 ``F.linear`` vs ours (rowwise, tensorwise) vs torchao ``Float8Linear`` (rowwise, tensorwise), as
   bf16_ms / fp8_ms, for every distinct dense (N, K) of the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral presets at each
   ``--ms``; and one attention block's input side: RMSNorm + the three GQA projections (Qwen3), bf16 vs rowwise with
   the norm quantizing (one quantization for the three) vs rowwise without the shared input.
3. A table on stdout; nonzero exit when a correctness check fails (a GPU call can fall back on it).

GPU (one H200, repository root; about 1-2 minutes):
    python -m bench fp8_linear --time-limit 90 | tee bench/results/fp8_linear_h200.txt
CPU smoke test (the CPU kernel path, toy sizes): ``python -m bench fp8_linear --device cpu --small``
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/fp8_linear.py ...` runs `python -m bench fp8_linear ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from bench.core.timer import time_steps
from lightning_moe.lowp import fp8_linear as fl
from lightning_moe.lowp.fp8_grouped import quantize_rowwise

PRESETS = ("qwen3_moe_30b_a3b", "deepseek_v3", "mixtral_8x7b")


def log(*a: Any) -> None:
    print(*a, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def dense_shapes(presets: tuple[str, ...]) -> list[tuple[int, int, list[str]]]:
    """Distinct (N, K) of the presets' dense linears that stay FP8-eligible (not the LM head / the shared gate)."""
    from lightning_moe.config import ModelConfig
    from lightning_moe.lowp.crossover import model_gemms
    from lightning_moe.models.transformer import MoETransformer

    seen: dict[tuple[int, int], list[str]] = {}
    for p in presets:
        with torch.device("meta"):
            model = MoETransformer(ModelConfig.from_preset(p))  # on the meta device: no memory
        for g in model_gemms(model):
            leaf = g.name.rsplit(".", 1)[-1]
            if g.kind == "dense" and leaf not in ("output", "gate") and g.N % 16 == 0 and g.K % 16 == 0:
                names = seen.setdefault((g.N, g.K), [])
                label = f"{p}:{'.'.join(g.name.split('.')[2:])}"
                if label not in names:
                    names.append(label)
    return [(n, k, names) for (n, k), names in seen.items()]


def torchao_linear(w: torch.Tensor, recipe: str) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype))
    with torch.no_grad():
        lin[0].weight.copy_(w)
    convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(recipe))
    return lin


def grad_step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: tuple, dy: torch.Tensor):
    return lambda: torch.autograd.grad(fn(x), (x, *params), dy)


def correctness(device: torch.device, small: bool) -> list[tuple[str, float, float, bool]]:
    M, K, N = (64, 64, 48) if small else (4096, 2048, 4096)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=gen) * K**-0.5)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16, generator=gen)
    rows = []
    for recipe in fl.LINEAR_RECIPES:
        outs = {}
        for emulate in (False, True):
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fl.fp8_linear(xl, wl, recipe=recipe, emulate=emulate)
            y.backward(dy)
            outs[emulate] = (y.detach(), xl.grad, wl.grad)
        exact = (x.float() @ w.float().t())
        for name, a, b in zip(("y", "dx", "dw"), outs[False], outs[True]):
            err = rel(a, b)
            rows.append((f"{recipe} {name} kernels vs emulation", err, 2e-2, err <= 2e-2))
        rows.append((f"{recipe} y vs the bf16-free product (FP8 noise)", rel(outs[False][0], exact), 0.2,
                     1e-3 < rel(outs[False][0], exact) < 0.2))
    # the norm that quantizes its output
    wn = (1 + 0.1 * torch.randn(K, device=device, generator=gen)).to(torch.bfloat16)
    cache = fl.Fp8InputCache(consumers=1)
    y = fl.fp8_rms_norm(x, wn, 1e-6, emulate=False, input_cache=cache)
    ref = fl._rms_norm(x, wn, 1e-6)
    rows.append(("rms_norm_quant y vs F.rms_norm", rel(y, ref), 8e-3, rel(y, ref) <= 8e-3))
    q, s = cache.read(y, "rowwise")
    q_ref, s_ref = quantize_rowwise(y)
    same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.flatten(), s_ref)
    rows.append(("rms_norm_quant FP8 bytes == quantize(y)", 0.0 if same else 1.0, 0.0, same))
    return rows


def speed(args: argparse.Namespace, device: torch.device, deadline: float) -> list[dict[str, Any]]:
    out = []
    shapes = [(48, 64, ["small"])] if args.small else dense_shapes(PRESETS)
    ms = [64] if args.small else args.ms
    impls = ["ours rowwise", "ours tensorwise"] + ([] if args.small or device.type != "cuda"
                                                   else ["torchao rowwise", "torchao tensorwise"])
    for N, K, names in shapes:
        for M in ms:
            if time.perf_counter() > deadline:
                log(f"time limit: skipping N={N} K={K} M={M} and the rest")
                return out
            row: dict[str, Any] = {"N": N, "K": K, "M": M, "names": names}
            try:
                gen = torch.Generator(device=device).manual_seed(0)
                x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
                w = (torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=gen) * K**-0.5)
                w.requires_grad_()
                dy = torch.randn(M, N, device=device, dtype=torch.bfloat16, generator=gen)
                row["bf16_ms"] = time_steps(grad_step(lambda t: F.linear(t, w), x, (w,), dy), device, args.warmup,
                                            args.reps)["ms"]
                for impl in impls:
                    who, recipe = impl.split()
                    if who == "ours":
                        fn = lambda t, r=recipe: fl.fp8_linear(t, w, recipe=r, emulate=False)  # noqa: E731
                        step = grad_step(fn, x, (w,), dy)
                    else:
                        lin = torchao_linear(w.detach(), recipe)
                        step = grad_step(lin, x, (lin[0].weight,), dy)
                    row[impl] = row["bf16_ms"] / time_steps(step, device, args.warmup, args.reps)["ms"]
            except Exception as e:  # noqa: BLE001 - report, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            out.append(row)
            log(f"N={N:6d} K={K:6d} M={M:6d} bf16 {row.get('bf16_ms', float('nan')):8.3f} ms  "
                + "  ".join(f"{i} {row[i]:.2f}x" for i in impls if i in row) + f"  {row.get('error', '')}"
                + f"  [{', '.join(names[:2])}{', ...' if len(names) > 2 else ''}]")
    return out


def qkv_block(args: argparse.Namespace, device: torch.device) -> Optional[dict[str, float]]:
    """RMSNorm + wq / wk / wv of Qwen3-30B-A3B (D 2048 -> 4096, 512, 512) at M tokens: bf16; rowwise with the
    norm quantizing for all three; rowwise with each projection quantizing its own copy of the input."""
    M, D, outs = (64, 64, (64, 32, 32)) if args.small else (args.ms[-1], 2048, (4096, 512, 512))
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    wn = torch.ones(D, device=device, dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(n, D, device=device, dtype=torch.bfloat16, generator=gen) * D**-0.5).requires_grad_()
          for n in outs]
    dys = [torch.randn(M, n, device=device, dtype=torch.bfloat16, generator=gen) for n in outs]

    def run(variant: str) -> Callable[[], Any]:
        def step():
            if variant == "bf16":
                h = fl._rms_norm(x, wn, 1e-6)
                ys = [F.linear(h, w) for w in ws]
            elif variant == "fused norm":
                cache = fl.Fp8InputCache(consumers=3)
                h = fl.fp8_rms_norm(x, wn, 1e-6, emulate=False, input_cache=cache)
                ys = [fl.fp8_linear(h, w, recipe="rowwise", emulate=False, input_cache=cache) for w in ws]
            else:
                h = fl._rms_norm(x, wn, 1e-6)
                ys = [fl.fp8_linear(h, w, recipe="rowwise", emulate=False) for w in ws]
            return torch.autograd.grad(ys, (x, wn, *ws), dys)
        return step

    t = {v: time_steps(run(v), device, args.warmup, args.reps)["ms"] for v in ("bf16", "fused norm", "unshared")}
    log(f"qkv block M={M}: bf16 {t['bf16']:.3f} ms, rowwise + fused norm {t['bf16'] / t['fused norm']:.2f}x, "
        f"rowwise, each projection quantizing {t['bf16'] / t['unshared']:.2f}x")
    return t


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes (CPU smoke test)")
    p.add_argument("--time-limit", type=float, default=90.0, help="seconds for the speed table (correctness first)")
    p.add_argument("--ms", default="4096,16384", help="token counts M of the speed table")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    a.ms = [int(m) for m in a.ms.split(",") if m.strip()]
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--device cpu --small for the smoke test)")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device(args.device)
    log(f"fp8_linear on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"torch {torch.__version__}")
    ok = True
    try:
        rows = correctness(device, args.small)
    except Exception:  # noqa: BLE001
        log(traceback.format_exc())
        return 1
    log(f"{'check':50s} {'error':>10s} {'tolerance':>10s}  ok")
    for name, err, tol, good in rows:
        ok &= good
        log(f"{name:50s} {err:10.2e} {tol:10.1e}  {'yes' if good else 'NO'}")
    try:
        qkv_block(args, device)
        speed(args, device, t0 + args.time_limit)
    except Exception:  # noqa: BLE001 - the correctness verdict stands
        log(traceback.format_exc())
    log(f"{'all checks passed' if ok else 'CHECKS FAILED'} ({time.perf_counter() - t0:.0f} s)")
    return 0 if ok else 1
