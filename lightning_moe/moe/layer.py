"""MoE layer: route -> dispatch -> grouped experts -> combine (+ shared experts).

Legend: B batch, S sequence, T = B*S tokens, D hidden, E experts, e local experts, R routed rows.
The layer is single-device code: parallelize gives its plan a distributed dispatcher (:meth:`MoELayer.replan`) and
turns the expert weights into DTensors; nothing here looks up a process group. The path of the input is the plan's
(:mod:`lightning_moe.moe.layer_plan`): router -> ``plan.dispatcher`` -> experts -> ``plan.dispatcher.combine``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_moe.activation_plan import ActivationPlan
from lightning_moe.config import MoEConfig
from lightning_moe.models.registry import build
from lightning_moe.moe import experts as _experts  # noqa: F401  (registers the built-in experts this layer builds)
from lightning_moe.moe.dispatch import LocalDispatcher, TokenDispatcher
from lightning_moe.moe.grouped_mm import GroupedMM
from lightning_moe.moe.layer_plan import MoELayerPlan, PlanOptions, make_plan
from lightning_moe.moe.record import MoERecord, MoERecorder, RoutingRecord
from lightning_moe.moe.router import RoutingResult

__all__ = ["MoELayer"]

_PLANNED = ("dispatcher", "regather_rows", "overlap_shared_experts")  # instance attributes the plan owns


@torch.no_grad()
def _entropy_sum(scores_TE: Optional[Tensor], valid_T: Optional[Tensor], device: torch.device) -> Tensor:
    """Sum over valid tokens of ``-sum_e p log p`` of the normalised scores (two kernels, no host sync)."""
    if scores_TE is None:  # a router that reports no scores: unknown, not zero
        return torch.full((), float("nan"), device=device)
    ent_T = torch.special.entr(scores_TE.detach().float()).sum(-1)
    if valid_T is not None:
        ent_T = torch.where(valid_T.bool(), ent_T, 0.0)
    return ent_T.sum()


class MoELayer(nn.Module):
    """Routed experts (plus optional shared experts) replacing a transformer block's MLP.

    Args:
        config: the MoE configuration (E, k, F, routing, capacity, shared experts). ``config.router`` and
            ``config.experts`` name the router and routed-expert classes in
            :mod:`lightning_moe.models.registry`.
        hidden_size: D.
        init_std / out_init_std: normal-init stds of the expert and shared-expert input / output projections.

    The forward returns the output only; its losses and routing numbers go to the
    :class:`~lightning_moe.moe.record.MoERecorder` the caller passes (``recorder=``, under ``layer_idx``): an
    :class:`~lightning_moe.moe.record.MoERecord` with the aux and z losses (fp32 scalars attached to the graph,
    coefficients applied) and a detached :class:`~lightning_moe.moe.record.RoutingRecord` (kept assignments per
    expert, dropped assignments, valid tokens, entropy and, training with expert bias, the bias demand) of this
    process. The layer keeps no per-forward state; forwards re-run by activation checkpointing record nothing.

    ``plan`` (:class:`~lightning_moe.moe.layer_plan.MoELayerPlan`): the dispatcher, grouped GEMM and combine path,
    decided when the layer is built and again by :meth:`replan` (parallelize, model transforms); options:

    ``regather_rows`` (default True): on one process with the fused CUDA kernels, the experts gather their rows
    from the tokens (again in the backward) rather than keeping them; False keeps the dispatcher's copy (benchmarks).
    ``overlap_shared_experts`` (default True): with a distributed dispatcher that ``overlaps`` (all-to-all,
    all-gather), the shared experts' forward is queued while the routed tokens travel, between the collective's
    issue and its first use, instead of after the combine (Megatron's ``--moe-shared-expert-overlap``, without a
    side stream). The same operations on the same inputs: the output and gradients are unchanged. Forward only:
    in the backward a collective waits on everything queued before it, and torch's functional collectives wait
    for their own result at once, so overlapping the backward would need a side stream.
    ``weights_applied_by`` (default ``"auto"``): who applies the combine weights, see
    :mod:`~lightning_moe.moe.layer_plan`.
    The class attributes ``regather_rows`` and ``overlap_shared_experts`` are the defaults a layer's plan is built
    with (set them on the class before building); a built layer changes them through :meth:`replan` only.
    """

    regather_rows = True
    overlap_shared_experts = True
    activation_seams = ("forward",)  # offload "moe"

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        *,
        init_std: float = 0.02,
        out_init_std: Optional[float] = None,
    ) -> None:
        super().__init__()
        if config.num_experts <= 0:
            raise ValueError("MoELayer needs moe.num_experts > 0 (num_experts=0 means a dense MLP layer)")
        self.config = config
        self.hidden_size = hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.router = build("router", config.router, config, hidden_size, init_std=init_std)
        self.experts = build("experts", config.experts, config.num_experts, hidden_size, config.expert_hidden_size,
                             init_std=init_std, out_init_std=out_init_std)
        self.shared_experts: Optional[nn.Module] = None
        if config.shared_expert_hidden_size > 0:
            self.shared_experts = build("shared_experts", config.shared_experts, hidden_size,
                                        config.shared_expert_hidden_size, gate=config.shared_expert_gate,
                                        init_std=init_std, out_init_std=out_init_std)
        # a plain attribute (the dispatcher is no submodule): parallelize re-plans with a distributed dispatcher
        self.plan: MoELayerPlan = make_plan(
            self.experts, LocalDispatcher(pad_to_capacity=config.pad_to_capacity),
            has_shared_experts=self.shared_experts is not None,
            options=PlanOptions(regather_rows=type(self).regather_rows,
                                overlap_shared_experts=type(self).overlap_shared_experts))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PLANNED:  # the plan decides these once: a plain assignment would silently change nothing
            raise AttributeError(f"MoELayer.{name} is part of the layer's plan: call layer.replan({name}=...)"
                                 + ("" if name == "dispatcher" else f", or set MoELayer.{name} before building"))
        super().__setattr__(name, value)

    @property
    def dispatcher(self) -> TokenDispatcher:
        return self.plan.dispatcher

    @property
    def activation_plan(self) -> ActivationPlan:
        """The layer's recompute / offload policy: part of its plan (``plan.activations``)."""
        return self.plan.activations

    @activation_plan.setter
    def activation_plan(self, value: ActivationPlan) -> None:  # a build step (plan_activations)
        self.plan = dataclasses.replace(self.plan, activations=value)

    def replan(self, *, dispatcher: Optional[TokenDispatcher] = None, grouped_mm: Optional[GroupedMM] = None,
               **options: Any) -> MoELayerPlan:
        """Decide the layer's path again with a new component (``dispatcher``: parallelize; ``grouped_mm``: a model
        transform, given to the experts) and / or changed :class:`~lightning_moe.moe.layer_plan.PlanOptions`
        (``weights_applied_by``, ``regather_rows``, ``overlap_shared_experts``); the rest is kept. A build-time step:
        the forward only reads the plan. Returns the new plan; on error the old one stays."""
        unknown = set(options) - {f.name for f in dataclasses.fields(PlanOptions)}
        if unknown:
            raise ValueError(f"MoELayer.replan: unknown options {sorted(unknown)}; valid: dispatcher, grouped_mm, "
                             f"{', '.join(f.name for f in dataclasses.fields(PlanOptions))}")
        if grouped_mm is not None and not hasattr(self.experts, "set_grouped_mm"):
            raise ValueError(f"MoELayer.replan(grouped_mm=...): the experts ({type(self.experts).__name__}) have no "
                             "grouped-GEMM seam (set_grouped_mm)")
        plan = make_plan(self.experts, dispatcher if dispatcher is not None else self.plan.dispatcher,
                         has_shared_experts=self.shared_experts is not None,
                         options=dataclasses.replace(self.plan.options, **options), grouped_mm=grouped_mm,
                         activations=self.plan.activations)
        if grouped_mm is not None:
            self.experts.set_grouped_mm(grouped_mm)
        self.plan = plan
        return plan

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, plan={self.plan}"

    def forward(self, x_BSD: Tensor, padding_mask_BS: Optional[Tensor] = None, *,
                recorder: Optional[MoERecorder] = None, layer_idx: int = 0) -> Tensor:
        return self.activation_plan.forward(self._forward, x_BSD, padding_mask_BS, recorder=recorder,
                                            layer_idx=layer_idx)

    def _forward(self, x_BSD: Tensor, padding_mask_BS: Optional[Tensor] = None, *,
                 recorder: Optional[MoERecorder] = None, layer_idx: int = 0) -> Tensor:
        """``padding_mask_BS``: bool [B, S], True = real token, False = padding (the router's convention; padding
        tokens are routed nowhere and get zero routed output; shared experts still see them). None = all real.
        ``recorder``: receives this forward's :class:`~lightning_moe.moe.record.MoERecord` under ``layer_idx``
        (None: the losses and routing numbers are not wanted, e.g. in generation)."""
        if x_BSD.dim() != 3 or x_BSD.shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer expects x of shape [B, S, {self.hidden_size}], got {tuple(x_BSD.shape)}")
        B, S, D = x_BSD.shape
        if padding_mask_BS is not None and tuple(padding_mask_BS.shape) != (B, S):
            raise ValueError(
                f"padding_mask must have shape [B, S] = {(B, S)}, got {tuple(padding_mask_BS.shape)}"
            )
        x_TD = x_BSD.reshape(B * S, D)
        valid_T = padding_mask_BS.reshape(B * S) if padding_mask_BS is not None else None

        routing: RoutingResult = self.router(x_TD, valid_T, seq_len=S)
        if recorder is not None:
            recorder.add(layer_idx, self._record(routing, valid_T, B * S, x_TD.device))
        plan = self.plan
        weights_by = plan.weights_applied_by
        shared_TD: list[Tensor] = []  # the shared experts' output when the dispatch overlapped them

        # One process with the fused kernels: the experts gather their rows from x_TD themselves and again in the
        # backward, keeping no [R, D] copy (k times x_TD) for their weight gradients. Else the dispatcher moves them.
        if plan.regather_rows and self.experts.gathers_rows(x_TD):
            counts_e, ctx = plan.dispatcher.layout(routing, self.num_experts, weights_applied_by=weights_by)
            x_RD, expert_kw = None, {"rows_from": (x_TD, ctx.asg_R, ctx.pos_TK)}
        else:
            overlap = (lambda: shared_TD.append(self.shared_experts(x_TD))) if plan.overlap_shared_experts else None
            x_RD, counts_e, ctx = plan.dispatcher.dispatch(x_TD, routing, self.num_experts,
                                                           weights_applied_by=weights_by, overlap=overlap)
            if overlap is not None and len(shared_TD) != 1:
                raise RuntimeError(f"{type(plan.dispatcher).__name__} declares overlaps=True but ran `overlap` "
                                   f"{len(shared_TD)} times (exactly once is the contract)")
            expert_kw = {}
        if plan.fp8_fused:  # the experts quantize inside their own passes (lightning_moe.lowp.fp8_fused)
            expert_kw["fp8_fused"] = True
        # "experts": the experts get the rows' weights as an argument and scale their activation before the down
        # projection (as Megatron-Core does), so the combine is a plain sum whose backward keeps nothing of the
        # [R, D] expert output; "combine": the combine weights the rows.
        if weights_by == "experts":
            y_RD = self.experts(x_RD, counts_e, ctx.probs_R, **expert_kw)
        else:
            y_RD = self.experts(x_RD, counts_e, **expert_kw)
        # combine in the input dtype (the k-sum accumulates in fp32 with the fused kernels)
        y_TD = plan.dispatcher.combine(y_RD.to(x_TD.dtype), ctx, weights_applied_by=weights_by)
        if self.shared_experts is not None:
            y_TD = y_TD + (shared_TD[0] if shared_TD else self.shared_experts(x_TD))
        return y_TD.to(x_BSD.dtype).reshape(B, S, D)

    @torch.no_grad()
    def _record(self, routing: RoutingResult, valid_T: Optional[Tensor], T: int, device: torch.device) -> MoERecord:
        tpe = routing.tokens_per_expert.detach()
        dropped = (routing.num_dropped.detach() if routing.num_dropped is not None
                   else torch.zeros((), dtype=torch.int64, device=tpe.device))
        num_tokens = torch.tensor(T, dtype=torch.int64, device=device) if valid_T is None else valid_T.bool().sum()
        stats = RoutingRecord(tpe, dropped, num_tokens, routing.aux_loss.detach().float(),
                              routing.z_loss.detach().float(), _entropy_sum(routing.scores, valid_T, device),
                              routing.bias_demand)
        return MoERecord(routing.aux_loss, routing.z_loss, stats)
