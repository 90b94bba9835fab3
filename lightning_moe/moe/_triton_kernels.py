"""Triton kernels of :mod:`lightning_moe.moe.kernels` (imported lazily by it: this module imports triton).

Legend: T tokens, k top-k (``K``), D hidden, R rows grouped by expert, N elements. Every kernel does its math in
fp32 and stores in the output tensor's dtype; row offsets are int64 (R * D may pass 2**31).

A scalar condition is broadcast to a block before it joins a block mask (``_bcast``): Triton's interpreter rejects
``block_mask & scalar_mask``; compiled code is the same either way.

Whether triton's interpreter was on when this module was imported (``INTERPRET``) decides whether these kernels
take CPU tensors: ``@triton.jit`` picks interpreted or compiled functions at decoration time.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

try:
    INTERPRET = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton without knobs
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _bcast(x, like):
    return x + tl.zeros_like(like)


@triton.jit
def k_sum_kernel(rows_ptr, rows2_ptr, pos_ptr, w_ptr, out_ptr, D, K: tl.constexpr, HAS_W: tl.constexpr,
                 HAS_ROWS2: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, d] = sum_j w[t, j] * (rows[pos[t, j], d] (+ rows2[pos[t, j], d])) over pos >= 0.
    Grid (T, cdiv(D, BLOCK_D))."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):  # unrolled: the k row loads are in flight together
        p = tl.load(pos_ptr + t * K + j).to(tl.int64)
        m = dmask & (_bcast(p, d) >= 0)
        v = tl.load(rows_ptr + p * D + d, mask=m, other=0.0).to(tl.float32)
        if HAS_ROWS2:
            v += tl.load(rows2_ptr + p * D + d, mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def gather_rows_kernel(x_ptr, asg_ptr, out_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r, d] = x[asg[r] // K, d] (asg < 0: 0). Grid (R, cdiv(D, BLOCK_D))."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    a = tl.load(asg_ptr + r).to(tl.int64)
    t = tl.maximum(a, 0) // K
    v = tl.load(x_ptr + t * D + d, mask=dmask & (_bcast(a, d) >= 0), other=0.0)
    tl.store(out_ptr + r * D + d, v.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def unpermute_bwd_kernel(g_ptr, y_ptr, w_ptr, asg_ptr, gy_ptr, gw_ptr, D, K: tl.constexpr, NEED_GY: tl.constexpr,
                         NEED_GW: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row r per program, a = asg[r], t = a // K: gy[r] = w[a] * g[t] and gw[a] = <y[r], g[t]> (fp32);
    padding rows (a < 0) get gy = 0 and write no gw. Grid (R,)."""
    r = tl.program_id(0).to(tl.int64)
    a = tl.load(asg_ptr + r).to(tl.int64)
    valid = a >= 0
    ac = tl.maximum(a, 0)
    t = ac // K
    w = tl.load(w_ptr + ac, mask=valid, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dmask = d < D
        g = tl.load(g_ptr + t * D + d, mask=dmask & (_bcast(a, d) >= 0), other=0.0).to(tl.float32)
        if NEED_GY:
            tl.store(gy_ptr + r * D + d, (g * w).to(gy_ptr.dtype.element_ty), mask=dmask)
        if NEED_GW:
            y = tl.load(y_ptr + r * D + d, mask=dmask, other=0.0).to(tl.float32)
            acc += y * g
    if NEED_GW:
        tl.store(gw_ptr + ac, tl.sum(acc, axis=0), mask=valid)


@triton.jit
def swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, N, BLOCK: tl.constexpr):
    """h = silu(g) * u elementwise. Grid (cdiv(N, BLOCK),)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr):
    """du = dh * silu(g), dg = dh * u * s * (1 + g * (1 - s)) with s = sigmoid(g) recomputed. Grid as forward."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(du_ptr + offs, (dh * g * s).to(du_ptr.dtype.element_ty), mask=m)
    tl.store(dg_ptr + offs, (dh * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_probs_fwd_kernel(g_ptr, u_ptr, p_ptr, h_ptr, F, BLOCK_F: tl.constexpr):
    """h[r] = silu(g[r]) * u[r] * p[r] (the combine weight of row r applied before the down projection).
    Grid (R, cdiv(F, BLOCK_F))."""
    r = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = f < F
    p = tl.load(p_ptr + r).to(tl.float32)
    g = tl.load(g_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + r * F + f, (g * tl.sigmoid(g) * u * p).to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_probs_bwd_kernel(g_ptr, u_ptr, p_ptr, dh_ptr, dg_ptr, du_ptr, dp_ptr, F, NEED_DP: tl.constexpr,
                            BLOCK_F: tl.constexpr):
    """One row per program: with a = silu(g) recomputed, dp = sum_f dh * a * u (fp32), du = dh * p * a,
    dg = dh * p * u * s * (1 + g * (1 - s)). Grid (R,)."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.load(p_ptr + r).to(tl.float32)
    acc = tl.zeros([BLOCK_F], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        m = f < F
        g = tl.load(g_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        a = g * s
        if NEED_DP:
            acc += dh * a * u
        dhp = dh * p
        tl.store(du_ptr + r * F + f, (dhp * a).to(du_ptr.dtype.element_ty), mask=m)
        tl.store(dg_ptr + r * F + f, (dhp * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=m)
    if NEED_DP:
        tl.store(dp_ptr + r, tl.sum(acc, axis=0))


@triton.jit
def _e4m3_rne(y):
    """fp32 ``y`` (|y| <= 448) rounded to the nearest float8 e4m3 value, ties to even, in fp32 arithmetic: exact, so
    storing it into an e4m3 tensor is a lossless cast (Triton's interpreter mis-rounds its own fp8 casts). Spacing
    at y: 2^(floor(log2|y|) - 3), at least 2^-9 (the subnormal step). Rounded on |y| with y's sign bit put back, so
    a negative value that rounds to zero is -0 (0x80), as PyTorch's cast makes it: the FP8 bytes match too."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    spacing = tl.maximum(e * 0.125, 0.001953125)
    v = a * (2130706432 - spacing.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)  # a / spacing, exact
    r = tl.floor(v + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where(((r - v) == 0.5) & odd, r - 1.0, r)
    return ((r * spacing).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_scale(amax):
    """torchao's rowwise FP8 scale of a row from its blockwise amaxes: 448 / amax (amax >= 1e-12) rounded down to a
    power of two (the exponent bits kept)."""
    a = tl.maximum(tl.max(amax, axis=0), 1e-12)
    # IEEE division (``/`` compiles to an approximate one on GPUs): at amax = 7 * 2^j, 448 / amax is exactly a power
    # of two, and a result one ulp below it would round the scale down a whole binade
    return (tl.div_rn(448.0, a).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _quant_e4m3(x, scale):
    return _e4m3_rne(tl.minimum(tl.maximum(x * scale, -448.0), 448.0))


@triton.jit
def swiglu_probs_quant_fwd_kernel(g_ptr, u_ptr, p_ptr, dest_ptr, h_ptr, q_ptr, s_ptr, F, HAS_P: tl.constexpr,
                                  HAS_DEST: tl.constexpr, BLOCK_F: tl.constexpr):
    """h[o] = silu(g[r]) * u[r] (* p[r]) as :func:`swiglu_probs_fwd_kernel` computes it, and in the same program its
    FP8 e4m3 rowwise quantization (the down projection's input, torchao's rowwise numerics): scale = 448 / amax(h[r])
    rounded down to a power of two (amax >= 1e-12), q[o] = e4m3(clamp(h[r] * scale)), s[o] = 1 / scale; output row
    o = dest[r] with HAS_DEST (the rows of a group-padded buffer), else r. Pass 1 stores h and its amax; pass 2
    recomputes h from g, u (same math, same value) and stores q. Grid (R,)."""
    r = tl.program_id(0).to(tl.int64)
    o = tl.load(dest_ptr + r).to(tl.int64) if HAS_DEST else r
    p = tl.load(p_ptr + r).to(tl.float32) if HAS_P else 1.0
    amax = tl.zeros([BLOCK_F], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        m = f < F
        g = tl.load(g_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
        h = (g * tl.sigmoid(g) * u * p).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + o * F + f, h, mask=m)
        amax = tl.maximum(amax, tl.abs(h.to(tl.float32)))
    scale = _pow2_scale(amax)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        m = f < F
        g = tl.load(g_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r * F + f, mask=m, other=0.0).to(tl.float32)
        h = (g * tl.sigmoid(g) * u * p).to(h_ptr.dtype.element_ty).to(tl.float32)
        tl.store(q_ptr + o * F + f, _quant_e4m3(h, scale).to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + o, 1.0 / scale)


@triton.jit
def gather_quant_rows_kernel(x_ptr, asg_ptr, dest_ptr, q_ptr, s_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    """The row gather of :func:`gather_rows_kernel` quantized as it gathers (the gate / up projections' input,
    torchao's rowwise FP8 numerics as in :func:`swiglu_probs_quant_fwd_kernel`): row x[asg[r] // K] (asg < 0: a zero
    row) -> q[dest[r]] (e4m3 values) and s[dest[r]] (1 / scale). Two passes over the row (amax, then quantize); no
    high-precision copy is written. Grid (R,)."""
    r = tl.program_id(0).to(tl.int64)
    a = tl.load(asg_ptr + r).to(tl.int64)
    o = tl.load(dest_ptr + r).to(tl.int64)
    t = tl.maximum(a, 0) // K
    amax = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = (d < D) & (_bcast(a, d) >= 0)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)))
    scale = _pow2_scale(amax)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dmask = d < D
        v = tl.load(x_ptr + t * D + d, mask=dmask & (_bcast(a, d) >= 0), other=0.0).to(tl.float32)
        tl.store(q_ptr + o * D + d, _quant_e4m3(v, scale).to(q_ptr.dtype.element_ty), mask=dmask)
    tl.store(s_ptr + o, 1.0 / scale)


@triton.jit
def rms_norm_quant_fwd_kernel(x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, D, eps, BLOCK_D: tl.constexpr):
    """y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w (fp32 math, stored in y's dtype) and in the same program the FP8
    e4m3 rowwise quantization of the stored y (torchao's rowwise numerics, as :func:`swiglu_probs_quant_fwd_kernel`):
    q[r] = e4m3(clamp(y[r] * scale)), s[r] = 1 / scale. Three passes over the row (sum of squares; y and its amax;
    quantize the recomputed y, the same value). Grid (R,)."""
    r = tl.program_id(0).to(tl.int64)
    ss = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + r * D + d, mask=d < D, other=0.0).to(tl.float32)
        ss += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + eps)
    amax = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        x = tl.load(x_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
        y = (x * rstd * w).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + r * D + d, y, mask=m)
        amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
    scale = _pow2_scale(amax)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        x = tl.load(x_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
        y = (x * rstd * w).to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(q_ptr + r * D + d, _quant_e4m3(y, scale).to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + r, 1.0 / scale)
