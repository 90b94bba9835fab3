"""Token dispatchers: move routed rows to the rank that holds their expert and back.

Legend: T local tokens, D hidden, k top-k, E global experts, e local experts (E / ep), R rows on this rank's
experts, A = T*k assignments, P ep size, Q etp size, C = Q*P sources of rows for one rank's experts.
The MoE layer holds one dispatcher object; parallelize swaps the local one for a distributed one. The optional
DeepEP backend (``DeepEPDispatcher``) lives in :mod:`lightning_moe.moe.deepep`.

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
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from lightning_moe.moe import kernels
from lightning_moe.moe.router import RoutingResult
from lightning_moe.collectives import all_gather_autograd, all_gather_into, reduce_scatter_autograd

try:  # a 1-D DeviceMesh is accepted wherever a group is
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without device_mesh
    DeviceMesh = ()  # type: ignore[assignment,misc]

GroupLike = Union["dist.ProcessGroup", "DeviceMesh"]

@dataclass
class DispatchContext:
    """What combine needs to undo dispatch (opaque to the layer).

    num_tokens: tokens of the combine output before any reduction (T, or the gathered token count).
    probs_TK: combine weights of those tokens.
    pos_TK: the row (of the rows that reach combine's unpermute) holding each assignment's output; -1 for
        assignments with no row (dropped by capacity, or on another rank's experts for the all-gather dispatcher).
    asg_R: the assignment (flat index into [num_tokens, k]) of each of those rows; -1 for padding rows.
    has_dropped: some pos_TK are -1.  rows_covered: no asg_R is -1.
    probs_applied: :meth:`TokenDispatcher.row_probs` handed the weights to the experts, so combine sums unweighted.
    extra: the distributed dispatcher's own state: the all-to-all's split sizes and regroup indices, the
        all-gather dispatcher's local token count, or DeepEP's buffer and handle.
    """

    num_tokens: int
    probs_TK: Tensor
    pos_TK: Tensor
    asg_R: Tensor
    has_dropped: bool = False
    rows_covered: bool = True
    extra: Any = None
    probs_applied: bool = False


class TokenDispatcher:
    """Interface: ``dispatch`` returns rows grouped by local expert with per-local-expert counts (int64, [e]);
    ``combine`` returns ``y_TD[t] = sum_k probs[t, k] * y(t, k)``.

    ``overlaps``: ``dispatch`` also takes ``overlap``, a callable it runs exactly once after it has issued the
    rows' collective and before it reads the result, so that work independent of the routed rows (the shared
    experts) is queued while the tokens travel (functional collectives wait on first use)."""

    num_local_experts: Optional[int] = None
    overlaps: bool = False

    def dispatch(
        self, x_TD: Tensor, routing: RoutingResult, num_experts: int
    ) -> tuple[Tensor, Tensor, DispatchContext]:
        raise NotImplementedError

    def combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        raise NotImplementedError

    def row_probs(self, ctx: DispatchContext) -> Optional[Tensor]:
        """The combine weight of every row of ``dispatch``'s output ([R] fp32, differentiable; 0 for padding rows),
        for experts that apply it themselves (before their down projection, as Megatron-Core does): ``combine`` of
        this ``ctx`` then sums the rows unweighted, and the layer keeps no [R, D] expert output for the weights'
        gradient. None: this dispatcher cannot (``combine`` weights the rows)."""
        return None


# ----------------------------------------------------------------------------------------------------------------
# row movement without atomics
#
# permute.permute / unpermute are the reference (index_select forward, index_add backward / forward). On an H200 an
# index_add of bf16 rows runs on atomics at ~7x the time of a gather, and an index_copy ~3x, so the dispatchers keep
# both maps, ``pos_TK`` (row of every assignment) and ``asg_R`` (assignment of every row), and only ever gather:
# token-side sums are a gather of [T, k, D] and a k-sum (a bmm with the weights), row-side results a gather by
# token (and a row scale). Tested against the reference in tests/test_dispatcher.py.
# With the Triton kernels (lightning_moe.moe.kernels, on CUDA by default) the same two autograd functions run fused
# gathers: no [T, k, D] copy, the k-sums in fp32, and the unpermute backward in one pass over the rows.


def _gather_tokens(rows_RD: Tensor, pos_TK: Tensor) -> Tensor:
    """[T, k, D] rows of every assignment (row 0 where pos < 0: the caller masks it; needs rows_RD non-empty)."""
    T, k = pos_TK.shape
    return rows_RD.index_select(0, pos_TK.clamp(min=0).reshape(-1)).view(T, k, rows_RD.shape[1])


def _weighted_k_sum(rows_RD: Tensor, pos_TK: Tensor, w_TK: Optional[Tensor]) -> Tensor:
    """out[t] = sum_k w[t, k] * rows[pos[t, k]] (w None: plain sum, every pos valid), in rows' dtype."""
    T = pos_TK.shape[0]
    if T == 0 or rows_RD.shape[0] == 0:
        return rows_RD.new_zeros(T, rows_RD.shape[1])
    G_TKD = _gather_tokens(rows_RD, pos_TK)
    if w_TK is None:
        return G_TKD.sum(1)  # fp32 accumulation for low-precision dtypes
    return torch.bmm(w_TK.to(rows_RD.dtype).unsqueeze(1), G_TKD).squeeze(1)


def _rows_to_tokens(asg_R: Tensor, k: int, rows_covered: bool, T: int) -> Tensor:
    """Token of each row; padding rows (asg -1) read row T, a zero row the caller appends."""
    tok_R = torch.div(asg_R, k, rounding_mode="floor")
    return tok_R if rows_covered else torch.where(asg_R < 0, torch.full_like(tok_R, T), tok_R)


def _with_zero_row(x_TD: Tensor, rows_covered: bool) -> Tensor:
    return x_TD if rows_covered else torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])], dim=0)


