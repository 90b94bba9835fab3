"""Token dispatchers: move routed rows to the rank that holds their expert and back.

Legend: T local tokens, D hidden, k top-k, E global experts, e local experts, R rows on this rank's experts.
The MoE layer holds one dispatcher object; parallelize swaps the local one for a distributed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_moe.moe.permute import pad_groups, permute, sort_assignments, unpermute
from lightning_moe.moe.router import RoutingResult


@dataclass
class DispatchContext:
    """What combine needs to undo dispatch (opaque to the layer)."""

    num_tokens: int
    order_R: Tensor
    probs_TK: Tensor
    pad_dest_R: Optional[Tensor] = None
    extra: Any = None


class TokenDispatcher:
    """Interface: ``dispatch`` returns rows grouped by local expert with per-local-expert counts (int64, [e]);
    ``combine`` returns ``y_TD[t] = sum_k probs[t, k] * y(t, k)``."""

    num_local_experts: Optional[int] = None

    def dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int) -> tuple[Tensor, Tensor, DispatchContext]:
        raise NotImplementedError

    def combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        raise NotImplementedError


class LocalDispatcher(TokenDispatcher):
    """All experts on this process: permute by expert, unpermute with the combine weights."""

    def dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int) -> tuple[Tensor, Tensor, DispatchContext]:
        k = routing.expert_ids.shape[1]
        order_R, counts_E = sort_assignments(routing.expert_ids, routing.keep_mask, num_experts)
        x_RD = permute(x_TD, order_R, k)
        ctx = DispatchContext(num_tokens=x_TD.shape[0], order_R=order_R, probs_TK=routing.probs)
        if routing.capacity is not None and self.pad_to_capacity:
            x_RD, ctx.pad_dest_R = pad_groups(x_RD, counts_E, routing.capacity)
            counts_E = torch.full_like(counts_E, routing.capacity)
        return x_RD, counts_E, ctx

    def combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        if ctx.pad_dest_R is not None:
            y_RD = y_RD.index_select(0, ctx.pad_dest_R)
        return unpermute(y_RD, ctx.order_R, ctx.probs_TK, ctx.num_tokens)

    def __init__(self, pad_to_capacity: bool = False) -> None:
        self.pad_to_capacity = pad_to_capacity
