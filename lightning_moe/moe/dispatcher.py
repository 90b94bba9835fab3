"""Token dispatchers: move routed rows to the rank that holds their expert and back.

Legend: T local tokens, D hidden, k top-k, E global experts, e local experts (E / ep), R rows on this rank's
experts, N = T*k assignments, P ep size, Q etp size, S = Q*P sources of rows for one rank's experts.
The MoE layer holds one dispatcher object; parallelize swaps the local one for a distributed one.

Contract (every dispatcher): ``x_RD, counts_e, ctx = dispatch(x_TD, routing, E)`` returns rows grouped by LOCAL
expert (expert-major; inside an expert, sources in rank order, tokens in their order) and int64 counts per local
expert on x's device; the experts map them to ``y_RD``; ``combine(y_RD, ctx)`` returns
``y_TD[t] = sum_k probs[t, k] * y(t, k)`` over kept assignments, on the rank that owns token t. Every step is
differentiable (x, probs, and through y the expert weights).

Distributed dispatchers take process groups (``ProcessGroup`` or a 1-D ``DeviceMesh``, e.g. ``mesh["ep"]``):
experts are split contiguously over ``ep`` (group rank r holds experts ``[r*e, (r+1)*e)``); the ranks of one
``etp`` group hold the same local experts, each a slice of F, and produce partial outputs that sum to the expert's
output (the down projection contracts over F).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from lightning_moe.moe.permute import pad_groups, permute, sort_assignments, unpermute
from lightning_moe.moe.router import RoutingResult

try:  # a 1-D DeviceMesh is accepted wherever a group is
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without device_mesh
    DeviceMesh = ()  # type: ignore[assignment,misc]

GroupLike = Union["dist.ProcessGroup", "DeviceMesh"]

# torch >= 2.12 renamed the autograd all-gather / reduce-scatter (the old names warn); 2.11 has only the old ones
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter_autograd = (
    getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
)
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class DispatchContext:
    """What combine needs to undo dispatch (opaque to the layer).

    num_tokens: rows of the combine output before any reduction (T, or the gathered token count).
    order_R: flat assignment indices (into the [num_tokens, k] view of probs) of the rows, in row order.
    probs_TK: combine weights (zero where an assignment must not contribute).
    pad_dest_R: LocalDispatcher's padded row of every real row (pad_to_capacity), else None.
    extra: the distributed dispatcher's own state (split sizes, regroup index, ...).
    """

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

    def __init__(self, pad_to_capacity: bool = False) -> None:
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int) -> tuple[Tensor, Tensor, DispatchContext]:
        self.num_local_experts = num_experts
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


# ----------------------------------------------------------------------------------------------------------------
# helpers


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


def _kept_ids(routing: RoutingResult, num_experts: int) -> Tensor:
    """Expert ids [T, k] with dropped assignments mapped to ``num_experts`` (sorted last, counted apart)."""
    ids = routing.expert_ids
    if routing.keep_mask is None:
        return ids
    return torch.where(routing.keep_mask, ids, torch.full_like(ids, num_experts))


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return torch.cumsum(x, dim) - x


def regroup_index(counts_SE: Tensor, base_S: Tensor, total: int) -> Tensor:
    """Gather index that reorders rows laid out source-major into expert-major order.

    The input buffer holds, for each source s, blocks of ``counts_SE[s, j]`` rows for local experts j = 0..e-1,
    source s starting at row ``base_S[s]`` (sources may be separated by padding). Row ``o`` of the expert-major
    output ([expert][source]) is ``buffer[index[o]]``; ``total = counts_SE.sum()`` (a host int: no sync here)."""
    S, e = counts_SE.shape
    dev = counts_SE.device
    src_start_SE = base_S.unsqueeze(1) + _exclusive_cumsum(counts_SE, 1)
    cnt_ES = counts_SE.t().reshape(-1)  # blocks in output order (j, s)
    dst_start_ES = _exclusive_cumsum(cnt_ES, 0)
    src_start_ES = src_start_SE.t().reshape(-1)
    block_R = torch.repeat_interleave(torch.arange(S * e, device=dev), cnt_ES, output_size=total)
    return src_start_ES[block_R] + torch.arange(total, device=dev) - dst_start_ES[block_R]


def _ungroup(y_RD: Tensor, index_R: Tensor, num_rows: int, full: bool) -> Tensor:
    """Inverse of ``buffer.index_select(0, index_R)``: rows back to their buffer slots (zeros elsewhere unless
    ``full``, i.e. index_R is a permutation of every slot)."""
    make = y_RD.new_empty if full else y_RD.new_zeros
    return make(num_rows, y_RD.shape[1]).index_copy(0, index_R, y_RD)


def _gather_small(t: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """Non-differentiable all-gather of a small tensor: [size, *t.shape]."""
    out = t.new_empty((size * t.shape[0],) + tuple(t.shape[1:]))
    _all_gather_into(out, t.contiguous(), group=group)
    return out.view((size,) + tuple(t.shape))


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])], dim=0)


class _GroupedDispatcher(TokenDispatcher):
    """Common group bookkeeping of the distributed dispatchers."""

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
                f"{type(self).__name__} was set up for {self.num_local_experts} local experts, but "
                f"num_experts={num_experts} over ep={self.ep_size} gives {e}"
            )
        self.num_local_experts = e
        return e

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ep={self.ep_size}, etp={self.etp_size})"


# ----------------------------------------------------------------------------------------------------------------
# all-to-all


@dataclass
class _AllToAllState:
    send_splits: list[int]  # rows this rank sends to each ep peer (= returned to it in combine)
    recv_splits: list[int]  # rows this rank receives from each ep peer
    regroup_R: Tensor  # gather index: (etp-gathered) source-major buffer -> expert-major rows
    buffer_rows: int  # rows of the source-major buffer (Q * Rmax with etp)
    own_rows: int  # rows this rank received over ep (its slice of the etp buffer)
    full: bool  # regroup_R is a permutation of every buffer row (no padding slots)
    slot_R: Optional[Tensor] = None  # pad_to_capacity: padded send slot of every sorted assignment


class AllToAllDispatcher(_GroupedDispatcher):
    """Expert parallelism by all-to-all over ``ep`` (+ all-gather / reduce-scatter over ``etp``).

    ``AllToAllDispatcher(ep_group, etp_group=None, pad_to_capacity=False, num_local_experts=None)``; groups are
    ``ProcessGroup``s or 1-D ``DeviceMesh``es (``dims.expert_mesh["ep"]``, ``["etp"]``).

    dispatch: sort the kept assignments by global expert (= by destination rank) -> all_to_all of the per-expert
    counts (and an all-gather of the received [P, e] count matrix over etp) -> ONE host sync, the ``.tolist()``
    in :meth:`_exchange_counts` (split sizes must be Python ints) -> differentiable all_to_all_single of the rows
    (uneven, zero splits allowed) -> with etp: differentiable all-gather over etp, each peer's rows padded to the
    largest peer's count (the padding is never read) -> one gather regroups [etp peer][source][expert] to
    [expert][etp peer][source]. combine runs the same steps backwards (index_copy, reduce-scatter *sum* of the
    partial etp outputs, all_to_all back) and unpermutes with the probs on the source rank.

    ``pad_to_capacity`` (only when ``routing.capacity`` is set): every source sends exactly ``capacity`` rows per
    expert (zero rows fill the unused slots; assignments past the capacity are dropped), so all split sizes are
    static: no count exchange and no host sync; each local expert receives ``capacity * ep * etp`` rows. Every rank
    of the ep and etp groups must then use the same capacity (same tokens per rank, as in Megatron).
    """

    def __init__(self, ep_group: GroupLike, etp_group: Optional[GroupLike] = None, pad_to_capacity: bool = False,
                 num_local_experts: Optional[int] = None) -> None:
        super().__init__(ep_group, etp_group, num_local_experts)
        self.pad_to_capacity = pad_to_capacity

    # -- collectives on rows (differentiable) --
    def _a2a(self, x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        if self.ep_size == 1:
            return x
        return funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, self.ep_group)

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

    def dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int) -> tuple[Tensor, Tensor, DispatchContext]:
        E = num_experts
        e = self._local_experts(E)
        if self.pad_to_capacity and routing.capacity is not None:
            return self._dispatch_padded(x_TD, routing, E, e, int(routing.capacity))
        P, Q = self.ep_size, self.etp_size
        k = routing.expert_ids.shape[1]
        ids_TK = _kept_ids(routing, E)
        # dropped assignments get id E and sort last; cut after the host sync (no extra sync in capacity mode)
        order_N, counts_E1 = sort_assignments(ids_TK, None, E + 1)
        send, recv, recv_QPe = self._exchange_counts(counts_E1[:E], e)
        order_R = order_N[: sum(send)]
        x_sent = permute(x_TD, order_R, k)  # sorted by global expert = by destination rank

        recv_splits = [sum(c) for c in recv[self.etp_rank]]
        x_recv = self._a2a(x_sent, recv_splits, send)  # [source][local expert]
        own = sum(recv_splits)
        rows_Q = [sum(sum(c) for c in recv[q]) for q in range(Q)]
        if Q > 1:
            rmax = max(rows_Q)
            x_buf = _all_gather_autograd(_pad_rows(x_recv, rmax), 0, self.etp_group)  # [etp peer][rmax]
            buffer_rows = Q * rmax
        else:
            rmax, x_buf, buffer_rows = own, x_recv, own
        total = sum(rows_Q)
        rows_QP = recv_QPe.sum(2)
        base_QP = _exclusive_cumsum(rows_QP, 1) + torch.arange(Q, device=rows_QP.device).unsqueeze(1) * rmax
        regroup_R = regroup_index(recv_QPe.reshape(Q * P, e), base_QP.reshape(-1), total)
        x_RD = x_buf.index_select(0, regroup_R)
        counts_e = recv_QPe.sum((0, 1))
        state = _AllToAllState(send, recv_splits, regroup_R, buffer_rows, own, full=(total == buffer_rows))
        ctx = DispatchContext(num_tokens=x_TD.shape[0], order_R=order_R, probs_TK=routing.probs, extra=state)
        return x_RD, counts_e, ctx

    def _dispatch_padded(self, x_TD: Tensor, routing: RoutingResult, E: int, e: int, cap: int):
        P, Q = self.ep_size, self.etp_size
        T, D = x_TD.shape
        k = routing.expert_ids.shape[1]
        dev = x_TD.device
        ids_TK = _kept_ids(routing, E)
        order_N, counts_E1 = sort_assignments(ids_TK, None, E + 1)
        ids_N = ids_TK.reshape(-1).index_select(0, order_N)
        pos_N = torch.arange(order_N.numel(), device=dev) - _exclusive_cumsum(counts_E1, 0).index_select(0, ids_N)
        valid_N = (ids_N < E) & (pos_N < cap)  # past-capacity assignments (never from our router) are dropped
        slot_N = torch.where(valid_N, ids_N * cap + pos_N, torch.full_like(ids_N, E * cap))
        # token feeding each send slot; empty slots read an appended zero row (index T)
        src_slot = torch.full((E * cap + 1,), T, dtype=torch.long, device=dev)
        src_slot.scatter_(0, slot_N, torch.div(order_N, k, rounding_mode="floor"))
        x_aug = torch.cat([x_TD, x_TD.new_zeros(1, D)], dim=0)
        x_sent = x_aug.index_select(0, src_slot[: E * cap])  # [E, cap] slots = [dest rank][local expert][cap]
        splits = [e * cap] * P
        x_recv = self._a2a(x_sent, splits, splits)
        x_buf = _all_gather_autograd(x_recv, 0, self.etp_group) if Q > 1 else x_recv  # [Q*P][e][cap]
        S = Q * P
        regroup_R = torch.arange(S * e * cap, device=dev).view(S, e, cap).transpose(0, 1).reshape(-1)
        x_RD = x_buf.index_select(0, regroup_R)
        counts_e = torch.full((e,), S * cap, dtype=torch.long, device=dev)
        # combine reads slot_N for every assignment; dropped ones are masked by zero weights
        valid_TK = torch.zeros_like(valid_N).scatter_(0, order_N, valid_N).view_as(routing.probs)
        probs_TK = torch.where(valid_TK, routing.probs, torch.zeros_like(routing.probs))
        slot_N = torch.where(valid_N, slot_N, torch.zeros_like(slot_N))
        state = _AllToAllState(splits, splits, regroup_R, S * e * cap, P * e * cap, full=True, slot_R=slot_N)
        ctx = DispatchContext(num_tokens=T, order_R=order_N, probs_TK=probs_TK, extra=state)
        return x_RD, counts_e, ctx

    def combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        st: _AllToAllState = ctx.extra
        y_buf = _ungroup(y_RD, st.regroup_R, st.buffer_rows, st.full)
        if self.etp_size > 1:
            # partial outputs (F is split over etp): sum them and keep this rank's own rows
            y_recv = _reduce_scatter_autograd(y_buf, "sum", 0, self.etp_group)[: st.own_rows]
        else:
            y_recv = y_buf
        y_sent = self._a2a(y_recv, st.send_splits, st.recv_splits)
        if st.slot_R is not None:
            if y_sent.shape[0] == 0:  # capacity 0: nothing was sent, nothing contributes
                return y_sent.new_zeros(ctx.num_tokens, y_sent.shape[1])
            y_sent = y_sent.index_select(0, st.slot_R)
        return unpermute(y_sent, ctx.order_R, ctx.probs_TK, ctx.num_tokens)


# ----------------------------------------------------------------------------------------------------------------
# all-gather


@dataclass
class _AllGatherState:
    num_local_tokens: int
    padded_tokens: int  # every rank's tokens are padded to this many before the gathers


class AllGatherDispatcher(_GroupedDispatcher):
    """Expert parallelism by all-gathering tokens: ``AllGatherDispatcher(ep_group, etp_group=None,
    num_local_experts=None)``; groups are ``ProcessGroup``s or 1-D ``DeviceMesh``es.

    dispatch: exchange (T, per-expert counts) over ep and etp -> ONE host sync (the ``.tolist()`` in
    :meth:`dispatch`) -> pad x and [probs | ids] to the largest T, differentiable all-gather over ep, then over
    etp (layout [etp peer][ep peer][token]) -> every rank permutes the gathered assignments of its local experts.
    combine: weighted unpermute into the gathered layout, then reduce-scatter (sum) over etp (sums the partial F
    outputs) and over ep (sums the experts' contributions) back to the owners. Suits small ep (the gathered
    tokens grow with ep * etp); the backward of each all-gather is a reduce-scatter and vice versa.
    """

    def _gather(self, t: Tensor) -> Tensor:
        if self.ep_size > 1:
            t = _all_gather_autograd(t.contiguous(), 0, self.ep_group)
        if self.etp_size > 1:
            t = _all_gather_autograd(t.contiguous(), 0, self.etp_group)
        return t

    def dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int) -> tuple[Tensor, Tensor, DispatchContext]:
        E = num_experts
        e = self._local_experts(E)
        P, Q = self.ep_size, self.etp_size
        T, D = x_TD.shape
        k = routing.expert_ids.shape[1]
        dev = x_TD.device
        ids_TK = _kept_ids(routing, E)
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E + 1)[:E]
        info = torch.cat([torch.tensor([T], dtype=torch.long, device=dev), counts_E])
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
        x_g = self._gather(_pad_rows(x_TD, t_max))
        meta_g = self._gather(meta_TM)
        probs_g = meta_g[:, :k]
        local_g = meta_g[:, k:].detach().long() - lo
        local_g = torch.where((local_g >= 0) & (local_g < e), local_g, torch.full_like(local_g, e))
        order_N, counts_e1 = sort_assignments(local_g, None, e + 1)
        order_R = order_N[:rows]
        x_RD = permute(x_g, order_R, k)
        ctx = DispatchContext(
            num_tokens=x_g.shape[0], order_R=order_R, probs_TK=probs_g, extra=_AllGatherState(T, t_max)
        )
        return x_RD, counts_e1[:e], ctx

    def combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        st: _AllGatherState = ctx.extra
        y = unpermute(y_RD, ctx.order_R, ctx.probs_TK, ctx.num_tokens)  # [Q][P][t_max]
        if self.etp_size > 1:
            y = _reduce_scatter_autograd(y, "sum", 0, self.etp_group)
        if self.ep_size > 1:
            y = _reduce_scatter_autograd(y, "sum", 0, self.ep_group)
        return y[: st.num_local_tokens]
