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
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

__all__ = ["GroupedMM", "TorchGroupedMM"]


class GroupedMM:
    """``y[rows of group g] = x[rows of group g] @ w_EKN[g]``; ``offs_E`` int32 cumulative group ends. Inputs share
    one dtype; ``w_EKN`` is usually a transposed view of a contiguous [E, N, K] weight."""

    exact_torch: ClassVar[bool] = False
    loop_fallback: ClassVar[bool] = False
    fallback_hint: ClassVar[str] = "fix the shapes"

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
