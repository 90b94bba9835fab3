"""The router's logits GEMM in fp32 precision on bf16 tensor cores (CUDA), instead of an fp32 CUDA-core GEMM.

Legend: T tokens, D hidden, E experts.

The router keeps an fp32 weight (DESIGN: routing state stays fp32) while activations are bf16 under bf16-true, so
``F.linear(x.float(), w)`` runs an fp32 GEMM on CUDA cores (~0.4 ms fwd+bwd per Qwen3-30B-A3B layer of 16k tokens on
an H200, 5% of the MoE layer) and keeps an fp32 copy of x for the backward. Here the fp32 operands are split into
two bf16 terms, ``w = w_hi + w_lo`` (``w_hi = bf16(w)``, ``w_lo = bf16(w - w_hi)``: 16 of fp32's 24 significand
bits), and every product runs on tensor cores with fp32 accumulation (``torch.mm(..., out_dtype=torch.float32)``):

* forward ``logits = x @ w_hi.T + x @ w_lo.T``: x is exact in bf16, so the only error is w's truncation to 16 bits
  (relative 2**-17 per term, below the fp32 GEMM's own accumulation error at D = 2048 and beyond);
* input gradient ``dx = g_hi @ w_hi + g_hi @ w_lo + g_lo @ w_hi`` (the g_lo @ w_lo term is 2**-34 relative);
* weight gradient ``dw = g_hi.T @ x + g_lo.T @ x``, fp32.

Each sum of GEMMs is one GEMM over operands stacked along N or K (the stacked operands are [T, 2E] / [T, 3E] and
[2E, D] / [3E, D] bf16: small copies). The backward keeps bf16 x (shared with the norm output that produced it)
instead of an fp32 copy. Used for bf16 CUDA inputs and a plain fp32 weight unless ``LIGHTNING_MOE_KERNELS=torch``;
CPU and other dtypes take the reference ``F.linear`` in fp32. ``mm_f32`` falls back to an fp32 matmul where
``out_dtype`` has no kernel (CPU), so the tests run the same algebra.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_moe.moe import kernels

__all__ = ["router_logits", "split_bf16", "mm_f32"]


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of bf16 operands with an fp32 result (fp32 accumulation): tensor cores on CUDA, an fp32 matmul
    elsewhere (bf16 products are exact in fp32, so only the summation order differs)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def split_bf16(t: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 ``t`` as ``hi + lo`` with both bf16 (hi = bf16(t), lo = bf16(t - hi))."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


class _SplitBF16Linear(torch.autograd.Function):
    """``x @ w.T`` in fp32 from bf16 ``x`` [T, D] and fp32 ``w`` [E, D] on bf16 GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, w_ED: Tensor) -> Tensor:
        E = w_ED.shape[0]
        w_hi, w_lo = split_bf16(w_ED)
        ctx.save_for_backward(x_TD, w_hi, w_lo)
        out_T2E = mm_f32(x_TD, torch.cat([w_hi, w_lo], 0).t())
        return out_T2E[:, :E] + out_T2E[:, E:]

    @staticmethod
    def backward(ctx, g_TE: Tensor):
        x_TD, w_hi, w_lo = ctx.saved_tensors
        E = w_hi.shape[0]
        g_hi, g_lo = split_bf16(g_TE.float())
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # [g_hi, g_hi, g_lo] @ [w_hi; w_lo; w_hi]: one GEMM over K = 3E
            grad_x = mm_f32(torch.cat([g_hi, g_hi, g_lo], 1), torch.cat([w_hi, w_lo, w_hi], 0)).to(x_TD.dtype)
        if ctx.needs_input_grad[1]:
            part_2ED = mm_f32(torch.cat([g_hi, g_lo], 1).t(), x_TD)
            grad_w = part_2ED[:E] + part_2ED[E:]
        return grad_x, grad_w


def use_split_bf16(x_TD: Tensor, w_ED: Tensor) -> bool:
    """Whether :func:`router_logits` takes the bf16 tensor-core path for these operands."""
    return (x_TD.is_cuda and x_TD.dtype == torch.bfloat16 and w_ED.dtype == torch.float32
            and not isinstance(w_ED, DTensor) and not isinstance(x_TD, DTensor) and kernels.backend() != "torch")


@torch.compiler.disable
def _split_linear(x_TD: Tensor, w_ED: Tensor) -> Tensor:
    # Eager even inside a compiled region (a graph break): the split relies on ``mm(..., out_dtype=float32)`` keeping
    # every bf16 x bf16 product in an fp32 accumulator, which a compiler lowering may not preserve.
    return _SplitBF16Linear.apply(x_TD.to(torch.bfloat16), w_ED.float())


def router_logits(x_TD: Tensor, w_ED: Tensor, split: bool | None = None) -> Tensor:
    """fp32 logits ``x @ w.T`` [T, E] (autocast off). ``split`` None: :func:`use_split_bf16` decides; True forces
    the split-bf16 algebra (tests: on CPU it runs fp32 matmuls of the bf16 terms)."""
    if split is None:
        # a compiled region keeps the fp32 GEMM: inductor's is as fast as the split one there (measured on an H200:
        # 0.29 / 0.74 ms fwd / bwd at T 16384, D 2048, E 128, against 0.29 / 0.95 for the split one behind a graph
        # break, which the split needs: a lowering may not keep mm(out_dtype=float32)'s fp32 accumulation)
        split = use_split_bf16(x_TD, w_ED) and not torch.compiler.is_compiling()
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        if split:
            return _split_linear(x_TD, w_ED)
        return F.linear(x_TD.float(), w_ED.float())
