"""Token permutation: group (token, choice) assignments by expert and scatter results back.

Legend: T tokens, D hidden, k top-k, E experts, R routed rows (kept assignments, plus padding rows when padding
to capacity). Reference torch implementation; fused kernels may live next to it and are tested against it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def sort_assignments(
    expert_ids_TK: Tensor, keep_TK: Optional[Tensor], num_experts: int
) -> tuple[Tensor, Tensor]:
    """Flat assignment indices (into the T*k view) of the kept assignments, sorted by expert (stable, so
    tokens keep their order within an expert), and the per-expert counts [E] (int64)."""
    ids_N = expert_ids_TK.reshape(-1)
    if keep_TK is not None:
        ids_N = torch.where(keep_TK.reshape(-1), ids_N, torch.full_like(ids_N, num_experts))
    order_N = torch.argsort(ids_N, stable=True)
    counts_E1 = torch.bincount(ids_N, minlength=num_experts + 1)
    counts_E = counts_E1[:num_experts]
    if keep_TK is not None:
        # dropped assignments sort last (id E); cut them off. One host sync, only in capacity mode.
        order_N = order_N[: int(counts_E.sum())]
    return order_N, counts_E


def permute(x_TD: Tensor, order_R: Tensor, top_k: int) -> Tensor:
    """Rows of x for each sorted assignment: x_RD[r] = x_TD[order_R[r] // k]."""
    return x_TD.index_select(0, torch.div(order_R, top_k, rounding_mode="floor"))


def unpermute(y_RD: Tensor, order_R: Tensor, probs_TK: Tensor, num_tokens: int) -> Tensor:
    """y_TD[t] = sum_k probs_TK[t, k] * y of assignment (t, k); dropped assignments contribute nothing."""
    top_k = probs_TK.shape[1]
    w_R1 = probs_TK.reshape(-1).index_select(0, order_R).unsqueeze(1)
    tok_R = torch.div(order_R, top_k, rounding_mode="floor")
    # weights in fp32 (the router's precision), summed in the activation dtype's promotion
    y_RD = (y_RD.float() * w_R1).to(y_RD.dtype)
    out_TD = y_RD.new_zeros(num_tokens, y_RD.shape[1])
    return out_TD.index_add_(0, tok_R, y_RD)


def pad_groups(x_RD: Tensor, counts_E: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Pad each expert's contiguous group of rows to ``capacity`` rows with zeros (static shapes).
    Returns the padded rows [E*capacity, D] and the row index of every original row inside it."""
    E = counts_E.numel()
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    expert_R = torch.repeat_interleave(torch.arange(E, device=counts_E.device), counts_E)
    pos_R = torch.arange(x_RD.shape[0], device=x_RD.device) - starts_E[expert_R]
    dest_R = expert_R * capacity + pos_R
    out = x_RD.new_zeros(E * capacity, x_RD.shape[1])
    out = out.index_copy(0, dest_R, x_RD)
    return out, dest_R
