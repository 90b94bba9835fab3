"""Grouped-GEMM implementations: the one seam through which :class:`~lightning_moe.moe.experts.GroupedExperts`
multiplies its rows by its weights.

Legend: M rows, K contraction, N output, E groups (local experts).

An implementation is an object chosen when the model is built (the experts' ``grouped_mm=`` argument, or a model
transform such as :class:`~lightning_moe.callbacks.LowPrecisionTraining` through
:meth:`lightning_moe.moe.layer.MoELayer.replan`), never swapped in on the hot path. It says, as class attributes,
what the experts may do around it:

* ``exact_torch``: it computes exactly ``torch._grouped_mm``, so fused paths that call ``torch._grouped_mm``
  themselves (the experts gathering their own rows) give the same numbers;
* ``loop_fallback``: shapes the grouped kernel cannot take may run the per-expert loop of plain matmuls instead
  (with a warning); False for implementations whose numerics the loop would skip (low precision): those shapes are
  then a ValueError naming ``fallback_hint``.
* ``fused_fp8`` (an instance attribute: it depends on the recipe): it is the FP8 rowwise grouped GEMM and also offers
  the experts the fused steps of :mod:`lightning_moe.lowp.fp8_fused` (``swiglu_down``: the SwiGLU kernel quantizes
  the down projection's input; ``gather_gate_up``: the row gather quantizes the gate / up input), with the numbers
  of calling it on the high-precision operands. The MoE layer's plan decides once whether they are used
  (``MoELayerPlan.fp8_fused``).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import Tensor

__all__ = ["GroupedMM", "TorchGroupedMM"]


class GroupedMM:
    """``y[rows of group g] = x[rows of group g] @ w_EKN[g]``; ``offs_E`` int32 cumulative group ends. Inputs share
    one dtype; ``w_EKN`` is usually a transposed view of a contiguous [E, N, K] weight."""

    exact_torch: ClassVar[bool] = False
    loop_fallback: ClassVar[bool] = False
    fallback_hint: ClassVar[str] = "fix the shapes"
    fused_fp8: bool = False

    def swiglu_down(self, g_RF: Tensor, u_RF: Tensor, probs_R: Optional[Tensor], w_EKN: Tensor,
                    offs_E: Tensor) -> Tensor:
        """``self(swiglu(g, u, probs), w_EKN, offs_E)`` with the quantization inside the SwiGLU (``fused_fp8``)."""
        raise NotImplementedError(f"{self!r} has no fused FP8 steps (fused_fp8=False)")

    def gather_gate_up(self, x_TD: Tensor, asg_R: Tensor, pos_TK: Tensor, w1_EKN: Tensor, w3_EKN: Tensor,
                       offs_E: Tensor) -> tuple[Tensor, Tensor]:
        """The gate and up GEMMs of the rows ``x_TD[asg_R // k]``, quantized as they are gathered (``fused_fp8``)."""
        raise NotImplementedError(f"{self!r} has no fused FP8 steps (fused_fp8=False)")

    def __call__(self, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchGroupedMM(GroupedMM):
    """``torch._grouped_mm`` (the CPU kernel, CUTLASS on sm90 / sm100); see :mod:`lightning_moe.moe.experts` for
    the operand rules it needs."""

    exact_torch = True
    loop_fallback = True

    def __call__(self, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        return torch._grouped_mm(x_MK, w_EKN, offs=offs_E)
