"""Functional collectives (used by the dispatchers and context parallelism) under the names of the torch version at hand.

torch >= 2.12 names the functional all-gather / reduce-scatter ``*_single[_autograd]`` and deprecates the
``*_tensor[_autograd]`` spelling (a FutureWarning per call); torch 2.11 has only the latter.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

__all__ = ["all_gather", "all_gather_autograd", "reduce_scatter_autograd", "all_gather_into", "wait"]

all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
reduce_scatter_autograd = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wait(t: Tensor) -> Tensor:
    """The result of a functional collective, waited for."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
