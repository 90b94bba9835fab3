"""The MoE layer's plan: the path its input takes, decided when the model is built and parallelised (DESIGN
invariant 13), never probed on the hot path.

:func:`make_plan` resolves what is asked for (:class:`PlanOptions`) against what the components declare as class
attributes, once, into a frozen :class:`MoELayerPlan` the layer's forward only reads:

==========================  ===========================================================================================
decision                    made from
==========================  ===========================================================================================
``dispatcher``              the layer's ``LocalDispatcher``; parallelize injects a distributed one (``MoELayer.replan``)
``grouped_mm``              the experts' grouped-GEMM implementation; a model transform injects another (low precision)
``weights_applied_by``      ``"experts"`` when the experts ``applies_row_weights`` and the dispatcher
                            ``supports_expert_weights`` (the experts then get the rows' weights as an argument and
                            combine sums unweighted), else ``"combine"``; asking for ``"experts"`` where a side cannot
                            is a ValueError
``fp8_fused``               the experts quantize inside their own passes (the SwiGLU kernel quantizes the down
                            projection's input; a row gather, the gate / up input): only with a grouped GEMM that is
                            ``fused_fp8`` (the FP8 rowwise one, :mod:`lightning_moe.lowp.fp8_fused`) and experts that
                            declare ``fuses_fp8_quant``; ``False`` keeps the unfused path (the reference)
``regather_rows``           the experts gather their rows from the tokens themselves (and again in the backward,
                            keeping no [R, D] copy): only with the ``LocalDispatcher``, experts that
                            ``gathers_rows_from_tokens`` and a grouped GEMM that is ``exact_torch`` or runs
                            ``fp8_fused`` (the gather then quantizes); each forward the experts still check that their
                            fused kernel takes the input (CUDA or the interpreter, dtype: ``gathers_rows``)
``overlap_shared_experts``  the shared experts' forward runs inside the dispatch while the tokens travel: only with
                            shared experts and a dispatcher that ``overlaps``
``activations``             the layer's recompute / offload policy (:class:`~lightning_moe.activation_plan.ActivationPlan`;
                            ``MoELayer.activation_plan``): set by build steps through ``plan_activations``
                            (``ActivationOffload(modules=[moe])``'s transform), kept by every re-plan. The experts and
                            shared experts hold their own (``experts``, ``moe_act``, ``shared_experts``): their seams
                            lie inside their forwards, inside the FSDP hooks on them
==========================  ===========================================================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from torch import nn

from lightning_moe.activation_plan import ActivationPlan
from lightning_moe.moe.dispatch import WEIGHTS_APPLIED_BY, LocalDispatcher, TokenDispatcher, WeightsAppliedBy
from lightning_moe.moe.grouped_mm import GroupedMM

__all__ = ["MoELayerPlan", "PlanOptions", "make_plan"]


@dataclass(frozen=True)
class PlanOptions:
    """What is asked of a layer's plan. ``weights_applied_by="auto"``: the experts when both sides can;
    ``regather_rows`` / ``overlap_shared_experts`` / ``fuse_fp8_quant``: where the components allow it (same numbers
    either way, to fp32 rounding)."""

    weights_applied_by: Literal["auto", "combine", "experts"] = "auto"
    regather_rows: bool = True
    fuse_fp8_quant: bool = True
    overlap_shared_experts: bool = True

    def __post_init__(self) -> None:
        if self.weights_applied_by not in ("auto",) + WEIGHTS_APPLIED_BY:
            raise ValueError(f"weights_applied_by must be one of {('auto',) + WEIGHTS_APPLIED_BY}, got "
                             f"{self.weights_applied_by!r}")


@dataclass(frozen=True)
class MoELayerPlan:
    """One layer's resolved hot path (see the module docstring); ``options`` is what it was made from, so that a
    later step (parallelize) re-plans with a new component without losing what was asked."""

    dispatcher: TokenDispatcher
    grouped_mm: Optional[GroupedMM]  # None: experts without the grouped-GEMM seam (a registered class)
    weights_applied_by: WeightsAppliedBy
    regather_rows: bool
    fp8_fused: bool
    overlap_shared_experts: bool
    options: PlanOptions = PlanOptions()
    activations: ActivationPlan = ActivationPlan()

    def __str__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if f.name != "options" and (f.name != "activations" or self.activations != ActivationPlan())]
        return f"MoELayerPlan({', '.join(fields)})"


def make_plan(experts: nn.Module, dispatcher: TokenDispatcher, *, has_shared_experts: bool,
              options: PlanOptions = PlanOptions(), grouped_mm: Optional[GroupedMM] = None,
              activations: ActivationPlan = ActivationPlan()) -> MoELayerPlan:
    """Resolve ``options`` for these components. ``grouped_mm``: the implementation the experts are about to get
    (default: the one they hold); ``activations``: the layer's recompute / offload policy, taken as it is."""
    if not isinstance(dispatcher, TokenDispatcher):
        raise TypeError(f"dispatcher must be a lightning_moe.moe.dispatch.TokenDispatcher, got "
                        f"{type(dispatcher).__name__}")
    # capabilities are class declarations (a registered experts class without them declares none)
    experts_apply = bool(getattr(type(experts), "applies_row_weights", False))
    experts_gather = bool(getattr(type(experts), "gathers_rows_from_tokens", False))
    experts_fuse = bool(getattr(type(experts), "fuses_fp8_quant", False))
    if grouped_mm is None:
        grouped_mm = getattr(experts, "grouped_mm", None)
    fp8_fused = (options.fuse_fp8_quant and experts_fuse and grouped_mm is not None
                 and bool(getattr(grouped_mm, "fused_fp8", False)))

    asked = options.weights_applied_by
    if asked == "experts" and not (experts_apply and dispatcher.supports_expert_weights):
        side = (f"the experts ({type(experts).__name__}) do not declare applies_row_weights" if not experts_apply
                else f"{type(dispatcher).__name__} does not declare supports_expert_weights")
        raise ValueError(f"weights_applied_by='experts' but {side}: use weights_applied_by='combine' (or 'auto')")
    by_experts = asked == "experts" or (asked == "auto" and experts_apply and dispatcher.supports_expert_weights)
    return MoELayerPlan(
        dispatcher=dispatcher,
        grouped_mm=grouped_mm,
        weights_applied_by="experts" if by_experts else "combine",
        regather_rows=(options.regather_rows and isinstance(dispatcher, LocalDispatcher) and experts_gather
                       and grouped_mm is not None and (grouped_mm.exact_torch or fp8_fused)),
        fp8_fused=fp8_fused,
        overlap_shared_experts=options.overlap_shared_experts and has_shared_experts and dispatcher.overlaps,
        options=options,
        activations=activations,
    )
