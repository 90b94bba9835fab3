"""The FP8 casts of the eager dense linear (:mod:`lightning_moe.lowp.fp8_linear`), each one fused Triton pass
(kernels in ``_fp8_dense_triton``, imported on first use) where :func:`lightning_moe.moe.kernels.use_triton` says the
kernels run (CUDA, or CPU under Triton's interpreter, which stores the FP8 values as fp32: exact, converted after),
PyTorch ops with the same values elsewhere. Numerics are torchao 0.18's, byte for byte (tests/test_fp8_dense.py):

* :func:`cast_tensorwise`: one scale ``fp8_max / amax`` (float64 quotient, fp32, not rounded), e4m3 or e5m2, written
  row-major and / or column-major from one read;
* :func:`cast_rowwise` / :func:`cast_colwise`: e4m3, one scale per row / per column, ``448 / amax`` rounded down to a
  power of two (the rowwise recipe), row-major / column-major;
* :func:`transpose_fp8`: a tiled byte transpose (PyTorch's strided copy of 1-byte elements is several times slower).

Dequantization scales (what ``torch._scaled_mm`` takes) are returned: the fp32 reciprocals of the scales.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_moe.lowp.fp8_grouped import EPS, fp8_scale

__all__ = ["E4M3", "E5M2", "cast_colwise", "cast_rowwise", "cast_tensorwise", "transpose_fp8"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _tensor_scale(x: Tensor, dtype: torch.dtype) -> Tensor:
    """torchao's tensorwise scale: max / amax in float64, as fp32 (not rounded)."""
    amax = x.detach().abs().amax().double()
    return (torch.finfo(dtype).max / torch.clamp(amax, min=EPS)).float()


def _cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    m = torch.finfo(dtype).max
    return (x.detach().float() * scale).clamp(-m, m).to(dtype)


