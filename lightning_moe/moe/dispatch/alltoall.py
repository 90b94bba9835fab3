"""AllToAllDispatcher: expert parallelism by all-to-all over ``ep`` (+ all-gather / reduce-scatter over ``etp``).

Legend: T local tokens, D hidden, k top-k, E global experts, e local experts (E / ep), R rows on this rank's
experts, P ep size, Q etp size; group layout in :mod:`lightning_moe.moe.dispatch.groups`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.collectives import all_gather_autograd, all_to_all_single_autograd, reduce_scatter_autograd
from lightning_moe.moe.dispatch.base import DispatchContext, _permute, _unpermute
from lightning_moe.moe.dispatch.groups import GroupLike, _gather_small, _GroupedDispatcher, _pad_rows
from lightning_moe.moe.dispatch.layout import (
    _capacity_slots,
    _exclusive_cumsum,
    _positions,
    _sort_by_expert,
    regroup_index,
)
from lightning_moe.moe.dispatch.rows import _Reindex
from lightning_moe.moe.router import RoutingResult


@dataclass
class _AllToAllState:
    send_splits: list[int]  # rows this rank sends to each ep peer (= returned to it in combine)
    recv_splits: list[int]  # rows this rank receives from each ep peer
    regroup_R: Tensor  # gather index: (etp-gathered) source-major buffer -> expert-major rows
    inverse_B: Tensor  # gather index back: expert-major rows -> buffer rows (Q * Rmax with etp)
    own_rows: int  # rows this rank received over ep (its slice of the etp buffer)
    max_rows: int  # Rmax: the largest etp peer's received rows (the etp all-gather pads to it)


class AllToAllDispatcher(_GroupedDispatcher):
    """Expert parallelism by all-to-all over ``ep`` (+ all-gather / reduce-scatter over ``etp``).

    ``AllToAllDispatcher(ep_group, etp_group=None, pad_to_capacity=False, num_local_experts=None)``; groups are
    ``ProcessGroup``s or 1-D ``DeviceMesh``es (``dims.expert_mesh["ep"]``, ``["etp"]``).

    dispatch: sort the kept assignments by global expert (= by destination rank) -> all_to_all of the per-expert
    counts (and an all-gather of the received [P, e] count matrix over etp) -> ONE host sync, the ``.tolist()``
    in :meth:`_exchange_counts` (split sizes must be Python ints) -> differentiable all_to_all_single of the rows
    (uneven, zero splits allowed) -> with etp: differentiable all-gather over etp, each peer's rows padded to the
    largest peer's count (the padding is never read) -> one gather regroups [etp peer][source][expert] to
    [expert][etp peer][source]. combine runs the same steps backwards (the inverse gather, reduce-scatter *sum*
    of the partial etp outputs, all_to_all back) and unpermutes with the probs on the source rank. The backward
    reuses the split sizes: no host sync. Without capacity the sort's counts need no sync either (no bincount).

    ``pad_to_capacity`` (only when ``routing.capacity`` is set): every source sends exactly ``capacity`` rows per
    expert (zero rows fill the unused slots; assignments past the capacity are dropped), so all split sizes are
    static: no count exchange and no host sync; each local expert receives ``capacity * ep * etp`` rows. Every rank
    of the ep and etp groups must then use the same capacity (same tokens per rank, as in Megatron).
    """

    overlaps = True

    def __init__(self, ep_group: GroupLike, etp_group: Optional[GroupLike] = None, pad_to_capacity: bool = False,
                 num_local_experts: Optional[int] = None) -> None:
        super().__init__(ep_group, etp_group, num_local_experts)
        self.pad_to_capacity = pad_to_capacity

    def _a2a(self, x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        if self.ep_size == 1:
            return x
        return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, self.ep_group)

    def _exchange_counts(self, counts_E: Tensor, e: int) -> tuple[list[int], list[list[list[int]]], Tensor]:
        """Send counts per ep peer, received count matrices of every etp peer [Q][P][e] (host), and the same
        matrix on the device. Holds the dispatcher's one host sync."""
        P, Q = self.ep_size, self.etp_size
        send_P = counts_E.view(P, e).sum(1)
        if P > 1:
            recv_Pe = torch.empty_like(counts_E)
            dist.all_to_all_single(recv_Pe, counts_E, group=self.ep_group)  # [source][local expert]
        else:
            recv_Pe = counts_E
        recv_QPe = _gather_small(recv_Pe, self.etp_group, Q) if Q > 1 else recv_Pe.unsqueeze(0)
        # THE host sync of the layer: split sizes of the collectives must be Python ints
        sizes = torch.cat([send_P, recv_QPe.reshape(-1)]).tolist()
        send = sizes[:P]
        flat = sizes[P:]
        recv = [[flat[(q * P + p) * e:(q * P + p + 1) * e] for p in range(P)] for q in range(Q)]
        return send, recv, recv_QPe.view(Q, P, e)

    def _dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int,
                  overlap: Optional[Callable[[], Any]]) -> tuple[Tensor, Tensor, DispatchContext]:
        E = num_experts
        e = self._local_experts(E)
        P, Q = self.ep_size, self.etp_size
        T, k = routing.expert_ids.shape
        ids_TK, order_A, counts_E1 = _sort_by_expert(routing, E)  # by global expert = by destination rank
        if self.pad_to_capacity and routing.capacity is not None:
            cap = int(routing.capacity)
            pos_TK, asg_R = _capacity_slots(ids_TK, order_A, counts_E1, E, cap)
            # [dest rank][local expert][cap]
            x_sent, ctx = _permute(x_TD, routing.probs, pos_TK, asg_R, True, False)
            send = recv_splits = [e * cap] * P
            recv_QPe = torch.full((Q, P, e), cap, dtype=torch.long, device=x_TD.device)
            rows_Q = [P * e * cap] * Q
        else:
            send, recv, recv_QPe = self._exchange_counts(counts_E1[:E], e)
            n_send = sum(send)
            A = order_A.numel()
            pos_TK = _positions(order_A, n_send, (T, k))
            x_sent, ctx = _permute(x_TD, routing.probs, pos_TK, order_A[:n_send], n_send < A, True)
            recv_splits = [sum(c) for c in recv[self.etp_rank]]
            rows_Q = [sum(sum(c) for c in recv[q]) for q in range(Q)]

        own = sum(recv_splits)
        rmax = max(rows_Q) if Q > 1 else own
        total = sum(rows_Q)
        rows_QP = recv_QPe.sum(2)
        base_QP = _exclusive_cumsum(rows_QP, 1) + torch.arange(Q, device=rows_QP.device).unsqueeze(1) * rmax
        regroup_R = regroup_index(recv_QPe.reshape(Q * P, e), base_QP.reshape(-1), total)
        # inverse map (buffer row -> expert-major row); padding rows of the etp buffer map to row 0: they are cut
        # off after the reduce-scatter / before the all-gather, so whatever they hold is never read
        inverse_B = torch.zeros(Q * rmax, dtype=torch.long, device=regroup_R.device)
        inverse_B.scatter_(0, regroup_R, torch.arange(total, device=regroup_R.device))
        ctx.extra = _AllToAllState(send, recv_splits, regroup_R, inverse_B, own, rmax)
        return self._to_experts(x_sent, ctx.extra, overlap), recv_QPe.sum((0, 1)), ctx

    def _to_experts(self, t_sent: Tensor, st: _AllToAllState, overlap: Optional[Callable[[], Any]] = None) -> Tensor:
        """Rows in send order -> this rank's expert-major rows: all_to_all over ep, all-gather over etp (each peer
        padded to Rmax), the regroup gather. Differentiable. ``overlap`` runs between the all-to-all's issue and
        the first read of its result (the etp all-gather reads it)."""
        t_recv = self._a2a(t_sent, st.recv_splits, st.send_splits)  # [source][local expert]
        if overlap is not None:
            overlap()
        if self.etp_size > 1:
            t_recv = all_gather_autograd(_pad_rows(t_recv, st.max_rows), 0, self.etp_group)  # [etp peer][rmax]
        return _Reindex.apply(t_recv, st.regroup_R, st.inverse_B)

    def _row_weights(self, ctx: DispatchContext) -> Tensor:
        # the sent rows' weights take the rows' way ([n, 1] fp32: 4 bytes a row beside the row's 2 * D)
        return self._to_experts(super()._row_weights(ctx).unsqueeze(1), ctx.extra).squeeze(1)

    def _combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        st: _AllToAllState = ctx.extra
        y_buf = _Reindex.apply(y_RD, st.inverse_B, st.regroup_R)
        if self.etp_size > 1:
            # partial outputs (F is split over etp): sum them and keep this rank's own rows
            y_recv = reduce_scatter_autograd(y_buf, "sum", 0, self.etp_group)[: st.own_rows]
        else:
            y_recv = y_buf
        y_sent = self._a2a(y_recv, st.send_splits, st.recv_splits)
        return _unpermute(y_sent, ctx)
