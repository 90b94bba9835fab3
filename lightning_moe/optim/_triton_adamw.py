"""The Triton kernel of :class:`~lightning_moe.optim.master.MasterAdamW`'s fused step (imported lazily: this module
imports triton).

One launch updates a list of tensors of one dtype group (the multi-tensor form of torch's fused optimizers): a table
of five data pointers per tensor -- gradient, weight (the fp32 master, or the parameter when it is fp32 itself),
exp_avg, exp_avg_sq, and the low-precision parameter to rewrite -- plus a static table of blocks (tensor index, first
element). Every program moves one block: reads the gradient, weight and both moments, writes the weight, both moments
and (master groups) the parameter rounded from the new master: 28 bytes an element for a bf16 parameter.

The arithmetic is the torch reference's (``MasterAdamW``'s foreach path, itself torch's AdamW), in fp32 and in the same
order; square root and division are the correctly rounded ones (``sqrt_rn``, ``div_rn``) so results agree with torch to
fp32 rounding. bf16 is rounded to nearest even with integer arithmetic: Triton's interpreter truncates in
``.to(tl.bfloat16)``, so the explicit form makes interpreted (CPU tests) and compiled kernels round alike.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

try:
    INTERPRET = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton without knobs
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

BLOCK = 4096  # elements a program moves (16 per thread at 8 warps: 4 x 16-byte fp32 vectors)
NUM_WARPS = 8


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even (NaN stays NaN)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def adamw_kernel(ptrs, numels, block_tensor, block_start, decay, beta1_weight, beta2, beta2_weight, step_size,
                 bias2_sqrt, eps, G_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                 LERP_LOW: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one tensor. ``ptrs`` [N, 5] int64: grad, weight, exp_avg, exp_avg_sq, param (used with
    HAS_MASTER). ``decay`` = 1 - lr * weight_decay, ``beta1_weight`` = 1 - beta1, ``beta2_weight`` = 1 - beta2,
    ``step_size`` = lr / (1 - beta1^t), ``bias2_sqrt`` = sqrt(1 - beta2^t). LERP_LOW: torch's lerp formula for a
    weight below 0.5 (``m + w (g - m)``; else ``g - (g - m)(1 - w)``)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid).to(tl.int64)
    n = tl.load(numels + t)
    offs = tl.load(block_start + pid) + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    row = ptrs + t * 5
    g_ptr = tl.load(row).to(tl.pointer_type(G_DTYPE))
    w_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))

    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    w = w * decay
    if LERP_LOW:
        m = m + beta1_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - beta1_weight)
    v = v * beta2 + beta2_weight * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    w = w - step_size * tl.div_rn(m, denom)

    tl.store(w_ptr + offs, w, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_MASTER:
        p_ptr = tl.load(row + 4).to(tl.pointer_type(P_DTYPE))
        if P_DTYPE == tl.bfloat16:
            tl.store(p_ptr + offs, _bf16_rne(w), mask=mask)
        else:
            tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)
