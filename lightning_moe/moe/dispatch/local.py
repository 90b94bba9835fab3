"""LocalDispatcher: all experts on this process (no expert parallelism)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_moe.moe.dispatch.base import DispatchContext, TokenDispatcher, WeightsAppliedBy, _unpermute
from lightning_moe.moe.dispatch.layout import _capacity_slots, _positions, _sort_by_expert
from lightning_moe.moe.dispatch.rows import _PermuteRows
from lightning_moe.moe.router import RoutingResult


class LocalDispatcher(TokenDispatcher):
    """All experts on this process: permute by expert, unpermute with the combine weights.

    One host sync only in capacity mode without padding (the number of kept rows sizes the output);
    ``pad_to_capacity`` pads every expert to ``routing.capacity`` rows (zeros) with no host sync."""

    supports_expert_weights = True

    def __init__(self, pad_to_capacity: bool = False) -> None:
        self.pad_to_capacity = pad_to_capacity

    def _dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int,
                  overlap: Optional[Callable[[], Any]]) -> tuple[Tensor, Tensor, DispatchContext]:
        counts_e, ctx = self._layout(routing, num_experts)
        rows = _PermuteRows.apply(x_TD, ctx.asg_R, ctx.pos_TK, ctx.has_dropped, ctx.rows_covered)
        return rows, counts_e, ctx

    def layout(self, routing: RoutingResult, num_experts: int, *,
               weights_applied_by: WeightsAppliedBy = "combine") -> tuple[Tensor, DispatchContext]:
        """``dispatch`` without moving rows: the counts and the context whose ``asg_R`` says which token each row
        is (``x_RD[r] = x_TD[asg_R[r] // k]``, zero rows where -1), for experts that gather the rows themselves."""
        self._check_dispatch(weights_applied_by)
        counts_e, ctx = self._layout(routing, num_experts)
        return counts_e, self._record(ctx, weights_applied_by)

    def _layout(self, routing: RoutingResult, num_experts: int) -> tuple[Tensor, DispatchContext]:
        E = num_experts
        self.num_local_experts = E
        T, k = routing.expert_ids.shape
        ids_TK, order_A, counts_E1 = _sort_by_expert(routing, E)
        counts_E = counts_E1[:E]
        if routing.capacity is not None and self.pad_to_capacity:
            cap = int(routing.capacity)
            pos_TK, asg_R = _capacity_slots(ids_TK, order_A, counts_E1, E, cap)
            return torch.full_like(counts_E, cap), DispatchContext(T, routing.probs, pos_TK, asg_R, True, False)
        A = order_A.numel()
        R = A if routing.keep_mask is None else int(counts_E.sum())  # host sync only in capacity mode
        pos_TK = _positions(order_A, R, (T, k))
        return counts_E, DispatchContext(T, routing.probs, pos_TK, order_A[:R], R < A, True)

    def _combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        return _unpermute(y_RD, ctx)

    def __repr__(self) -> str:
        return f"LocalDispatcher(pad_to_capacity={self.pad_to_capacity})"
