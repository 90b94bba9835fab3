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
    ids_A = expert_ids_TK.reshape(-1)
    if keep_TK is not None:
        ids_A = torch.where(keep_TK.reshape(-1), ids_A, torch.full_like(ids_A, num_experts))
    order_A = torch.argsort(ids_A, stable=True)
    counts_E1 = torch.bincount(ids_A, minlength=num_experts + 1)
    counts_E = counts_E1[:num_experts]
    if keep_TK is not None:
        # dropped assignments sort last (id E); cut them off. One host sync, only in capacity mode.
        order_A = order_A[: int(counts_E.sum())]
    return order_A, counts_E


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