class _PermuteRows(torch.autograd.Function):
    """rows[r] = x[asg_R[r] // k] (asg -1: a zero row); backward grad_x[t] = sum_k grad_rows[pos_TK[t, k]]."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, asg_R: Tensor, pos_TK: Tensor, has_dropped: bool, rows_covered: bool) -> Tensor:
        ctx.save_for_backward(pos_TK)
        ctx.has_dropped = has_dropped
        ctx.fused = kernels.use_triton(x_TD)
        T, k = pos_TK.shape
        if ctx.fused:
            return kernels.gather_rows(x_TD, asg_R, k)
        tok_R = _rows_to_tokens(asg_R, k, rows_covered, T)
        return _with_zero_row(x_TD, rows_covered).index_select(0, tok_R)

    @staticmethod
    def backward(ctx, g_RD: Tensor):
        (pos_TK,) = ctx.saved_tensors
        if ctx.fused:
            return kernels.k_sum(g_RD, pos_TK), None, None, None, None
        mask = (pos_TK >= 0).to(g_RD.dtype) if ctx.has_dropped else None
        return _weighted_k_sum(g_RD.contiguous(), pos_TK, mask), None, None, None, None


class _UnpermuteRows(torch.autograd.Function):
    """out[t] = sum_k probs[t, k] * y[pos_TK[t, k]] over assignments with a row (pos >= 0).

    Backward without scatters: grad_y[r] = w(asg_R[r]) * g[token of r] (a gather and a row scale) and
    grad_probs(asg_R[r]) = <y[r], g[token of r]> (fp32 sums)."""

    @staticmethod
    def forward(ctx, y_RD: Tensor, probs_TK: Tensor, pos_TK: Tensor, asg_R: Tensor, has_dropped: bool,
                rows_covered: bool) -> Tensor:
        ctx.fused = kernels.use_triton(y_RD)
        if ctx.fused:  # rows only hold kept assignments: no masking of the weights needed
            ctx.save_for_backward(y_RD, probs_TK, asg_R)
            return kernels.k_sum(y_RD, pos_TK, probs_TK)
        w_TK = torch.where(pos_TK >= 0, probs_TK, torch.zeros_like(probs_TK)) if has_dropped else probs_TK
        ctx.save_for_backward(y_RD, w_TK, asg_R)
        ctx.flags = (rows_covered, probs_TK.dtype)
        return _weighted_k_sum(y_RD, pos_TK, w_TK)

    @staticmethod
    def backward(ctx, g_TD: Tensor):
        y_RD, w_TK, asg_R = ctx.saved_tensors
        if ctx.fused:
            grad_y, grad_p = kernels.unpermute_backward(g_TD, y_RD, w_TK, asg_R, *ctx.needs_input_grad[:2])
            return grad_y, grad_p, None, None, None, None
        rows_covered, probs_dtype = ctx.flags
        T, k = w_TK.shape
        R = y_RD.shape[0]
        g_RD = _with_zero_row(g_TD.contiguous(), rows_covered).index_select(
            0, _rows_to_tokens(asg_R, k, rows_covered, T)
        )
        asg_c = asg_R if rows_covered else asg_R.clamp(min=0)
        w_R = w_TK.reshape(-1).index_select(0, asg_c) if T * k else w_TK.new_zeros(R)
        if not rows_covered:
            w_R = torch.where(asg_R < 0, torch.zeros_like(w_R), w_R)
        grad_y = grad_p = None
        if ctx.needs_input_grad[0]:
            grad_y = g_RD * w_R.to(g_RD.dtype).unsqueeze(1)
        if ctx.needs_input_grad[1]:
            p_R = (y_RD.to(g_RD.dtype) * g_RD).sum(-1, dtype=torch.float32)
            if rows_covered:
                grad_p = p_R.new_zeros(T * k).index_copy_(0, asg_R, p_R)
            else:  # padding rows land on a sentinel, cut off
                grad_p = p_R.new_zeros(T * k + 1).index_copy_(0, torch.where(asg_R < 0, T * k, asg_R), p_R)[: T * k]
            grad_p = grad_p.view(T, k).to(probs_dtype)
        return grad_y, grad_p, None, None, None, None


class _SumRows(torch.autograd.Function):
    """out[t] = sum_k y[pos_TK[t, k]] over pos >= 0 (the combine when the experts applied the weights); backward
    grad_y[r] = g[token of r] (padding rows: 0), a gather: nothing of y is kept."""

    @staticmethod
    def forward(ctx, y_RD: Tensor, pos_TK: Tensor, asg_R: Tensor, has_dropped: bool, rows_covered: bool) -> Tensor:
        ctx.save_for_backward(asg_R)
        ctx.flags = (pos_TK.shape, rows_covered)
        ctx.fused = kernels.use_triton(y_RD)
        if ctx.fused:
            return kernels.k_sum(y_RD, pos_TK)
        mask = (pos_TK >= 0).to(y_RD.dtype) if has_dropped else None
        return _weighted_k_sum(y_RD, pos_TK, mask)

    @staticmethod
    def backward(ctx, g_TD: Tensor):
        (asg_R,) = ctx.saved_tensors
        (T, k), rows_covered = ctx.flags
        if ctx.fused:
            grad_y = kernels.gather_rows(g_TD, asg_R, k)
        else:
            grad_y = _with_zero_row(g_TD.contiguous(), rows_covered).index_select(
                0, _rows_to_tokens(asg_R, k, rows_covered, T))
        return grad_y, None, None, None, None


class _RowProbs(torch.autograd.Function):
    """p_R[r] = probs[asg_R[r]] (0 for padding rows, asg -1); backward grad_probs[t, k] = g[pos_TK[t, k]] (0 where
    pos < 0): gathers both ways, no scatter."""

    @staticmethod
    def forward(ctx, probs_TK: Tensor, asg_R: Tensor, pos_TK: Tensor) -> Tensor:
        ctx.save_for_backward(pos_TK)
        flat = probs_TK.reshape(-1)
        if flat.numel() == 0:
            return probs_TK.new_zeros(asg_R.shape[0])
        return torch.where(asg_R >= 0, flat.index_select(0, asg_R.clamp(min=0)), flat.new_zeros(()))

    @staticmethod
    def backward(ctx, g_R: Tensor):
        (pos_TK,) = ctx.saved_tensors
        if g_R.numel() == 0:
            return g_R.new_zeros(pos_TK.shape), None, None
        picked = g_R.index_select(0, pos_TK.clamp(min=0).reshape(-1)).view(pos_TK.shape)
        return torch.where(pos_TK >= 0, picked, picked.new_zeros(())), None, None


def _row_probs(ctx: DispatchContext) -> Tensor:
    """[R] fp32 combine weights of the rows ``ctx`` describes, and mark the combine unweighted."""
    ctx.probs_applied = True
    return _RowProbs.apply(ctx.probs_TK.float(), ctx.asg_R, ctx.pos_TK)


class _Reindex(torch.autograd.Function):
    """out = x[index] with backward grad_x = grad[inverse]: for index maps that hit each row at most once (rows of
    x no index reaches get an arbitrary row's gradient: callers only use this where such rows are cut off)."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, index_R: Tensor, inverse_A: Tensor) -> Tensor:
        ctx.save_for_backward(inverse_A)
        return x_ND.index_select(0, index_R)

    @staticmethod
    def backward(ctx, g_RD: Tensor):
        (inverse_A,) = ctx.saved_tensors
        return g_RD.contiguous().index_select(0, inverse_A), None, None


def _count(ids_A: Tensor, num_bins: int) -> Tensor:
    """bincount without its host sync (torch.bincount reads the max id back to the host on CUDA)."""
    return torch.zeros(num_bins, dtype=torch.long, device=ids_A.device).scatter_add_(0, ids_A, torch.ones_like(ids_A))


def _sort_by_expert(routing: RoutingResult, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """ids [T, k] (dropped assignments -> E), all T*k assignments sorted by expert (stable: tokens keep their
    order; dropped last) and per-expert counts [E + 1] (the last: dropped). No host sync (the same order as
    permute.sort_assignments, without its bincount)."""
    ids_TK = routing.expert_ids
    if routing.keep_mask is not None:
        ids_TK = torch.where(routing.keep_mask, ids_TK, torch.full_like(ids_TK, num_experts))
    ids_A = ids_TK.reshape(-1)
    return ids_TK, torch.argsort(ids_A, stable=True), _count(ids_A, num_experts + 1)


def _positions(order_A: Tensor, num_rows: int, shape: torch.Size) -> Tensor:
    """Row of each assignment: its rank in ``order_A`` if below ``num_rows``, else -1."""
    A = order_A.numel()
    rank_A = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(A, device=order_A.device))
    if num_rows < A:
        rank_A = torch.where(rank_A < num_rows, rank_A, torch.full_like(rank_A, -1))
    return rank_A.view(shape)


def _group_slots(ids_TK: Tensor, order_A: Tensor, counts_G1: Tensor, start_G: Tensor, limit_G: Tensor,
                 num_slots: int) -> tuple[Tensor, Tensor]:
    """Padded grouped layout of ``num_slots`` rows: group g owns slots ``[start_G[g], start_G[g] + limit_G[g])``
    and its assignments fill them in ``order_A`` order (the assignments sorted by group, stable; ``counts_G1``: per
    group, the last entry those of id G = dropped). Returns the slot of every assignment (-1: dropped, or past its
    group's limit) and the assignment of every slot (-1: empty). No host sync."""
    T, k = ids_TK.shape
    A = order_A.numel()
    G = start_G.numel()
    dev = order_A.device
    ids_A = ids_TK.reshape(-1).index_select(0, order_A)
    rank_A = torch.arange(A, device=dev) - _exclusive_cumsum(counts_G1, 0).index_select(0, ids_A)
    grp_A = ids_A.clamp(max=G - 1)
    valid_A = (ids_A < G) & (rank_A < limit_G.index_select(0, grp_A))
    slot_A = torch.where(valid_A, start_G.index_select(0, grp_A) + rank_A, torch.full_like(ids_A, num_slots))
    asg_R = torch.full((num_slots + 1,), -1, dtype=torch.long, device=dev).scatter_(0, slot_A, order_A)[:num_slots]
    pos_A = torch.empty_like(slot_A).scatter_(0, order_A, slot_A)
    pos_TK = torch.where(pos_A == num_slots, torch.full_like(pos_A, -1), pos_A).view(T, k)
    return pos_TK, asg_R


def _capacity_slots(ids_TK: Tensor, order_A: Tensor, counts_E1: Tensor, E: int, cap: int) -> tuple[Tensor, Tensor]:
    """Padded layout [E, cap]: the slot of every assignment (-1: dropped, or past the capacity) and the assignment
    of every slot (-1: empty). No host sync."""
    dev = order_A.device
    return _group_slots(ids_TK, order_A, counts_E1, torch.arange(E, device=dev) * cap,
                        torch.full((E,), cap, dtype=torch.long, device=dev), E * cap)


def _permute(x_TD: Tensor, probs_TK: Tensor, pos_TK: Tensor, asg_R: Tensor, has_dropped: bool,
             rows_covered: bool) -> tuple[Tensor, DispatchContext]:
    rows = _PermuteRows.apply(x_TD, asg_R, pos_TK, has_dropped, rows_covered)
    return rows, DispatchContext(pos_TK.shape[0], probs_TK, pos_TK, asg_R, has_dropped, rows_covered)


def _unpermute(y_RD: Tensor, ctx: DispatchContext) -> Tensor:
    if ctx.probs_applied:
        return _SumRows.apply(y_RD, ctx.pos_TK, ctx.asg_R, ctx.has_dropped, ctx.rows_covered)
    return _UnpermuteRows.apply(y_RD, ctx.probs_TK, ctx.pos_TK, ctx.asg_R, ctx.has_dropped, ctx.rows_covered)


class LocalDispatcher(TokenDispatcher):
    """All experts on this process: permute by expert, unpermute with the combine weights.

    One host sync only in capacity mode without padding (the number of kept rows sizes the output);
    ``pad_to_capacity`` pads every expert to ``routing.capacity`` rows (zeros) with no host sync."""

    def __init__(self, pad_to_capacity: bool = False) -> None:
        self.pad_to_capacity = pad_to_capacity

    def dispatch(
        self, x_TD: Tensor, routing: RoutingResult, num_experts: int
    ) -> tuple[Tensor, Tensor, DispatchContext]:
        counts_e, ctx = self.plan(routing, num_experts)
        rows = _PermuteRows.apply(x_TD, ctx.asg_R, ctx.pos_TK, ctx.has_dropped, ctx.rows_covered)
        return rows, counts_e, ctx

    def plan(self, routing: RoutingResult, num_experts: int) -> tuple[Tensor, DispatchContext]:
        """``dispatch`` without moving rows: the counts and the context whose ``asg_R`` says which token each row
        is (``x_RD[r] = x_TD[asg_R[r] // k]``, zero rows where -1), for experts that gather the rows themselves."""
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

    def combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        return _unpermute(y_RD, ctx)

    def row_probs(self, ctx: DispatchContext) -> Tensor:
        return _row_probs(ctx)


# ----------------------------------------------------------------------------------------------------------------
# helpers of the distributed dispatchers


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


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return torch.cumsum(x, dim) - x


def regroup_index(counts_CE: Tensor, base_C: Tensor, total: int) -> Tensor:
    """Gather index that reorders rows laid out source-major into expert-major order.

    The input buffer holds, for each source s, blocks of ``counts_CE[s, j]`` rows for local experts j = 0..e-1,
    source s starting at row ``base_C[s]`` (sources may be separated by padding). Row ``o`` of the expert-major
    output ([expert][source]) is ``buffer[index[o]]``; ``total = counts_CE.sum()`` (a host int: no sync here)."""
    C, e = counts_CE.shape
    dev = counts_CE.device
    src_start_CE = base_C.unsqueeze(1) + _exclusive_cumsum(counts_CE, 1)
    cnt_EC = counts_CE.t().reshape(-1)  # blocks in output order (j, s)
    dst_start_EC = _exclusive_cumsum(cnt_EC, 0)
    src_start_EC = src_start_CE.t().reshape(-1)
    block_R = torch.repeat_interleave(torch.arange(C * e, device=dev), cnt_EC, output_size=total)
    return src_start_EC[block_R] + torch.arange(total, device=dev) - dst_start_EC[block_R]


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
                f"{type(self).__name__} was set up for {self._fixed_local_experts} local experts, but "
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

    def __init__(self, ep_group: GroupLike, etp_group: Optional[GroupLike] = None, pad_to_capacity: bool = False,
                 num_local_experts: Optional[int] = None) -> None:
        super().__init__(ep_group, etp_group, num_local_experts)
        self.pad_to_capacity = pad_to_capacity

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

    overlaps = True

    def dispatch(
        self, x_TD: Tensor, routing: RoutingResult, num_experts: int, overlap: Optional[Callable[[], Any]] = None
    ) -> tuple[Tensor, Tensor, DispatchContext]:
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

    def row_probs(self, ctx: DispatchContext) -> Tensor:
        # the sent rows' weights take the rows' way ([n, 1] fp32: 4 bytes a row beside the row's 2 * D)
        return self._to_experts(_row_probs(ctx).unsqueeze(1), ctx.extra).squeeze(1)

    def combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        st: _AllToAllState = ctx.extra
        y_buf = _Reindex.apply(y_RD, st.inverse_B, st.regroup_R)
        if self.etp_size > 1:
            # partial outputs (F is split over etp): sum them and keep this rank's own rows
            y_recv = reduce_scatter_autograd(y_buf, "sum", 0, self.etp_group)[: st.own_rows]
        else:
            y_recv = y_buf
        y_sent = self._a2a(y_recv, st.send_splits, st.recv_splits)
        return _unpermute(y_sent, ctx)


# ----------------------------------------------------------------------------------------------------------------
# all-gather


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

    def _gather(self, t: Tensor) -> Tensor:
        if self.ep_size > 1:
            t = all_gather_autograd(t.contiguous(), 0, self.ep_group)
        if self.etp_size > 1:
            t = all_gather_autograd(t.contiguous(), 0, self.etp_group)
        return t

    overlaps = True

    def dispatch(
        self, x_TD: Tensor, routing: RoutingResult, num_experts: int, overlap: Optional[Callable[[], Any]] = None
    ) -> tuple[Tensor, Tensor, DispatchContext]:
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

    def row_probs(self, ctx: DispatchContext) -> Tensor:
        return _row_probs(ctx)  # ctx holds the gathered probs: every rank has its rows' weights

    def combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        y = _unpermute(y_RD, ctx)  # [Q][P][t_max]
        if self.etp_size > 1:
            y = reduce_scatter_autograd(y, "sum", 0, self.etp_group)
        if self.ep_size > 1:
            y = reduce_scatter_autograd(y, "sum", 0, self.ep_group)
        return y[: ctx.extra]
