"""Top-k router: fp32 gate GEMM and all routing math (Megatron-Core moe_utils semantics).

Legend: T tokens, D hidden, E experts, k top-k, B sequences, S tokens per sequence (T = B * S, batch-major).

Deterministic choices: every top-k here (expert choice, group choice, the aux-loss top-k) breaks ties towards
the lower index (stable sort), and capacity dropping breaks ties towards the earlier token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.utils._pytree
from torch import Tensor, nn

from lightning_moe.config import MoEConfig
from lightning_moe.models import registry
from lightning_moe.moe.losses import (
    aux_loss_scores,
    expert_bias_update,
    expert_counts,
    global_aux_loss,
    sequence_aux_loss,
    switch_aux_loss,
    topk_indices,
    z_loss,
)
from lightning_moe.moe.router_gemm import router_logits

__all__ = ["RoutingResult", "TopKRouter", "group_limited_topk", "capacity_keep_mask"]

# the reduction groups parallelize hands the router: a process group (None on one process)
ReductionGroup = Optional["torch.distributed.ProcessGroup"]


@dataclass
class RoutingResult:
    """What the router decided for T tokens.

    probs: [T, k] fp32 combine weights (zero for dropped and padding assignments).
    expert_ids: [T, k] int64 chosen experts.
    tokens_per_expert: [E] int64 kept assignments per expert on this rank (after capacity, padding excluded).
    aux_loss, z_loss: fp32 scalars, coefficient applied, zero when disabled.
    keep_mask: [T, k] bool, False for assignments dropped by capacity or belonging to padding tokens;
        None when every assignment is kept.
    capacity: per-expert capacity in capacity mode, else None.
    num_dropped: int64 scalar, assignments of valid tokens dropped by capacity (None in dropless mode).
    scores: [T, E] fp32 normalised scores over all experts (monitoring; no bias).
    bias_demand: [E] int64 expert-bias demand of a training forward: assignments of the actual (biased,
        group-limited) choice of valid tokens before capacity dropping; None without expert bias or in eval mode.
    """

    probs: Tensor
    expert_ids: Tensor
    tokens_per_expert: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    keep_mask: Optional[Tensor] = None
    capacity: Optional[int] = None
    num_dropped: Optional[Tensor] = None
    scores: Optional[Tensor] = None
    bias_demand: Optional[Tensor] = None


# A pytree node, so that module hooks that walk outputs (FSDP2's pre-backward hook, activation checkpointing) see its
# tensors: without it an FSDP-wrapped router frees its all-gathered weight before backward needs it.
torch.utils._pytree.register_dataclass(RoutingResult)


# ---- pure helpers ------------------------------------------------------------------------------------


def _sum_over(t: Tensor, group: ReductionGroup) -> Tensor:
    """``t`` summed over ``group``; ``t`` itself when ``group`` is None.

    For counts and normalisers only: no gradient flows through the reduction.
    """
    if group is None:
        return t
    from lightning_moe.collectives import all_reduce, wait

    return wait(all_reduce(t, "sum", group))


def group_limited_topk(choice_TE: Tensor, k: int, num_groups: int, group_topk: int) -> Tensor:
    """Expert ids [T, k] chosen within the best ``group_topk`` of ``num_groups`` equal groups of experts.

    Group g's score is the sum of its top ``k // group_topk`` entries of ``choice_TE``; the ``group_topk``
    best groups are kept (ties: lower group index), the others masked to -inf, then the top-k over what is
    left (ties: lower expert index). DeepSeek-V3 node-limited routing / Megatron ``group_limited_topk``.
    """
    T, E = choice_TE.shape
    per_group = k // group_topk
    grouped = choice_TE.reshape(T, num_groups, E // num_groups)
    group_scores_TG = torch.sort(grouped, dim=-1, descending=True)[0][..., :per_group].sum(-1)
    groups_TG = topk_indices(group_scores_TG, group_topk)
    keep_TG = torch.zeros(T, num_groups, dtype=torch.bool, device=choice_TE.device)
    keep_TG.scatter_(1, groups_TG, True)
    keep_TE = keep_TG.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)
    return topk_indices(choice_TE.masked_fill(~keep_TE, float("-inf")), k)


def capacity_keep_mask(
    probs_TK: Tensor, ids_TK: Tensor, num_experts: int, capacity: int, policy: str, valid_T: Optional[Tensor] = None
) -> Tensor:
    """bool [T, k]: which assignments fit in their expert's ``capacity``.

    Padding tokens (``valid_T`` False) are never kept and take no capacity. Per expert, at most ``capacity``
    assignments are kept: ``policy="probs"`` keeps the largest ``probs`` (ties: the earlier token),
    ``"position"`` the earliest tokens (token order, then choice order). No host synchronisation.
    """
    T, k = ids_TK.shape
    ids_A = ids_TK.reshape(-1).long()
    if valid_T is not None:
        ids_A = torch.where(valid_T.unsqueeze(-1).expand(T, k).reshape(-1), ids_A, torch.full_like(ids_A, num_experts))
    if policy == "probs":
        order_A = torch.sort(probs_TK.detach().reshape(-1), descending=True, stable=True)[1]
        order_A = order_A[torch.sort(ids_A[order_A], stable=True)[1]]
    elif policy == "position":
        order_A = torch.sort(ids_A, stable=True)[1]
    else:
        raise ValueError(f"unknown drop_policy {policy!r}; expected 'probs' or 'position'")
    sorted_ids_A = ids_A[order_A]
    counts = torch.bincount(sorted_ids_A, minlength=num_experts + 1)
    starts = counts.cumsum(0) - counts
    rank_A = torch.arange(ids_A.numel(), device=ids_A.device) - starts[sorted_ids_A]
    keep_sorted_A = (rank_A < capacity) & (sorted_ids_A < num_experts)
    keep_A = torch.zeros_like(keep_sorted_A).scatter_(0, order_A, keep_sorted_A)
    return keep_A.reshape(T, k)


# ---- the router --------------------------------------------------------------------------------------


@registry.register("router", "topk")
class TopKRouter(nn.Module):
    """fp32 gate ``logits = x W^T`` (W: [E, D]) followed by top-k routing and the router losses.

    Reduction seam (set from outside by parallelize; None on one process, see DESIGN invariant 1):

    - ``token_group``: the ranks over which ONE micro-batch's tokens are split (tp x cp). The "aux" and
      "seq" counts and their token normalisers are summed over it, so the partial losses of those ranks add up
      to the loss of the data shard's micro-batch; each data shard's loss is then divided by
      ``num_data_shards`` (a mean over data shards, Megatron's definition).
    - ``global_group``: every rank routing distinct tokens (dp x cp x tp). The "global" aux counts and
      normaliser and the z-loss's token normaliser are summed over it (and the expert-bias demand, by the step's
      gradient finalisation, before :meth:`update_expert_bias`): the partial "global" aux and z losses of all ranks add up to the loss of the whole
      global micro-batch, exactly one process's on the same tokens.

    Expert bias (``config.expert_bias``): ``expert_bias`` [E] fp32 persistent buffer, added to the scores
    for the choice only. A training forward returns the demand on each expert (``RoutingResult.bias_demand``:
    the assignments of the actual, biased and group-limited, choice of valid tokens *before* capacity dropping,
    which capacity would clip), int64 so counts stay exact; the router keeps no count itself. The step's demand,
    summed over micro-batches and ranks, comes back through :meth:`update_expert_bias`.
    """

    def __init__(self, config: MoEConfig, hidden_size: int, init_std: float = 0.02) -> None:
        super().__init__()
        if config.num_experts <= 0:
            raise ValueError("TopKRouter needs moe.num_experts > 0")
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.hidden_size = hidden_size
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(self.num_experts, hidden_size, dtype=torch.float32))
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.register_buffer("expert_bias", None)
        self.token_group: ReductionGroup = None
        self.global_group: ReductionGroup = None
        # data shards whose per-micro-batch "aux"/"seq" losses are averaged (each rank's partial is divided by it);
        # "global" and the z-loss are normalised by the global micro-batch's valid tokens instead
        self.num_data_shards = 1
        self.reset_parameters()

    def _apply(self, fn: Any, recurse: bool = True) -> "TopKRouter":
        # Routing state stays fp32 whatever casts the module (Lightning's bf16-true runs module.to(bf16), which
        # would round a 1e-3 bias step away). Keep the exact fp32 values: move the saved originals instead.
        saved = {n: t.detach() for n, t in list(self._parameters.items()) + list(self._buffers.items())
                 if t is not None and t.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, orig in saved.items():
            cur = self._parameters.get(name, self._buffers.get(name))
            if cur is not None and cur.dtype != torch.float32:
                # exact values where they exist (a meta original has none: keep the new storage, in fp32)
                fixed = cur.detach().float() if orig.is_meta and not cur.is_meta else orig.to(device=cur.device)
                if name in self._parameters:
                    cur.data = fixed
                else:
                    self._buffers[name] = fixed
        return self

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()

    def extra_repr(self) -> str:
        c = self.config
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"score_func={c.score_func}, expert_bias={c.expert_bias}")

    # ---- forward ------------------------------------------------------------------------------------
    def forward(
        self, x_TD: Tensor, padding_mask_T: Optional[Tensor] = None, seq_len: Optional[int] = None
    ) -> RoutingResult:
        """Route ``x_TD`` [T, D] (or [B, S, D], then ``seq_len`` defaults to S).

        ``padding_mask_T``: bool [T] (or [B, S]), True = real token; None = all real. ``seq_len`` splits the
        batch-major tokens into sequences for the "seq" aux loss (None: one sequence).
        """
        if x_TD.dim() == 3:
            B, S, D = x_TD.shape
            seq_len = S if seq_len is None else seq_len
            x_TD = x_TD.reshape(B * S, D)
            if padding_mask_T is not None:
                padding_mask_T = padding_mask_T.reshape(B * S)
        # fp32 logits; on CUDA with bf16 activations through bf16 tensor cores at fp32-level precision
        logits_TE = router_logits(x_TD, self.weight)
        return self.route(logits_TE, padding_mask_T, seq_len)

    def route(
        self, logits_TE: Tensor, padding_mask_T: Optional[Tensor] = None, seq_len: Optional[int] = None
    ) -> RoutingResult:
        """All routing math on fp32 logits [T, E]; see the class and module docstrings."""
        cfg = self.config
        E, k = self.num_experts, self.top_k
        if logits_TE.dim() != 2 or logits_TE.shape[1] != E:
            raise ValueError(f"expected logits of shape [T, {E}], got {tuple(logits_TE.shape)}")
        T = logits_TE.shape[0]
        logits_TE = logits_TE.float()
        valid_T = None
        if padding_mask_T is not None:
            if padding_mask_T.numel() != T:
                raise ValueError(f"padding mask has {padding_mask_T.numel()} entries for {T} tokens")
            valid_T = padding_mask_T.reshape(T).to(device=logits_TE.device, dtype=torch.bool)
        if seq_len is None:
            seq_len = T
        elif seq_len <= 0 or T % seq_len:
            raise ValueError(f"{T} tokens do not split into sequences of seq_len={seq_len}")

        # scores over all experts, and what the choice is made on
        if cfg.score_func == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
            choice_TE = scores_TE if cfg.pre_softmax else logits_TE
        else:
            scores_TE = torch.sigmoid(logits_TE)
            choice_TE = scores_TE

        # choice
        if cfg.force_balance:
            ids_TK = (torch.arange(T, device=logits_TE.device).unsqueeze(1) * k
                      + torch.arange(k, device=logits_TE.device)) % E
        else:
            with torch.no_grad():
                choice_TE = choice_TE.detach()
                if self.expert_bias is not None:
                    choice_TE = choice_TE + self.expert_bias.to(device=choice_TE.device, dtype=torch.float32)
                if cfg.num_groups is not None:
                    assert cfg.group_topk is not None
                    ids_TK = group_limited_topk(choice_TE, k, cfg.num_groups, cfg.group_topk)
                else:
                    ids_TK = topk_indices(choice_TE, k)

        # combine weights (unbiased scores of the chosen experts)
        if cfg.score_func == "softmax" and not cfg.pre_softmax:
            probs_TK = torch.softmax(logits_TE.gather(1, ids_TK), dim=-1)  # Mixtral: already sums to 1
        else:
            probs_TK = scores_TE.gather(1, ids_TK)
            if cfg.norm_topk_prob and k > 1:
                probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.scaling_factor is not None:
            probs_TK = probs_TK * cfg.scaling_factor

        # expert-bias demand (training only): returned, summed over the step by its finalisation
        bias_demand: Optional[Tensor] = None
        if self.expert_bias is not None and self.training:
            with torch.no_grad():
                bias_demand = expert_counts(ids_TK, E, valid_T)

        # capacity / padding
        keep_TK: Optional[Tensor] = None
        capacity: Optional[int] = None
        num_dropped: Optional[Tensor] = None
        if cfg.capacity_factor is not None:
            capacity = int(math.ceil(cfg.capacity_factor * T * k / E))
            keep_TK = capacity_keep_mask(probs_TK, ids_TK, E, capacity, cfg.drop_policy, valid_T)
            valid_TK = torch.ones_like(keep_TK) if valid_T is None else valid_T.unsqueeze(-1).expand(T, k)
            num_dropped = (valid_TK & ~keep_TK).sum()
        elif valid_T is not None:
            keep_TK = valid_T.unsqueeze(-1).expand(T, k)
        if keep_TK is not None:
            probs_TK = probs_TK.masked_fill(~keep_TK, 0.0)
        tokens_per_expert = expert_counts(ids_TK, E, keep_TK)

        # losses
        aux, z, norm_scores_TE = self._losses(logits_TE, scores_TE, valid_T, seq_len)
        if norm_scores_TE is None:
            norm_scores_TE = aux_loss_scores(logits_TE, cfg.score_func) if cfg.score_func == "sigmoid" else scores_TE

        return RoutingResult(
            probs=probs_TK,
            expert_ids=ids_TK,
            tokens_per_expert=tokens_per_expert,
            aux_loss=aux,
            z_loss=z,
            keep_mask=keep_TK,
            capacity=capacity,
            num_dropped=num_dropped,
            scores=norm_scores_TE.detach(),
            bias_demand=bias_demand,
        )

    def _losses(
        self, logits_TE: Tensor, scores_TE: Tensor, valid_T: Optional[Tensor], seq_len: int
    ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        cfg = self.config
        E, k = self.num_experts, self.top_k
        T = logits_TE.shape[0]
        zero = logits_TE.new_zeros((), dtype=torch.float32)
        aux, z = zero, zero
        s_TE: Optional[Tensor] = None
        global_num_tokens: Optional[Tensor] = None  # valid tokens of the global micro-batch (over global_group)
        if cfg.aux_loss_type != "none" and cfg.aux_loss_coeff > 0:
            s_TE = scores_TE if cfg.score_func == "softmax" else aux_loss_scores(logits_TE, cfg.score_func)
            with torch.no_grad():
                ids_TK = topk_indices(s_TE.detach(), k)
            if cfg.aux_loss_type == "seq":
                B = T // seq_len
                v_BS = None if valid_T is None else valid_T.reshape(B, seq_len)
                counts_BE = _sum_over(expert_counts(ids_TK.reshape(B, seq_len, k), E, v_BS), self.token_group)
                n_B = counts_BE.sum(-1) // k
                aux = sequence_aux_loss(s_TE, counts_BE, n_B, k, cfg.aux_loss_coeff, seq_len, valid_T)
            else:
                group = self.token_group if cfg.aux_loss_type == "aux" else self.global_group
                counts_E = _sum_over(expert_counts(ids_TK, E, valid_T), group)
                n = counts_E.sum() // k
                if cfg.aux_loss_type == "aux":
                    aux = switch_aux_loss(s_TE, counts_E, n, k, cfg.aux_loss_coeff, valid_T)
                else:
                    global_num_tokens = n  # every valid token of the global micro-batch, k assignments each
                    aux = global_aux_loss(s_TE, counts_E, n, k, cfg.aux_loss_coeff, valid_T)
            if cfg.aux_loss_type in ("aux", "seq") and self.num_data_shards > 1:
                # per data shard (Megatron's definition; nonlinear in the counts): the mean over data shards
                aux = aux / self.num_data_shards
        if cfg.z_loss_coeff > 0:
            # The z-loss is linear in the tokens: every rank divides its own token sum by the valid tokens of the
            # whole global micro-batch (summed over global_group = dp x cp x tp), so the partials, added by the
            # data-parallel and tp gradient reductions (and by the routing all-reduce for the logged value), are
            # exactly one process's z-loss on that micro-batch, however padding splits the real tokens over the
            # data ranks. The count: free from the "global" aux counts when they exist, else one scalar all-reduce
            # per layer over global_group, as the "global" aux loss does (nothing the module holds before this
            # forward gives it: its LM count is of labels, not of routed tokens, and is reduced after the forward).
            if global_num_tokens is None:
                n_local = torch.tensor(T, device=logits_TE.device) if valid_T is None else valid_T.sum()
                global_num_tokens = _sum_over(n_local.long(), self.global_group)
            z = z_loss(logits_TE, cfg.z_loss_coeff, valid_T, global_num_tokens)
        return aux, z, s_TE

    # ---- aux-loss-free balancing ----------------------------------------------------------------------
    @torch.no_grad()
    def update_expert_bias(self, counts_E: Tensor) -> None:
        """Once per optimizer step: ``b_i += rate * sign(mean(n) - n_i)`` with ``counts_E`` = n, the step's
        ``bias_demand`` summed over every micro-batch and every rank routing distinct tokens (the gradient
        finalisation packs it into its one routing all-reduce), so the bias stays bitwise identical on every rank.
        No-op without expert bias."""
        if self.expert_bias is None:
            return
        new_bias = expert_bias_update(self.expert_bias, counts_E, self.config.bias_update_rate)
        self.expert_bias.copy_(new_bias)
