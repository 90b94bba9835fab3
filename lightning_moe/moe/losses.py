"""Router losses and the aux-loss-free bias rule, as pure functions (Megatron-Core moe_utils semantics).

Legend: T tokens on this rank, E experts, k top-k, B sequences on this rank, N valid (non-padding) tokens.

Every function here is single-process math. Distribution enters only through the *counts* and *token
normalisers* the caller passes in: when a micro-batch's tokens are split over ranks (tp/cp), the caller sums
the per-expert counts (and with them N) over those ranks and each rank passes its *local* scores/logits. Each
rank then returns its partial loss, and the partial losses summed over ranks equal the loss of the
concatenated tokens, because every loss below is linear in the local token sums once counts and N are fixed::

    loss = coeff * E / (k * N^2) * sum_i c_i * sum_{t in all ranks} s_ti
         = sum_ranks [ coeff * E / (k * N^2) * sum_i c_i * sum_{t on this rank} s_ti ]

Counts are never differentiated (they come from a top-k); the gradient flows through the scores / logits.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

__all__ = [
    "topk_indices",
    "expert_counts",
    "aux_loss_scores",
    "switch_aux_loss",
    "global_aux_loss",
    "sequence_aux_loss",
    "z_loss",
    "expert_bias_update",
]

Number = Union[int, float, Tensor]


def topk_indices(scores_TE: Tensor, k: int) -> Tensor:
    """Indices [..., k] of the k largest entries along the last dim, largest first.

    Deterministic tie-break: among equal values the *lower* expert index wins (a stable descending sort),
    on every device. ``torch.topk`` does not document its tie order, so it is not used for choices.
    """
    return torch.sort(scores_TE, dim=-1, descending=True, stable=True)[1][..., :k]


def expert_counts(ids_TK: Tensor, num_experts: int, valid: Optional[Tensor] = None) -> Tensor:
    """Assignments per expert, int64 [E]: ``c_i = #{(t, j): ids[t, j] == i, valid}``.

    ``ids_TK`` may carry leading batch dims ([..., T, k]); the counts are then [..., E]. ``valid`` is a
    per-token mask [..., T] (padding tokens False) or a per-assignment mask [..., T, k]; masked-out
    assignments are not counted.
    """
    ids = ids_TK.long()
    ones = torch.ones_like(ids)
    if valid is not None:
        if valid.dim() == ids.dim() - 1:
            valid = valid.unsqueeze(-1)
        ones = ones * valid.to(ids.dtype)
    lead = ids.shape[:-2]
    out = torch.zeros(*lead, num_experts, dtype=torch.long, device=ids.device)
    return out.scatter_add_(-1, ids.reshape(*lead, -1), ones.reshape(*lead, -1))


def aux_loss_scores(logits_TE: Tensor, score_func: str) -> Tensor:
    """Scores over all E experts used by the balance losses (fp32, no bias).

    softmax: ``softmax(logits)``; sigmoid: ``s / (sum_j s_j + 1e-20)`` with ``s = sigmoid(logits)``, so each
    token's scores sum to 1 in both cases.
    """
    logits = logits_TE.float()
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_func == "sigmoid":
        s = torch.sigmoid(logits)
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    raise ValueError(f"unknown score_func {score_func!r}; expected 'softmax' or 'sigmoid'")


def _masked_token_sum(x_TE: Tensor, valid_T: Optional[Tensor]) -> Tensor:
    """sum over (valid) tokens along dim -2."""
    if valid_T is not None:
        x_TE = x_TE * valid_T.unsqueeze(-1).to(x_TE.dtype)
    return x_TE.sum(dim=-2)


def switch_aux_loss(
    scores_TE: Tensor,
    counts_E: Tensor,
    num_tokens: Number,
    top_k: int,
    coeff: float,
    valid_T: Optional[Tensor] = None,
) -> Tensor:
    """Switch-Transformer load-balancing loss (Megatron ``switch_load_balancing_loss_func``).

    On one process, with N valid tokens, counts ``c_i`` of a plain top-k over ``scores`` and
    ``f_i = c_i / (k N)``, ``P_i = (1/N) sum_{t valid} s_ti``::

        loss = coeff * E * sum_i f_i * P_i = coeff * E / (k N^2) * sum_i c_i * sum_{t valid} s_ti

    Across ranks that split one micro-batch, pass counts and N summed over those ranks and the local scores:
    the result is this rank's partial loss (partials sum to the loss of all tokens). Returns fp32 scalar;
    zero when N == 0.
    """
    E = scores_TE.shape[-1]
    if coeff == 0:
        return scores_TE.new_zeros((), dtype=torch.float32)
    sum_E = _masked_token_sum(scores_TE.float(), valid_T)
    n = torch.as_tensor(num_tokens, dtype=torch.float32, device=scores_TE.device).clamp(min=1.0)
    return (sum_E * counts_E.float()).sum() * (coeff * E / top_k) / (n * n)


def global_aux_loss(
    scores_TE: Tensor,
    global_counts_E: Tensor,
    global_num_tokens: Number,
    top_k: int,
    coeff: float,
    valid_T: Optional[Tensor] = None,
) -> Tensor:
    """Global-batch load-balancing loss (Qiu et al. 2025, arXiv 2501.11873; Megatron ``global_aux_loss``).

    The switch formula with ``c_i`` and ``N`` taken over every rank that routes distinct tokens (dp x cp x
    tp)::

        partial_r = coeff * E / (k N^2) * sum_i C_i * sum_{t valid on rank r} s_ti,   sum_r partial_r = loss

    so the sum over ranks equals the switch loss of the concatenated global micro-batch (layout-invariant).
    Megatron instead averages per-rank values of a loss that uses global counts but the local N; we keep
    the global N so that the objective does not depend on the number of ranks.
    """
    return switch_aux_loss(scores_TE, global_counts_E, global_num_tokens, top_k, coeff, valid_T)


def sequence_aux_loss(
    scores_TE: Tensor,
    counts_BE: Tensor,
    num_tokens_B: Tensor,
    top_k: int,
    coeff: float,
    seq_len: int,
    valid_T: Optional[Tensor] = None,
) -> Tensor:
    """Sequence-wise balance loss (DeepSeek-V2/V3 "complementary sequence-wise auxiliary loss").

    Tokens are [B * seq_len] batch-major. For each sequence b with ``N_b > 0`` valid tokens, counts
    ``c_bi`` of a plain top-k over its valid tokens, ``f_bi = c_bi / (k N_b)``, ``P_bi = (1/N_b) sum_t s_ti``::

        L_b  = E * sum_i f_bi * P_bi = E / (k N_b^2) * sum_i c_bi * sum_{t in b, valid} s_ti
        loss = coeff * mean_{b : N_b > 0} L_b          (0 if no sequence has a valid token)

    When a sequence is split over ranks (cp, or tp with sequence parallel), every rank holds the same B
    sequences in the same order, each with a chunk of ``seq_len`` tokens; pass ``counts_BE`` and
    ``num_tokens_B`` summed over those ranks and the local scores: partial losses then sum to the loss.
    """
    T, E = scores_TE.shape
    if coeff == 0:
        return scores_TE.new_zeros((), dtype=torch.float32)
    if seq_len <= 0 or T % seq_len:
        raise ValueError(f"{T} tokens do not split into sequences of seq_len={seq_len}")
    B = T // seq_len
    s_BSE = scores_TE.float().reshape(B, seq_len, E)
    v_BS = None if valid_T is None else valid_T.reshape(B, seq_len)
    sum_BE = _masked_token_sum(s_BSE, v_BS)
    n_B = num_tokens_B.to(torch.float32)
    per_seq_B = (sum_BE * counts_BE.float()).sum(-1) * (E / top_k) / n_B.clamp(min=1.0).square()
    has_tokens_B = n_B > 0
    num_seqs = has_tokens_B.sum().clamp(min=1).to(torch.float32)
    return coeff * torch.where(has_tokens_B, per_seq_B, torch.zeros_like(per_seq_B)).sum() / num_seqs


def z_loss(
    logits_TE: Tensor,
    coeff: float,
    valid_T: Optional[Tensor] = None,
    num_tokens: Optional[Number] = None,
) -> Tensor:
    """Router z-loss (ST-MoE, arXiv 2202.08906)::

        loss = coeff / N * sum_{t valid} (logsumexp_i logits_ti)^2

    ``N`` defaults to the local valid-token count. The loss is linear in the tokens, so across ranks that hold
    distinct tokens of one global micro-batch (tp, cp and data-parallel ranks alike) pass N summed over all of
    them: the partials then sum to the loss of the concatenated tokens, however the valid tokens are spread over
    the ranks (the router does this over its ``global_group``). fp32; zero when N == 0.
    """
    if coeff == 0:
        return logits_TE.new_zeros((), dtype=torch.float32)
    z_T = torch.logsumexp(logits_TE.float(), dim=-1).square()
    if valid_T is not None:
        z_T = z_T * valid_T.to(z_T.dtype)
    if num_tokens is None:
        num_tokens = z_T.shape[0] if valid_T is None else valid_T.sum()
    n = torch.as_tensor(num_tokens, dtype=torch.float32, device=logits_TE.device).clamp(min=1.0)
    return coeff * z_T.sum() / n


def expert_bias_update(bias_E: Tensor, counts_E: Tensor, rate: float) -> Tensor:
    """Aux-loss-free balancing (Wang et al. 2024, arXiv 2408.15664; DeepSeek-V3)::

        b_i <- b_i + rate * sign(mean_j n_j - n_i)

    Under-loaded experts get a larger bias (chosen more often), over-loaded ones a smaller one. Returns a new
    fp32 tensor. The comparison is done exactly, as ``sign(sum_j n_j - E * n_i)`` in int64 for integer counts
    (float64 otherwise), so equal counts give bitwise equal biases on every rank.
    """
    E = counts_E.shape[-1]
    if counts_E.is_floating_point():
        n = counts_E.double()
    else:
        n = counts_E.long()
    direction = torch.sign(n.sum(-1, keepdim=True) - E * n).to(torch.float32)
    return bias_E.float() + rate * direction
