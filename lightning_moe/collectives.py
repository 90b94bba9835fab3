"""Functional collectives (used by the dispatchers, context parallelism and the loss / routing reductions) under the
names of the torch version at hand, settled at issue on CPU.

torch >= 2.12 names the functional all-gather / reduce-scatter ``*_single[_autograd]`` and deprecates the
``*_tensor[_autograd]`` spelling (a FutureWarning per call); torch 2.11 has only the latter.

On CPU tensors (gloo) every functional collective here is waited for before it returns: gloo corrupts the heap when
two functional collectives are in flight at once (``malloc(): unaligned tcache chunk detected`` or a SIGSEGV a few
thousand iterations in, torch 2.13.0; the same pattern through ``dist.*(async_op=True)`` works;
``tests/repro_gloo_two_in_flight.py`` shows it). On GPUs they stay asynchronous (an ``AsyncCollectiveTensor``, waited
at its first use), which is what lets the dispatchers overlap their collectives with the shared experts.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

__all__ = ["all_gather", "all_gather_autograd", "reduce_scatter_autograd", "all_to_all_single_autograd", "all_reduce",
           "all_gather_into", "wait", "settle"]

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter_autograd = (getattr(funcol, "reduce_scatter_single_autograd", None)
                            or funcol.reduce_scatter_tensor_autograd)
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wait(t: Tensor) -> Tensor:
    """The result of a functional collective, waited for."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def settle(t: Tensor) -> Tensor:
    """A functional collective's result as it may be handed on: waited for on CPU (gloo: at most one in flight),
    left in flight on an accelerator."""
    return wait(t) if t.device.type == "cpu" else t


def all_gather(t: Tensor, gather_dim: int, group) -> Tensor:
    """Non-differentiable all-gather along ``gather_dim``."""
    return settle(_all_gather(t, gather_dim, group))


def all_gather_autograd(t: Tensor, gather_dim: int, group) -> Tensor:
    """Differentiable all-gather along ``gather_dim`` (its backward is a reduce-scatter)."""
    return settle(_all_gather_autograd(t, gather_dim, group))


def reduce_scatter_autograd(t: Tensor, reduce_op: str, scatter_dim: int, group) -> Tensor:
    """Differentiable reduce-scatter along ``scatter_dim`` (its backward is an all-gather)."""
    return settle(_reduce_scatter_autograd(t, reduce_op, scatter_dim, group))


def all_to_all_single_autograd(t: Tensor, output_split_sizes: Optional[list[int]],
                               input_split_sizes: Optional[list[int]], group) -> Tensor:
    """Differentiable all-to-all of rows."""
    return settle(funcol.all_to_all_single_autograd(t, output_split_sizes, input_split_sizes, group))


def all_reduce(t: Tensor, reduce_op: str, group) -> Tensor:
    """Non-differentiable all-reduce."""
    return settle(funcol.all_reduce(t, reduce_op, group))
