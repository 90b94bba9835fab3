"""AllGatherDispatcher: expert parallelism by all-gathering the tokens over ``ep`` (and ``etp``).

Legend: T local tokens, D hidden, k top-k, E global experts, e local experts (E / ep), R rows on this rank's
experts, P ep size, Q etp size; group layout in :mod:`lightning_moe.moe.dispatch.groups`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_moe.collectives import all_gather_autograd, reduce_scatter_autograd
from lightning_moe.moe.dispatch.base import DispatchContext, _permute, _unpermute
from lightning_moe.moe.dispatch.groups import _gather_small, _GroupedDispatcher, _pad_rows
from lightning_moe.moe.dispatch.layout import _count, _positions
from lightning_moe.moe.router import RoutingResult


class AllGatherDispatcher(_GroupedDispatcher):
    """Expert parallelism by all-gathering tokens: ``AllGatherDispatcher(ep_group, etp_group=None,
    num_local_experts=None)``; groups are ``ProcessGroup``s or 1-D ``DeviceMesh``es.

    dispatch: exchange (T, per-expert counts) over ep and etp -> ONE host sync (the ``.tolist()`` in
    :meth:`dispatch`) -> pad x and [probs | ids] to the largest T, differentiable all-gather over ep, then over
    etp (layout [etp peer][ep peer][token]) -> every rank permutes the gathered assignments of its local experts.
    combine: weighted unpermute into the gathered layout, then reduce-scatter (sum) over etp (sums the partial F
    outputs) and over ep (sums the experts' contributions) back to the owners. Suits small ep: the gathered tokens
    and the unpermute's work grow with ep * etp; the backward of each all-gather is a reduce-scatter and vice versa.
    """

    overlaps = True

    def _gather(self, t: Tensor) -> Tensor:
        if self.ep_size > 1:
            t = all_gather_autograd(t.contiguous(), 0, self.ep_group)
        if self.etp_size > 1:
            t = all_gather_autograd(t.contiguous(), 0, self.etp_group)
        return t

    def _dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int,
                  overlap: Optional[Callable[[], Any]]) -> tuple[Tensor, Tensor, DispatchContext]:
        E = num_experts
        e = self._local_experts(E)
        P, Q = self.ep_size, self.etp_size
        T, k = routing.expert_ids.shape
        dev = x_TD.device
        ids_TK = routing.expert_ids
        if routing.keep_mask is not None:
            ids_TK = torch.where(routing.keep_mask, ids_TK, torch.full_like(ids_TK, E))
        counts_E = _count(ids_TK.reshape(-1), E + 1)[:E]
        info = torch.cat([torch.full((1,), T, dtype=torch.long, device=dev), counts_E])
        if P > 1:
            info = _gather_small(info, self.ep_group, P).view(-1)
        if Q > 1:
            info = _gather_small(info, self.etp_group, Q).view(-1)
        # THE host sync of the layer: token counts (gather padding) and this rank's row count
        sizes = info.view(Q * P, 1 + E).tolist()
        t_max = max(s[0] for s in sizes)
        lo = self.ep_rank * e
        rows = sum(sum(s[1 + lo:1 + lo + e]) for s in sizes)

        # ids travel with the probs as fp32 (exact below 2**24); padding tokens get id E (routed nowhere)
        meta_TM = torch.cat([routing.probs.float(), ids_TK.to(torch.float32)], dim=1)
        if t_max > T:
            pad_meta = torch.cat(
                [meta_TM.new_zeros(t_max - T, k), meta_TM.new_full((t_max - T, k), float(E))], dim=1
            )
            meta_TM = torch.cat([meta_TM, pad_meta], dim=0)
        meta_g = self._gather(meta_TM)
        x_g = self._gather(_pad_rows(x_TD, t_max))
        if overlap is not None:  # the rows' gather is issued (over etp it waited for the ep gather: still in flight)
            overlap()
        probs_g = meta_g[:, :k]
        local_g = meta_g[:, k:].detach().long() - lo
        local_g = torch.where((local_g >= 0) & (local_g < e), local_g, torch.full_like(local_g, e))
        order_A = torch.argsort(local_g.reshape(-1), stable=True)
        counts_e1 = _count(local_g.reshape(-1), e + 1)
        A = order_A.numel()
        pos_TK = _positions(order_A, rows, local_g.shape)
        x_RD, ctx = _permute(x_g, probs_g, pos_TK, order_A[:rows], rows < A, True)
        ctx.extra = T
        return x_RD, counts_e1[:e], ctx

    # the inherited _row_weights: ctx holds the gathered probs, so every rank has its rows' weights

    def _combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        y = _unpermute(y_RD, ctx)  # [Q][P][t_max]
        if self.etp_size > 1:
            y = reduce_scatter_autograd(y, "sum", 0, self.etp_group)
        if self.ep_size > 1:
            y = reduce_scatter_autograd(y, "sum", 0, self.ep_group)
        return y[: ctx.extra]
