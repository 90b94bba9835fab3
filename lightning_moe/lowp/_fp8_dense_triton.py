"""Triton kernels of the eager dense FP8 linear (:mod:`lightning_moe.lowp.fp8_linear`; imported lazily by it: this
module imports triton): the tensorwise and rowwise casts, a byte transpose; the RMSNorm that quantizes its output is
in :mod:`lightning_moe.moe._triton_kernels`.

:func:`tensorwise_cast_kernel`: one pass over a 2-D tensor ``x`` [M, N] given its amax (a device scalar: no host
sync), writing its FP8 form row-major (``ROWS``), column-major (``COLS``, the transposed layout the FP8 GEMM wants for
the other operand), or both from one read, plus the dequantization scale. Numerics are torchao 0.18's tensorwise
cast (``tensor_to_scale`` + ``hp_tensor_and_scale_to_float8``): scale = fp8_max / max(amax, 1e-12) in float64, stored
as fp32 (not rounded to a power of two); q = fp8(clamp(x * scale, +-fp8_max)) rounded to nearest, ties to even;
the dequantization scale is the fp32 reciprocal of the scale (computed in float64, so correctly rounded). The
rounding is explicit fp32 arithmetic (exact; the sign bit kept, so -0 stays -0): Triton's interpreter mis-rounds its
own fp8 casts, and under it the FP8 values are stored as fp32 (it cannot store fp8).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fp8_rne(y, STEP: tl.constexpr, MIN_STEP: tl.constexpr):
    """fp32 ``y`` (already clamped to the format's range) rounded to the nearest FP8 value, ties to even: spacing
    ``2^floor(log2|y|) * STEP`` (STEP = 2^-mantissa_bits), at least MIN_STEP (the subnormal step); y's sign bit is
    put back on the rounded |y|."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    spacing = tl.maximum(e * STEP, MIN_STEP)
    # a / spacing as a product with 1 / spacing, exact (a power of two: its exponent bits mirrored about 127)
    v = a * (2130706432 - spacing.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    r = tl.floor(v + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where(((r - v) == 0.5) & odd, r - 1.0, r)
    return ((r * spacing).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def tensorwise_cast_kernel(x_ptr, amax_ptr, q_ptr, qt_ptr, sinv_ptr, M, N, FP8_MAX: tl.constexpr,
                           STEP: tl.constexpr, MIN_STEP: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """x [M, N] row-major -> q [M, N] row-major (ROWS) and / or qt [M, N] column-major, i.e. [N, M] row-major (COLS);
    sinv[0] = 1 / scale. Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    amax = tl.load(amax_ptr).to(tl.float32).to(tl.float64)
    scale = (FP8_MAX / tl.maximum(amax, 1e-12)).to(tl.float32)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (m[:, None] < M) & (n[None, :] < N)
    x = tl.load(x_ptr + m[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
    q = _fp8_rne(tl.minimum(tl.maximum(x * scale, -FP8_MAX), FP8_MAX), STEP, MIN_STEP)
    if ROWS:
        tl.store(q_ptr + m[:, None] * N + n[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    if COLS:
        tl.store(qt_ptr + n[:, None] * M + m[None, :], tl.trans(q).to(qt_ptr.dtype.element_ty),
                 mask=tl.trans(mask))
    if (pid_m == 0) & (pid_n == 0):
        tl.store(sinv_ptr, (1.0 / scale.to(tl.float64)).to(tl.float32))


# ---- rowwise recipe: row-wise casts (forward x and w, dgrad dy) ----------------------------------------------------


@triton.jit
def rowwise_cast_kernel(x_ptr, q_ptr, sinv_ptr, M, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """x [M, C] row-major -> q [M, C] e4m3 row-major, row r scaled by torchao's rowwise-recipe scale 448 /
    max(amax_r, 1e-12) rounded down to a power of two; sinv[r] = 1 / scale. BLOCK_R rows per program, two passes
    over them (amax; cast, the second read from L2). Grid (cdiv(M, BLOCK_R),)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = r < M
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (c[None, :] < C)
        acc = tl.maximum(acc, tl.abs(tl.load(x_ptr + r[:, None] * C + c[None, :], mask=mask, other=0.0)
                                     .to(tl.float32)))
    amax = tl.maximum(tl.max(acc, axis=1), 1e-12)
    scale = ((448.0 / amax).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (c[None, :] < C)
        x = tl.load(x_ptr + r[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _fp8_rne(tl.minimum(tl.maximum(x * scale[:, None], -448.0), 448.0), 0.125, 0.001953125)
        tl.store(q_ptr + r[:, None] * C + c[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(sinv_ptr + r, 1.0 / scale, mask=rmask)


@triton.jit
def transpose_kernel(x_ptr, y_ptr, M, C, BLOCK: tl.constexpr):
    """y [C, M] = x [M, C].T, both row-major (1-byte elements: FP8 data viewed as uint8). Grid (cdiv(M, BLOCK),
    cdiv(C, BLOCK))."""
    m = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (m[:, None] < M) & (c[None, :] < C)
    x = tl.load(x_ptr + m[:, None] * C + c[None, :], mask=mask, other=0)
    tl.store(y_ptr + c[:, None] * M + m[None, :], tl.trans(x), mask=tl.trans(mask))


# ---- rowwise recipe: the weight gradient's column-wise casts ----------------------------------------------------
# torchao's ``triton_fp8_per_group_colwise_scales_dual`` with one group runs one program per block of columns over
# all M rows (a few dozen programs for an H200's 132 SMs): the two kernels below split M too, so every shape fills
# the GPU: a column amax (atomic max of fp32 bits, which order as integers for values >= 0) and a tiled cast.


@triton.jit
def colwise_amax_kernel(x_ptr, amax_ptr, M, C, ROWS_PER_PROGRAM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """amax_bits[c] = max(amax_bits[c], bits(max |x[m, c]|)) over this program's ROWS_PER_PROGRAM rows of x [M, C]
    row-major; amax_ptr: int32 view of a zeroed fp32 [C]. Grid (cdiv(M, ROWS_PER_PROGRAM), cdiv(C, BLOCK_C))."""
    pid_m, pid_c = tl.program_id(0), tl.program_id(1)
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    cmask = c < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for m0 in range(0, ROWS_PER_PROGRAM, BLOCK_M):
        m = (pid_m * ROWS_PER_PROGRAM + m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (m[:, None] < M) & cmask[None, :]
        x = tl.load(x_ptr + m[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.max(tl.abs(x), axis=0))
    tl.atomic_max(amax_ptr + c, acc.to(tl.int32, bitcast=True), mask=cmask)


@triton.jit
def colwise_cast_kernel(x_ptr, amax_ptr, qt_ptr, sinv_ptr, M, C, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """x [M, C] row-major -> qt [C, M] row-major (x's e4m3 form column-major), scaled per column c by torchao's
    rowwise-recipe scale of column c: 448 / max(amax[c], 1e-12) rounded down to a power of two (the exponent bits of
    the fp32 quotient); sinv[c] = 1 / scale (exact: a power of two). Grid (cdiv(M, BLOCK_M), cdiv(C, BLOCK_C))."""
    pid_m, pid_c = tl.program_id(0), tl.program_id(1)
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cmask = c < C
    amax = tl.maximum(tl.load(amax_ptr + c, mask=cmask, other=1.0), 1e-12)
    scale = ((448.0 / amax).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    mask = (m[:, None] < M) & cmask[None, :]
    x = tl.load(x_ptr + m[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
    q = _fp8_rne(tl.minimum(tl.maximum(x * scale[None, :], -448.0), 448.0), 0.125, 0.001953125)
    tl.store(qt_ptr + c[:, None] * M + m[None, :], tl.trans(q).to(qt_ptr.dtype.element_ty), mask=tl.trans(mask))
    if pid_m == 0:
        tl.store(sinv_ptr + c, 1.0 / scale, mask=cmask)


@triton.jit(do_not_specialize=["seed"])  # a new seed every call: no recompiles on its divisibility
def stochastic_round_kernel(w_ptr, scale_ptr, out_ptr, seed, rows, R, C, t_b, t_r, t_c, FP8_MAX: tl.constexpr,
                            STEP: tl.constexpr, MIN_STEP: tl.constexpr, ROW_SCALE: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``w`` [B, R, C] contiguous, seen as ``rows`` = B * R rows of C, times its power-of-two ``scale`` (strides
    ``t_*``, 0 along the amax dimension), clamped to +-FP8_MAX, rounded down or up to a neighbouring FP8 value with
    probabilities that keep its expectation (u from ``tl.rand(seed, i)`` for the element's flat index i; u < 1 leaves
    grid values alone), divided by the scale again (exact) into ``out`` (w's dtype, contiguous):
    :func:`lightning_moe.lowp.fp8_stochastic.stochastic_round_e4m3` in one pass. Row and column indices are split
    per tile, not per element; ``ROW_SCALE`` (t_c == 0: the amax ran along C) loads one scale per row. Grid
    (cdiv(rows, BLOCK_R), cdiv(C, BLOCK_C))."""
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (row[:, None] < rows) & (c[None, :] < C)
    i = row[:, None] * C + c[None, :]
    s_off = (row // R) * t_b + (row % R) * t_r
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    if ROW_SCALE:
        scale = tl.load(scale_ptr + s_off, mask=row < rows, other=1.0)[:, None]
    else:
        scale = tl.load(scale_ptr + s_off[:, None] + c[None, :] * t_c, mask=mask, other=1.0)
    y = tl.minimum(tl.maximum(w * scale, -FP8_MAX), FP8_MAX)
    a = tl.abs(y)
    e = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    spacing = tl.maximum(e * STEP, MIN_STEP)
    # a / spacing as a product with 1 / spacing, exact (a power of two: its exponent bits mirrored about 127)
    v = a * (2130706432 - spacing.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    q = tl.minimum(tl.floor(v + tl.rand(seed, i)) * spacing, FP8_MAX)
    q = tl.where(y < 0.0, -q, q)
    tl.store(out_ptr + i, (q / scale).to(out_ptr.dtype.element_ty), mask=mask)
