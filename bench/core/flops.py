"""FLOP and MFU conventions of the suites and the measured matmul peak (the MFU denominator).

Model FLOPs, not hardware FLOPs, the same numerator for every implementation of a model:
    flops/token = 6 * N + 12 * L * H * K * S
with N = active parameters that do matmuls (``config.count_params()["active"]`` minus the input-embedding table,
which is a lookup; the lm_head is included; routed experts count top_k of E), L layers, H query heads, K head dim,
S sequence length. The attention term is the usual non-causal count (PaLM / Megatron / torchtitan); a causal kernel
does about half of it, hence also ``mfu_causal`` with ``6 * L * H * K * S``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch

from bench.core.device import reset_memory, sync


def measure_matmul_peak(device: torch.device) -> dict[str, Any]:
    """FLOP/s of one large dense matmul: 8192^3 bf16 on CUDA; 1024^3 fp32 on CPU (only a placeholder there)."""
    if device.type == "cuda":
        n, dtype, iters = 8192, torch.bfloat16, 50
    else:
        n, dtype, iters = 1024, torch.float32, 5
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(5):
        c = a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        c = a @ b
    sync(device)
    dt = (time.perf_counter() - t0) / iters
    del a, b, c
    reset_memory(device)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "seconds": dt, "flops_per_s": 2 * n**3 / dt}


def flops_per_token(cfg: Any, seq_len: int) -> dict[str, float]:
    """Model FLOPs per token of a training step (forward + backward), see the module docstring."""
    counts = cfg.count_params()
    breakdown = cfg.param_breakdown()
    embedding = breakdown.get("embedding", {}).get("active", 0)
    # tied embeddings: the table is also the lm_head (a matmul), so nothing is subtracted
    n_matmul = counts["active"] - (0 if cfg.tie_embeddings else embedding)
    if cfg.attention == "mla":
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attn_dim = (qk_dim + cfg.v_head_dim) / 2  # QK^T uses qk_dim, PV uses v_head_dim
    else:
        attn_dim = cfg.head_dim
    attn = 12 * cfg.num_layers * cfg.num_heads * attn_dim * seq_len
    return {
        "params_total": counts["total"],
        "params_active": counts["active"],
        "params_active_matmul": n_matmul,
        "flops_per_token": 6 * n_matmul + attn,
        "flops_per_token_causal": 6 * n_matmul + attn / 2,
    }


def timing_summary(step_times: list[float], warmup: int, tokens_per_step: int, fpt: Optional[dict],
                   peak: Optional[dict]) -> dict[str, Any]:
    """Tokens/s over the steps after ``warmup`` (mean step time) and, with FLOPs and a peak, MFU both ways."""
    timed = step_times[warmup:]
    if not timed:
        return {"timed_steps": 0, "note": f"no step after the {warmup} warmup steps"}
    mean_t = sum(timed) / len(timed)
    out: dict[str, Any] = {
        "timed_steps": len(timed),
        "step_time_mean_s": mean_t,
        "step_time_median_s": statistics.median(timed),
        "step_time_min_s": min(timed),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / mean_t,
    }
    if fpt is not None and peak is not None:
        out["mfu"] = out["tokens_per_s"] * fpt["flops_per_token"] / peak["flops_per_s"]
        out["mfu_causal"] = out["tokens_per_s"] * fpt["flops_per_token_causal"] / peak["flops_per_s"]
        out["model_tflops_per_s"] = out["tokens_per_s"] * fpt["flops_per_token"] / 1e12
    return out
