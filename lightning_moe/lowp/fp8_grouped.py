"""FP8 rowwise grouped GEMM for the routed experts (behind ``LowPrecisionGroupedMM``, a
:class:`~lightning_moe.moe.grouped_mm.GroupedMM`): torchao's kernel on sm90 and an emulation with the same numerics
that runs anywhere (CPU tests).

Legend: M rows (grouped by expert), K contraction, N output, E groups (local experts); ``offs_E`` int32 group ends.

Numerics (those of torchao 0.18's ``_to_fp8_rowwise_then_scaled_grouped_mm``; every operand float8_e4m3fn, also the
gradients, with dynamic scales ``448 / amax`` rounded down to a power of two, amax clamped at 1e-12):

* forward ``y = x @ w[g]``: x scaled per row (amax over K), w per (expert, output column n) (amax over K);
* input gradient ``dx = dy @ w[g].T``: dy per row (amax over N), w per (expert, k) (amax over N);
* weight gradient ``dw[g] = x[g].T @ dy[g]``: x per (group, k) and dy per (group, n), amax over the group's rows.

Products are accumulated in fp32 (the emulation dequantizes and runs an fp32 ``torch._grouped_mm``); outputs are
returned in the input dtype. The FP8 grouped GEMM needs every group's row count to be a multiple of 16:
:func:`pad_groups` moves each group to a 16-aligned start inside a zero buffer of a size known from the shapes
alone (``M + E * 15`` rounded up), with index_copy / index_select, so no host sync is needed; zero rows change no
amax, so padding does not change the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["E4M3_MAX", "emulated_dgrad", "emulated_fp8_rowwise_grouped_mm", "emulated_wgrad", "fp8_rowwise_grouped_mm",
           "grouped_mm_padded", "pad_groups", "pad_layout", "qdq_fp8", "quantize_rowwise"]

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
EPS = 1e-12


def fp8_scale(amax: Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> Tensor:
    """torchao's ``amax_to_scale`` with ``round_scales_to_power_of_2=True``: fp8_max / amax (in float64), rounded
    down to a power of two, as fp32."""
    s = (torch.finfo(dtype).max / torch.clamp(amax.double(), min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def qdq_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> Tensor:
    """Quantize ``x * scale`` to ``dtype`` (saturating) and dequantize back: fp32 values an FP8 GEMM would see."""
    m = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-m, m).to(dtype).float() / scale


def _qdq_along(x: Tensor, dim: int) -> Tensor:
    """Per-slice FP8 quantize-dequantize with the amax taken along ``dim``."""
    return qdq_fp8(x, fp8_scale(x.detach().abs().float().amax(dim=dim, keepdim=True)))


def _group_ids(offs_E: Tensor, m: int) -> Tensor:
    """Group index of each of ``m`` rows (E for rows past the last group)."""
    rows = torch.arange(m, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows, right=True)


def _qdq_per_group_cols(x_MC: Tensor, gid_M: Tensor, num_groups: int) -> Tensor:
    """Quantize-dequantize with one scale per (group, column): the amax over the group's rows."""
    xa = x_MC.detach().abs().float()
    amax = xa.new_zeros(num_groups + 1, x_MC.shape[1]).scatter_reduce_(0, gid_M[:, None].expand_as(xa), xa, "amax")
    return qdq_fp8(x_MC, fp8_scale(amax)[gid_M])