def cast_tensorwise(x_MN: Tensor, dtype: torch.dtype, *, rows: bool = True,
                    cols: bool = False) -> tuple[Optional[Tensor], Optional[Tensor], Tensor]:
    """torchao's tensorwise FP8 cast of ``x_MN`` ([M, N]; one scale, ``max / amax``, not rounded): (q row-major or
    None, q column-major or None, the fp32 dequantization scale, a 0-dim tensor). With the Triton kernels
    (:func:`lightning_moe.moe.kernels.use_triton`) one amax reduction and one pass that writes both layouts from one
    read (``_fp8_dense_triton.tensorwise_cast_kernel``); else PyTorch ops, the same values."""
    from lightning_moe.moe import kernels

    x = x_MN.detach()
    if not kernels.use_triton(x):
        scale = _tensor_scale(x, dtype)
        q = _cast(x, scale, dtype)
        return q if rows else None, q.t().contiguous().t() if cols else None, scale.reciprocal()
    from lightning_moe.lowp import _fp8_dense_triton as k

    x = x.contiguous()
    M, N = x.shape
    amax = torch.linalg.vector_norm(x, float("inf"))  # max |x|, one reduction (exact in x's dtype)
    q_dtype = dtype if x.is_cuda else torch.float32  # the interpreter stores the FP8 values as fp32 (exact)
    q = torch.empty(M, N, device=x.device, dtype=q_dtype) if rows else None
    qt = torch.empty(N, M, device=x.device, dtype=q_dtype) if cols else None
    sinv = torch.empty((), device=x.device, dtype=torch.float32)
    if x.numel():
        mbits = 3 if dtype == E4M3 else 2
        min_step = 2.0 ** (-9 if dtype == E4M3 else -16)  # the subnormal step
        block_m, block_n = 64, 64
        k.tensorwise_cast_kernel[(-(-M // block_m), -(-N // block_n))](
            x, amax, q if rows else sinv, qt if cols else sinv, sinv, M, N, FP8_MAX=torch.finfo(dtype).max,
            STEP=2.0 ** -mbits, MIN_STEP=min_step, ROWS=rows, COLS=cols, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=4)
    else:
        sinv.copy_(_tensor_scale(x, dtype).reciprocal())
    if q_dtype != dtype:
        q = q.to(dtype) if rows else None
        qt = qt.to(dtype) if cols else None
    return q, qt.t() if cols else None, sinv


def cast_rowwise(x_MC: Tensor) -> tuple[Tensor, Tensor]:
    """x's e4m3 form scaled per row (torchao's rowwise-recipe scale, a power of two), row-major, and the rows' fp32
    dequantization scales [M]: one Triton kernel, a few rows per program (``_fp8_dense_triton``). Needs
    :func:`lightning_moe.moe.kernels.use_triton`."""
    from lightning_moe.lowp import _fp8_dense_triton as k

    x = x_MC.detach().contiguous()
    M, C = x.shape
    q_dtype = E4M3 if x.is_cuda else torch.float32  # the interpreter stores the FP8 values as fp32 (exact)
    q = torch.empty(M, C, device=x.device, dtype=q_dtype)
    sinv = torch.empty(M, device=x.device, dtype=torch.float32)
    if x.numel():
        block_c = min(1024, max(16, 1 << (C - 1).bit_length()))
        block_r = max(1, 4096 // block_c)
        k.rowwise_cast_kernel[(-(-M // block_r),)](x, q, sinv, M, C, BLOCK_R=block_r, BLOCK_C=block_c,
                                                   num_warps=8 if block_r * block_c >= 4096 else 4)
    return (q if q_dtype == E4M3 else q.to(E4M3)), sinv


def transpose_fp8(q_MC: Tensor) -> Tensor:
    """A row-major copy of ``q.T`` ([C, M]) for 1-byte FP8 data: a tiled Triton transpose where the kernels run
    (PyTorch's strided copy of 1-byte elements is several times slower), else PyTorch's."""
    from lightning_moe.moe import kernels

    if not kernels.use_triton(q_MC) or q_MC.element_size() != 1:
        return q_MC.t().contiguous()
    from lightning_moe.lowp import _fp8_dense_triton as k

    x = q_MC.contiguous().view(torch.uint8)
    M, C = x.shape
    y = torch.empty(C, M, device=x.device, dtype=torch.uint8)
    if x.numel():
        k.transpose_kernel[(-(-M // 64), -(-C // 64))](x, y, M, C, BLOCK=64, num_warps=4)
    return y.view(q_MC.dtype)


def cast_colwise(x_MC: Tensor) -> tuple[Tensor, Tensor]:
    """x's e4m3 form scaled per column (amax over M; torchao's rowwise-recipe scale, a power of two) as an [M, C]
    column-major tensor, and the columns' fp32 dequantization scales [C]: the rowwise weight gradient's operands. Two
    Triton kernels (a column amax split over M, a tiled cast writing the transposed layout), each filling the GPU at
    any shape (``_fp8_dense_triton``). Needs :func:`lightning_moe.moe.kernels.use_triton`."""
    from lightning_moe.lowp import _fp8_dense_triton as k

    x = x_MC.detach().contiguous()
    M, C = x.shape
    q_dtype = E4M3 if x.is_cuda else torch.float32  # the interpreter stores the FP8 values as fp32 (exact)
    amax = torch.zeros(C, device=x.device, dtype=torch.float32)
    qt = torch.empty(C, M, device=x.device, dtype=q_dtype)
    sinv = torch.empty(C, device=x.device, dtype=torch.float32)
    if x.numel():
        rows, block_m, block_c = 256, 32, 128
        k.colwise_amax_kernel[(-(-M // rows), -(-C // block_c))](x, amax.view(torch.int32), M, C, ROWS_PER_PROGRAM=rows,
                                                                BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
        k.colwise_cast_kernel[(-(-M // 64), -(-C // 64))](x, amax, qt, sinv, M, C, BLOCK_M=64, BLOCK_C=64,
                                                          num_warps=4)
    else:
        sinv.copy_(fp8_scale(amax).reciprocal())
    return (qt if q_dtype == E4M3 else qt.to(E4M3)).t(), sinv
