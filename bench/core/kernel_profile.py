"""Where a layer step's device time goes (``bench/low_precision.py --profile``): one profiled step, its kernels summed
by category (attention, optimizer, quantize, FP8 GEMM, bf16 GEMM, copy / pad, other) and the top kernels."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch


def profile_lines(res: dict[str, Any]) -> str:
    """The profiled kernels of each recipe at one layer shape (``--profile``): time by category, then the top
    kernels (``bench/moe_layer.py``'s ``profile_layer`` table)."""
    out = []
    for recipe, prof in res.get("profile", {}).items():
        cats = "  ".join(f"{k} {v:.2f} ms" for k, v in prof.get("categories_ms", {}).items())
        out.append(f"--- profile {res['shape']} {recipe} (device ms per fwd+bwd): {cats}\n{prof.get('table', '')}")
    return "\n".join(out)


# kernel name fragments (CUDA kernel names of torch 2.11 / torchao 0.18 / ours): attention and the optimizer's
# multi-tensor kernels (train steps only) first; then a GEMM is an FP8 GEMM when its name also says FP8 (a CUTLASS
# rowwise scaled_mm names "rowwise" too); of the rest, FP8 casts and scale kernels are quantization
ATTENTION_KEYS = ("flash", "fmha", "attn")
OPTIMIZER_KEYS = ("adam", "multi_tensor")
GEMM_KEYS = ("gemm", "xmma", "cutlass", "nvjet", "grouped_mm", "matmul", "scaled_mm")
FP8_KEYS = ("f8", "fp8", "e4m3", "e5m2", "scaled")
QUANTIZE_KEYS = ("quant", "scale_and_cast", "colwise", "rowwise", "amax", "cast_", *FP8_KEYS)
COPY_KEYS = ("copy", "index", "fill", "zero", "cat", "gather", "scatter", "pad")


# cuBLASLt's sm90 GEMMs name their operand types after the arch: nvjet_sm90_tst_* (bf16), nvjet_sm90_qqtst_* and
# nvjet_sm90_qrtst_* (e4m3 x e4m3, e4m3 x e5m2: FP8)
NVJET_FP8 = re.compile(r"nvjet_sm\d+_q")


def kernel_category(name: str) -> str:
    """attention, optimizer, fp8 GEMM, bf16 GEMM, quantize, copy / pad or other, from a kernel's name."""
    name = name.lower()
    if any(k in name for k in ATTENTION_KEYS):
        return "attention"
    if any(k in name for k in OPTIMIZER_KEYS):
        return "optimizer"
    if any(k in name for k in GEMM_KEYS):
        return "fp8 GEMM" if any(k in name for k in FP8_KEYS) or NVJET_FP8.search(name) else "bf16 GEMM"
    if any(k in name for k in QUANTIZE_KEYS):
        return "quantize"
    return "copy / pad" if any(k in name for k in COPY_KEYS) else "other"


def kernel_categories(prof: Any, iters: int) -> dict[str, float]:
    """Device time per step by kernel category from a profiler's key averages, largest first: kernels only, not the
    CPU ops that launch them nor the ranges of ``record_function`` on the device timeline (Lightning's
    ``Optimizer.step#AdamW.step`` spans the whole optimizer step)."""
    cats: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if (us <= 0 or getattr(e, "device_type", None) is None or str(e.device_type).endswith("CPU")
                or getattr(e, "is_user_annotation", False)):
            continue
        cat = kernel_category(e.key)
        cats[cat] = cats.get(cat, 0.0) + us / 1000.0 / iters
    return dict(sorted(cats.items(), key=lambda kv: -kv[1]))


def profile_step(step: Callable[[], Any], device: torch.device, iters: int = 3) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from bench.core.device import sync

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return {"categories_ms": kernel_categories(prof, iters) if device.type == "cuda" else {},
            "table": prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=70)}
