"""Blockwise FP8 (DeepSeek-V3's recipe: 1x128 activation tiles, 128x128 weight blocks) for dense linears and the
routed experts' grouped GEMM: torchao 0.18's kernels on sm90 and an emulation with the same numerics that runs
anywhere (the reference the kernels are tested against, DESIGN invariant 7).

Legend: dense ``y_MN = x_MK @ w_NK.T``; grouped (``torch._grouped_mm``'s signature) ``x_MK``, ``w_EKN``, ``offs_E``.

Numerics (torchao 0.18 ``blockwise_fp8_training.linear.fp8_blockwise_mm`` and
``moe_training.blockwise_fp8._to_fp8_blockwise_then_scaled_grouped_mm``): every operand float8_e4m3fn, scale
``448 / amax`` (amax clamped at 1e-12, computed in float64, *not* rounded to a power of two), one scale per tile:

==========  ================================  ====================================================
GEMM        operand 1                         operand 2
==========  ================================  ====================================================
fprop       x: 1x128 along K                  w: 128x128 blocks
dgrad       dy: 1x128 along N                 w: the same 128x128 blocks (transposed)
wgrad       dy: 128x1 along the token dim     x: 128x1 along the token dim
==========  ================================  ====================================================

K and N must be multiples of 128. Grouped: each group's rows must start at a multiple of 128 so the wgrad's token
tiles stay inside one expert; :class:`~lightning_moe.callbacks.LowPrecisionGroupedMM` pads the groups
(:func:`~lightning_moe.lowp.fp8_grouped.pad_groups`, align 128) before calling either function. Products accumulate in
fp32 (the emulation dequantizes and runs fp32 GEMMs); outputs are returned in the input dtype.

On sm90 the grouped GEMM in torchao 0.18 runs DeepGEMM's kernels when the optional ``deep_gemm`` package is installed
and otherwise torchao's own fallback (Triton quantization, dequantized GEMM): slower than bf16, which the crossover
table (bench/fp8_crossover.py) measures, so ``recipe="auto"`` does not pick it there.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLOCK", "qdq_tiles", "emulated_fp8_blockwise_linear", "emulated_fp8_blockwise_grouped_mm",
           "fp8_blockwise_linear", "fp8_blockwise_grouped_mm"]

BLOCK = 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
EPS = 1e-12


def qdq_tiles(x: Tensor, rows: int, cols: int) -> Tensor:
    """FP8 e4m3 quantize-dequantize of the last two dims of ``x`` with one scale per ``rows x cols`` tile (zero
    padded at the edges: zeros change no amax); fp32 result of ``x``'s shape."""
    *lead, r, c = x.shape
    rb, cb = -(-r // rows), -(-c // cols)
    xf = torch.nn.functional.pad(x.detach().float(), (0, cb * cols - c, 0, rb * rows - r))
    t = xf.reshape(*lead, rb, rows, cb, cols)
    amax = t.abs().amax(dim=(-3, -1), keepdim=True)
    scale = (E4M3_MAX / amax.double().clamp(min=EPS)).float()
    q = (t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() / scale
    return q.reshape(*lead, rb * rows, cb * cols)[..., :r, :c]


def _check_dims(K: int, N: int, what: str) -> None:
    if K % BLOCK or N % BLOCK:
        raise ValueError(f"{what}: FP8 blockwise needs K and N multiples of {BLOCK}, got K={K}, N={N}; keep this "
                         "GEMM in high precision (keep_bf16) or use fp8_rowwise")


class _EmulatedBlockwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: Tensor, w_NK: Tensor) -> Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        return (qdq_tiles(x_MK, 1, BLOCK) @ qdq_tiles(w_NK, BLOCK, BLOCK).t()).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        x_MK, w_NK = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (qdq_tiles(dy_MN, 1, BLOCK) @ qdq_tiles(w_NK, BLOCK, BLOCK)).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = (qdq_tiles(dy_MN, BLOCK, 1).t() @ qdq_tiles(x_MK, BLOCK, 1)).to(w_NK.dtype)
        return dx, dw


def emulated_fp8_blockwise_linear(x: Tensor, w_NK: Tensor) -> Tensor:
    """``x @ w.T`` (x: [..., K]) with the blockwise numerics of the module docstring, in fp32 emulation."""
    _check_dims(w_NK.shape[1], w_NK.shape[0], "fp8_blockwise linear")
    y = _EmulatedBlockwiseLinear.apply(x.reshape(-1, x.shape[-1]), w_NK)
    return y.reshape(*x.shape[:-1], w_NK.shape[0])


def fp8_blockwise_linear(x: Tensor, w_NK: Tensor) -> Tensor:
    """torchao 0.18's blockwise FP8 linear (sm90: ``torch._scaled_mm`` with 1x128 / 128x128 scales). Its wgrad tiles
    the tokens by 128 and it refuses other counts, so the tokens are zero-padded to a multiple of 128 first (a
    validation batch, a short sequence): zero rows change no tile's amax, add nothing to the weight gradient and are
    sliced off the output, which is what the emulation's edge padding computes."""
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    _check_dims(w_NK.shape[1], w_NK.shape[0], "fp8_blockwise linear")
    x_MK = x.reshape(-1, x.shape[-1])
    M = x_MK.shape[0]
    pad = -M % BLOCK
    if pad:
        x_MK = torch.nn.functional.pad(x_MK, (0, 0, 0, pad))
    y_MN = fp8_blockwise_mm.apply(x_MK, w_NK, BLOCK, x.dtype, False)
    return y_MN[:M].reshape(*x.shape[:-1], w_NK.shape[0])


class _EmulatedBlockwiseGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        ctx.save_for_backward(x_MK, w_EKN, offs_E)
        return torch._grouped_mm(qdq_tiles(x_MK, 1, BLOCK), qdq_tiles(w_EKN, BLOCK, BLOCK), offs=offs_E).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        x_MK, w_EKN, offs_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_q = qdq_tiles(w_EKN, BLOCK, BLOCK).transpose(-2, -1)
            dx = torch._grouped_mm(qdq_tiles(dy_MN, 1, BLOCK), w_q, offs=offs_E).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            # token tiles of 128 rows: inside one group because groups start at multiples of 128 (padded)
            xq, dq = qdq_tiles(x_MK, BLOCK, 1), qdq_tiles(dy_MN, BLOCK, 1)
            dw = torch._grouped_mm(xq.t(), dq, offs=offs_E).to(w_EKN.dtype)
        return dx, dw, None


def emulated_fp8_blockwise_grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` with the blockwise numerics of the module docstring, in fp32
    emulation; groups must start at multiples of 128 (see the module docstring)."""
    _check_dims(w_EKN.shape[1], w_EKN.shape[2], "fp8_blockwise grouped GEMM")
    return _EmulatedBlockwiseGroupedMM.apply(x_MK, w_EKN, offs_E)


def fp8_blockwise_grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """torchao 0.18's blockwise FP8 grouped GEMM (sm90; groups already padded to multiples of 128)."""
    from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import _to_fp8_blockwise_then_scaled_grouped_mm

    _check_dims(w_EKN.shape[1], w_EKN.shape[2], "fp8_blockwise grouped GEMM")
    return _to_fp8_blockwise_then_scaled_grouped_mm(x_MK, w_EKN, offs_E, out_dtype=x_MK.dtype,
                                                    pad_token_groups_for_grouped_mm=False)
