"""Small autograd helpers shared by the MoE layer, the experts, context parallelism and recomputation."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch import Tensor

__all__ = ["contiguous_grad", "contiguous_grad_", "in_recomputation", "recompute_context"]


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


_recomputing = threading.local()  # the autograd engine re-runs a forward on its own thread (one per device)


def in_recomputation() -> bool:
    """True while a checkpoint built with :func:`recompute_context` re-runs its forward for the backward: state
    that counts forwards (expert-bias demand, routing statistics, offload scopes) must not count such a re-run."""
    return getattr(_recomputing, "depth", 0) > 0


@contextlib.contextmanager
def _replaying(default_dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    _recomputing.depth = getattr(_recomputing, "depth", 0) + 1
    try:
        yield
    finally:
        _recomputing.depth -= 1
        torch.set_default_dtype(old)


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant), called at the forward: the re-run
    marks itself (:func:`in_recomputation`) and runs under the forward's default dtype. Lightning's ``bf16-true``
    sets that dtype only around ``training_step``, and checkpoint does not restore it: the recomputation (in the
    backward) would make in fp32 what the forward made in bf16, e.g. the empty input-saver tensor of a nested
    checkpoint (torch 2.11; 2.13 has none), which the outer checkpoint then rejects ("Recomputed values for the
    following tensors have different metadata")."""
    return contextlib.nullcontext(), _replaying(torch.get_default_dtype())
