"""The Triton kernel of :class:`~lightning_moe.optim.master.MasterAdamW`'s fused step (imported lazily: this module
imports triton).

One update of a list of tensors of one dtype group (the multi-tensor form of torch's fused optimizers) is two
launches: a table of five data pointers per tensor -- gradient, weight (the fp32 master, or the parameter when it is
fp32 itself), exp_avg, exp_avg_sq, and the low-precision parameter to rewrite -- plus static tables of blocks (tensor
index, first element): the full blocks, unmasked (16-byte vector loads and stores when every tensor is 16-byte
aligned), then each tensor's partial last block, masked. Every program moves one block: reads the gradient, weight and both moments, writes the weight, both moments
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
def _ptr(row, i, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.load(row + i).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)  # every address of the launch is 16-byte aligned (checked by the caller)
    return p


@triton.jit
def _load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0.0)
    return tl.load(ptr + offs)


@triton.jit
def _store(ptr, offs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        tl.store(ptr + offs, x)


@triton.jit
def adamw_kernel(ptrs, numels, block_tensor, block_start, decay, beta1_weight, beta2, beta2_weight, step_size,
                 bias2_sqrt, eps, G_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                 LERP_LOW: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one tensor. ``ptrs`` [N, 5] int64: grad, weight, exp_avg, exp_avg_sq, param (used with
    HAS_MASTER). ``decay`` = 1 - lr * weight_decay, ``beta1_weight`` = 1 - beta1, ``beta2_weight`` = 1 - beta2,
    ``step_size`` = lr / (1 - beta1^t), ``bias2_sqrt`` = sqrt(1 - beta2^t). LERP_LOW: torch's lerp formula for a
    weight below 0.5 (``m + w (g - m)``; else ``g - (g - m)(1 - w)``). MASKED: the launch of every tensor's last,
    partial block (the full blocks run unmasked, so loads and stores vectorize); ALIGNED: 16-byte aligned tensors
    (alignment hints for 16-byte vectors)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid).to(tl.int64)
    start = tl.load(block_start + pid)
    offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK).to(tl.int64), BLOCK), BLOCK)
    mask = offs < tl.load(numels + t)
    row = ptrs + t * 5
    g_ptr = _ptr(row, 0, G_DTYPE, ALIGNED)
    w_ptr = _ptr(row, 1, tl.float32, ALIGNED)
    m_ptr = _ptr(row, 2, tl.float32, ALIGNED)
    v_ptr = _ptr(row, 3, tl.float32, ALIGNED)

    g = _load(g_ptr, offs, mask, MASKED).to(tl.float32)
    w = _load(w_ptr, offs, mask, MASKED)
    m = _load(m_ptr, offs, mask, MASKED)
    v = _load(v_ptr, offs, mask, MASKED)

    w = w * decay
    if LERP_LOW:
        m = m + beta1_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - beta1_weight)
    v = v * beta2 + beta2_weight * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    w = w - step_size * tl.div_rn(m, denom)

    _store(w_ptr, offs, w, mask, MASKED)
    _store(m_ptr, offs, m, mask, MASKED)
    _store(v_ptr, offs, v, mask, MASKED)
    if HAS_MASTER:
        p_ptr = _ptr(row, 4, P_DTYPE, ALIGNED)
        if P_DTYPE == tl.bfloat16:
            _store(p_ptr, offs, _bf16_rne(w), mask, MASKED)
        else:
            _store(p_ptr, offs, w.to(P_DTYPE), mask, MASKED)
