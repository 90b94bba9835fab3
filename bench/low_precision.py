#!/usr/bin/env python
"""Low-precision training (issue 11): speed of FP8 vs bf16, and convergence of every recipe vs bf16.

Modes (``--mode``, all by default):

``layer``        MoE layer forward + backward at the three shapes of ``bench/moe_layer.py`` (its ``SHAPES``,
                 ``build_ours``, ``time_steps``, ``fwd_bwd_step``): bf16 vs ``fp8_rowwise`` (experts through torchao's
                 FP8 rowwise grouped GEMM with our 16-row group padding, shared experts through torchao Float8Linear),
                 same weights, same x / dy. Target: fp8 >= 1.2x bf16 at every shape.
``step``         train step of the 8-layer Qwen3-30B-A3B-shaped bench model (``bench/train_step.py``'s ``run_ours``
                 with ``extra_callbacks=(LowPrecisionTraining(...),)``): bf16 vs fp8_tensorwise and fp8_rowwise
                 (tokens/s, peak memory). Target: >= 1.15x.
``convergence``  ``--conv-steps`` (300) steps from the same init (same seed; the callback keeps every module's init,
                 and each run records a checksum of its first batch and of its initial weights) on the embedded
                 corpus: the FP8 recipes on the 8-layer bench model, the emulated MXFP8 / NVFP4 recipes on the
                 ``tiny`` preset (each against its own bf16 run). Smoothed final loss = mean of the last
                 ``--smooth`` steps; relative difference to bf16 (targets: FP8 1%, MXFP8 / NVFP4 3%). Curves go to
                 ``<out stem>_curves.png`` (matplotlib) or ``.csv`` next to ``--out``.

On CPU (``--device cpu --small``: toy sizes, a few steps) every recipe runs emulated (``emulate=True``): a smoke test.

GPU commands (one H200; repository root):
    python bench/low_precision.py --mode layer --out bench/results/low_precision_layer_h200.json
    python bench/low_precision.py --mode step --out bench/results/low_precision_step_h200.json
    python bench/low_precision.py --mode convergence --out bench/results/low_precision_conv_h200.json
    python bench/low_precision.py --device cpu --small --out /tmp/lowp.json          # smoke test (CPU)
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_layer  # noqa: E402
import train_step  # noqa: E402

from lightning_moe.callbacks import LowPrecisionTraining  # noqa: E402

FP8_RECIPES = ("fp8_tensorwise", "fp8_rowwise")
BLOCK_RECIPES = ("mxfp8", "nvfp4")
TARGETS = {"layer": 1.2, "step": 1.15, "fp8": 0.01, "block": 0.03}


def log(*a: Any) -> None:
    print(*a, flush=True)


def _callback(recipe: str, args: argparse.Namespace) -> LowPrecisionTraining:
    return LowPrecisionTraining(recipe, emulate=args.device == "cpu" or recipe in BLOCK_RECIPES)


# ------------------------------------------------------------------------------------------------ (a) layer
def bench_layer(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    for name in args.shapes.split(","):
        cfg = moe_layer.model_config(name, args.small)
        T = moe_layer.SMALL_TOKENS if args.small else moe_layer.SHAPES[name]["tokens"]
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        dy = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
        res: dict[str, Any] = {"shape": name, "tokens": T}
        for recipe in ("bf16", "fp8_rowwise"):
            r: dict[str, Any] = {}
            try:
                layer = moe_layer.build_ours(cfg, device, dtype, seed=0)
                if recipe != "bf16":
                    cb = _callback(recipe, args)
                    cb.device = device
                    cb.transform_model(layer)
                    r["converted"] = cb.converted
                r.update(moe_layer.time_steps(moe_layer.fwd_bwd_step(layer, x, dy), device, args.warmup, args.iters))
                r.pop("times_ms", None)
                del layer
            except Exception as e:  # report, keep going
                r["error"] = f"{type(e).__name__}: {e}"
            res[recipe] = r
        if "ms" in res["bf16"] and "ms" in res["fp8_rowwise"]:
            res["speedup"] = res["bf16"]["ms"] / res["fp8_rowwise"]["ms"]
        log(f"layer {name:12s} T={T}: bf16 {res['bf16'].get('ms', res['bf16'].get('error'))} ms, fp8_rowwise "
            f"{res['fp8_rowwise'].get('ms', res['fp8_rowwise'].get('error'))} ms, speedup "
            f"{res.get('speedup', float('nan')):.3f} (target >= {TARGETS['layer']})")
        out.append(res)
    return out


# ------------------------------------------------------------------------------------------------ (b) step
class _InitChecksum:
    """Sum of all parameters at the start of training (a Lightning callback, duck-typed)."""

    def __new__(cls) -> Any:
        import lightning as L

        class _C(L.Callback):
            value: Optional[float] = None

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                with torch.no_grad():
                    self.value = float(sum(p.float().sum() for p in pl_module.parameters()
                                           if not hasattr(p, "full_tensor")))

        return _C()


def _run(label: str, cfg: Any, recipe: str, args: argparse.Namespace, device: torch.device, peak: Optional[dict],
         timed: bool, steps: int, seq_len: int, batch_size: int, lr: float) -> dict[str, Any]:
    ts_args = argparse.Namespace(steps=steps, warmup=args.warmup, precision=args.precision, loss_impl="auto",
                                 profile=False, out=args.out)
    chk = _InitChecksum()
    extra = (chk,) if recipe == "bf16" else (chk, _callback(recipe, args))
    r = train_step.run_ours(f"{label}-{recipe}", cfg, seq_len, batch_size, ts_args, lr, device, peak, timed,
                            extra_callbacks=extra)
    r["recipe"], r["init_checksum"] = recipe, chk.value
    return r


def bench_step(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    ts_args = argparse.Namespace(small=args.small, layers=2 if args.small else 8, seq_len=args.seq_len)
    cfg = train_step.qwen_config(ts_args)
    peak = None
    if device.type == "cuda":
        peak = train_step.measure_matmul_peak(device)
    runs = [_run("qwen3-8L", cfg, rec, args, device, peak, True, args.steps, args.seq_len, args.batch_size, 3e-4)
            for rec in ("bf16", *FP8_RECIPES)]
    base = runs[0].get("tokens_per_s")
    for r in runs:
        if base and r.get("tokens_per_s"):
            r["speedup"] = r["tokens_per_s"] / base
        log(f"step {r['recipe']:15s} tokens/s {r.get('tokens_per_s')} speedup {r.get('speedup')} "
            f"(target >= {TARGETS['step']}) peak {r.get('peak_gib')} GiB {r.get('error', '')}")
    return runs


# ------------------------------------------------------------------------------------------------ (c) convergence
def smoothed(losses: list[float], n: int) -> float:
    tail = [v for v in losses[-n:] if v == v]
    return sum(tail) / len(tail) if tail else float("nan")


def bench_convergence(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from lightning_moe.config import ModelConfig

    ts_args = argparse.Namespace(small=args.small, layers=2 if args.small else 8, seq_len=args.seq_len)
    groups = {"qwen3-8L": (train_step.qwen_config(ts_args), FP8_RECIPES, 3e-4, args.seq_len, args.batch_size),
              "tiny": (ModelConfig.from_preset("tiny"), BLOCK_RECIPES, 3e-3, 128 if args.small else 256, 16)}
    report: dict[str, Any] = {"runs": [], "summary": []}
    for label, (cfg, recipes, lr, seq_len, bs) in groups.items():
        base = _run(label, cfg, "bf16", args, device, None, False, args.conv_steps, seq_len, bs, lr)
        report["runs"].append(base)
        for recipe in recipes:
            r = _run(label, cfg, recipe, args, device, None, False, args.conv_steps, seq_len, bs, lr)
            report["runs"].append(r)
            b, q = smoothed(base["losses"], args.smooth), smoothed(r["losses"], args.smooth)
            target = TARGETS["fp8" if recipe in FP8_RECIPES else "block"]
            s = {"model": label, "recipe": recipe, "steps": args.conv_steps, "bf16_final": b, "final": q,
                 "rel_diff": (q - b) / b, "target": target, "ok": abs((q - b) / b) <= target,
                 "same_init": r["init_checksum"] == base["init_checksum"],
                 "same_data": r.get("first_batch_checksum") == base.get("first_batch_checksum"),
                 "error": r.get("error")}
            report["summary"].append(s)
            log(f"convergence {label} {recipe}: smoothed final {q:.4f} vs bf16 {b:.4f}: {100 * s['rel_diff']:+.2f}% "
                f"(target {100 * target:.0f}%) same init {s['same_init']} same data {s['same_data']}")
    save_curves(report["runs"], Path(args.out))
    return report


def save_curves(runs: list[dict[str, Any]], out: Path) -> Path:
    stem = out.with_name(out.stem + "_curves")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = stem.with_suffix(".csv")
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["run", "step", "loss"])
            for r in runs:
                w.writerows((r["model"], i, v) for i, v in enumerate(r["losses"]))
        log(f"curves: {path} (matplotlib not importable)")
        return path
    models = sorted({r["model"].rsplit("-", 1)[0] for r in runs})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for r in runs:
            if r["model"].rsplit("-", 1)[0] == m:
                ax.plot(r["losses"], label=r["recipe"], lw=1)
        ax.set_title(m)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.legend()
    path = stem.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"curves: {path}")
    return path


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="layer,step,convergence", help="comma-separated: layer, step, convergence")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes and few steps (CPU smoke test)")
    p.add_argument("--shapes", default="qwen3,deepseek_v3,mixtral")
    p.add_argument("--iters", type=int, default=None, help="timed layer steps (default 20; 2 with --small)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5; 1 with --small)")
    p.add_argument("--steps", type=int, default=None, help="train-step mode steps (default 20; 4 with --small)")
    p.add_argument("--conv-steps", type=int, default=None, help="convergence steps (default 300; 8 with --small)")
    p.add_argument("--smooth", type=int, default=None, help="steps averaged for the final loss (default 20; 3 small)")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (128 with --small)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--precision", default=None, help="Lightning precision; default bf16-true (cuda), 32-true (cpu)")
    p.add_argument("--out", default="bench_low_precision.json")
    a = p.parse_args(argv)
    small = a.small
    for k, full, tiny in (("iters", 20, 2), ("warmup", 5, 1), ("steps", 20, 4), ("conv_steps", 300, 8),
                          ("smooth", 20, 3), ("seq_len", 4096, 128)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if small else full)
    if a.precision is None:
        a.precision = "bf16-true" if a.device == "cuda" else "32-true"
    return a


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = train_step.pick_device(args.device)
    if device is None:
        return 2
    report: dict[str, Any] = {"args": vars(args), "env": train_step.environment(device)}
    try:
        import torchao

        report["env"]["torchao"] = torchao.__version__
    except ImportError as e:
        report["env"]["torchao"] = f"unavailable ({e})"
    t0 = time.perf_counter()
    modes = args.mode.split(",")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for mode, fn in (("layer", bench_layer), ("step", bench_step), ("convergence", bench_convergence)):
        if mode in modes:
            report[mode] = fn(args, device)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1, default=str)
    report["wall_s"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    log(f"wrote {args.out} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