def emulated_dgrad(dy_MN: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """``dx = dy @ w[g].T`` in fp32 on FP8 operands: dy rowwise over N, w per (e, k) over N."""
    return torch._grouped_mm(_qdq_along(dy_MN, -1), _qdq_along(w_EKN, -1).transpose(-2, -1), offs=offs_E)


def emulated_wgrad(x_MK: Tensor, dy_MN: Tensor, offs_E: Tensor, num_groups: int) -> Tensor:
    """``dw[g] = x[g].T @ dy[g]`` ([E, K, N], fp32) on FP8 operands scaled per (group, column) over the group's rows."""
    gid = _group_ids(offs_E, x_MK.shape[0])
    xq = _qdq_per_group_cols(x_MK, gid, num_groups)
    dq = _qdq_per_group_cols(dy_MN, gid, num_groups)
    return torch._grouped_mm(xq.t(), dq, offs=offs_E)


class _EmulatedFp8RowwiseGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        ctx.save_for_backward(x_MK, w_EKN, offs_E)
        y = torch._grouped_mm(_qdq_along(x_MK, -1), _qdq_along(w_EKN, -2), offs=offs_E)
        return y.to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        x_MK, w_EKN, offs_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = emulated_dgrad(dy_MN, w_EKN, offs_E).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = emulated_wgrad(x_MK, dy_MN, offs_E, w_EKN.shape[0]).to(w_EKN.dtype)
        return dx, dw, None


def quantize_rowwise(x_MK: Tensor, q_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """The reference of the fused quantizers (:func:`lightning_moe.moe.kernels.swiglu_quant_rowwise`,
    ``gather_quant_rowwise``): per-row e4m3 values ``q`` (in ``q_dtype``; float32 holds them exactly) and fp32
    dequantization scales ``s`` [M] (``q * s[:, None]`` is :func:`qdq_fp8` of x with its rowwise scale)."""
    scale = fp8_scale(x_MK.detach().abs().float().amax(dim=-1, keepdim=True)) if x_MK.shape[0] else \
        x_MK.new_ones(0, 1, dtype=torch.float32)
    q = (x_MK.detach().float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(q_dtype)
    return q, (1.0 / scale).squeeze(-1)


def emulated_fp8_rowwise_grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` with the FP8 rowwise numerics of the module docstring (fp32 GEMMs on
    dequantized operands; any device, any group sizes)."""
    return _EmulatedFp8RowwiseGroupedMM.apply(x_MK, w_EKN, offs_E)


def fp8_rowwise_grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """torchao 0.18's FP8 rowwise grouped GEMM (sm90; groups must already be 16-aligned: see :func:`pad_groups`)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(x_MK, w_EKN, offs_E, out_dtype=x_MK.dtype,
                                                  pad_token_groups_for_grouped_mm=False)


def pad_layout(offs_E: Tensor, M: int, align: int) -> tuple[int, Tensor, Tensor]:
    """Where :func:`pad_groups` puts each row: (P, padded group ends int32, dest_M: the padded row of each input row),
    from shapes and device tensors only (no host sync)."""
    E = offs_E.numel()
    P = -(-(M + E * (align - 1)) // align) * align
    ends = offs_E.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    pad_counts = (counts + align - 1) // align * align
    pad_ends = torch.cumsum(pad_counts, 0)
    # shift of group g's rows = padded start - start; rows past the last group follow the last padded group
    shift = torch.cat([pad_ends - pad_counts - (ends - counts), (pad_ends[-1:] - ends[-1:])])
    rows = torch.arange(M, device=offs_E.device)
    return P, pad_ends.to(torch.int32), rows + shift[_group_ids(offs_E, M)]


def pad_groups(x_MK: Tensor, offs_E: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each group's rows moved to a start that is a multiple of ``align`` in a zero buffer of ``P`` rows, P =
    ``M + E * (align - 1)`` rounded up to ``align`` (from shapes only: no host sync). Returns (x_PK, padded group
    ends int32, dest_M: the padded row of each input row). Rows past the last group go after the last padded group.
    Differentiable (index_copy)."""
    P, pad_ends, dest = pad_layout(offs_E, x_MK.shape[0], align)
    x_PK = x_MK.new_zeros(P, x_MK.shape[1]).index_copy(0, dest, x_MK)
    return x_PK, pad_ends, dest


def grouped_mm_padded(fn, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, align: int) -> Tensor:
    """``fn(x, w, offs)`` on groups padded to multiples of ``align`` (:func:`pad_groups`), unpadded after."""
    x_PK, offs_pad, dest = pad_groups(x_MK, offs_E, align)
    return fn(x_PK, w_EKN, offs_pad).index_select(0, dest)
