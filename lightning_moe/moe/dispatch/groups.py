"""What the distributed dispatchers share: process groups (a ``ProcessGroup`` or a 1-D ``DeviceMesh``), the ep /
etp bookkeeping of :class:`_GroupedDispatcher`, and small collectives.

Experts are split contiguously over ``ep`` (group rank r holds experts ``[r*e, (r+1)*e)``); the ranks of one
``etp`` group hold the same local experts, each a slice of F, and produce partial outputs that sum to the expert's
output (the down projection contracts over F).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.collectives import all_gather_into
from lightning_moe.moe.dispatch.base import TokenDispatcher

try:  # a 1-D DeviceMesh is accepted wherever a group is
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without device_mesh
    DeviceMesh = ()  # type: ignore[assignment,misc]

GroupLike = Union["dist.ProcessGroup", "DeviceMesh"]


def _as_group(group: Optional[GroupLike], name: str) -> Optional[dist.ProcessGroup]:
    if group is None:
        return None
    if DeviceMesh and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{name} must be a 1-D DeviceMesh (e.g. mesh['{name.split('_')[0]}']), got {group.ndim}-D")
        return group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
    return group


def _gather_small(t: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """Non-differentiable all-gather of a small tensor: [size, *t.shape]."""
    out = t.new_empty((size * t.shape[0],) + tuple(t.shape[1:]))
    all_gather_into(out, t.contiguous(), group=group)
    return out.view((size,) + tuple(t.shape))


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])], dim=0)


class _GroupedDispatcher(TokenDispatcher):
    """Common group bookkeeping of the distributed dispatchers (each can hand the rows their weights)."""

    supports_expert_weights = True

    def __init__(self, ep_group: GroupLike, etp_group: Optional[GroupLike] = None,
                 num_local_experts: Optional[int] = None) -> None:
        pg = _as_group(ep_group, "ep_group")
        if pg is None:
            raise ValueError("ep_group is required (use LocalDispatcher without expert parallelism)")
        self.ep_group = pg
        self.ep_size = dist.get_world_size(pg)
        self.ep_rank = dist.get_rank(pg)
        etp = _as_group(etp_group, "etp_group")
        self.etp_size = dist.get_world_size(etp) if etp is not None else 1
        # an etp group of one rank is no etp
        self.etp_group = etp if self.etp_size > 1 else None
        self.etp_rank = dist.get_rank(etp) if self.etp_group is not None else 0
        self.num_local_experts = num_local_experts
        self._fixed_local_experts = num_local_experts  # checked against E / ep when given

    def _local_experts(self, num_experts: int) -> int:
        if num_experts % self.ep_size != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the ep size {self.ep_size}: choose ep dividing E"
            )
        e = num_experts // self.ep_size
        if self._fixed_local_experts is not None and self._fixed_local_experts != e:
            raise ValueError(
                f"{type(self).__name__} was set up for {self._fixed_local_experts} local experts, but "
                f"num_experts={num_experts} over ep={self.ep_size} gives {e}"
            )
        self.num_local_experts = e
        return e

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ep={self.ep_size}, etp={self.etp_size})"
