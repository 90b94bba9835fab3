"""Where each assignment's row goes: sorting by expert, row positions, padded (capacity / aligned) slots and the
source-major -> expert-major regroup index. Index math only, on the device, without host syncs.

Legend: T tokens, k top-k, A = T*k assignments, E experts, G groups, C row sources.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe.moe.router import RoutingResult


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


