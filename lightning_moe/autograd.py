"""Small autograd helpers shared by the MoE layer, the experts and context parallelism."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["contiguous_grad", "contiguous_grad_", "in_backward"]


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def contiguous_grad(x: Tensor) -> Tensor:
    """Identity whose backward makes the incoming gradient contiguous. Kernels downstream in backward reject
    strided gradients: the grouped GEMM an expanded stride-0 one (``y.sum().backward()``), the all-gather's
    reduce-scatter (torch 2.11) the permuted one context parallelism produces."""
    return _ContiguousGrad.apply(x)


def contiguous_grad_(x: Tensor) -> Tensor:
    """:func:`contiguous_grad` in place: a gradient hook on ``x`` itself, so ``x`` stays what it was (not a view;
    FSDP2 warns about modules that return views). Returns ``x``."""
    if x.requires_grad:
        x.register_hook(torch.Tensor.contiguous)
    return x


def in_backward() -> bool:
    """True while the autograd engine runs (e.g. activation-checkpoint recomputation of the forward): state that
    counts forwards (expert-bias demand, routing statistics) must not count such a re-run again."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn is not None and fn() != -1
