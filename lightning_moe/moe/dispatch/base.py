"""The token-dispatcher contract: :class:`TokenDispatcher`, :class:`DispatchContext`, and who applies the combine
weights.

Legend: T local tokens, D hidden, k top-k, E global experts, e local experts, R rows on this rank's experts.

Contract (every dispatcher): ``x_RD, counts_e, ctx = dispatch(x_TD, routing, E, weights_applied_by=w)`` returns
rows grouped by LOCAL expert (expert-major; inside an expert, sources in rank order, tokens in their order) and int64
counts per local expert on x's device; the experts map them to ``y_RD``; ``combine(y_RD, ctx)`` returns
``y_TD[t] = sum_k probs[t, k] * y(t, k)`` over kept assignments, on the rank that owns token t. Every step is
differentiable (x, probs, and through y the expert weights).

Who applies the combine weights is the caller's explicit choice at ``dispatch``, recorded in the context:

* ``"combine"`` (the reference): the experts get unweighted rows and ``combine`` weights their outputs;
* ``"experts"``: ``dispatch`` also hands over each row's weight, ``ctx.probs_R`` ([R] fp32, differentiable; 0 for
  padding rows), which the experts must apply (Megatron-Core scales the activation before the down projection);
  ``combine`` then sums the rows unweighted, and keeps nothing of the [R, D] expert output for the weights' gradient.

``combine(y_RD, ctx, weights_applied_by=w)`` checks ``w`` against the context, so a caller holding another choice
gets a ValueError rather than weights applied twice or never. The MoE layer fixes the choice once, in its plan
(:mod:`lightning_moe.moe.layer_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Optional

from torch import Tensor

from lightning_moe.moe.dispatch.rows import _PermuteRows, _RowProbs, _SumRows, _UnpermuteRows
from lightning_moe.moe.router import RoutingResult

WeightsAppliedBy = Literal["combine", "experts"]
WEIGHTS_APPLIED_BY: tuple[str, ...] = ("combine", "experts")


def check_weights_applied_by(value: str) -> None:
    if value not in WEIGHTS_APPLIED_BY:
        raise ValueError(f"weights_applied_by must be one of {WEIGHTS_APPLIED_BY}, got {value!r}")


@dataclass
class DispatchContext:
    """What combine needs to undo dispatch (opaque to the layer, but for ``probs_R``).

    num_tokens: tokens of the combine output before any reduction (T, or the gathered token count).
    probs_TK: combine weights of those tokens.
    pos_TK: the row (of the rows that reach combine's unpermute) holding each assignment's output; -1 for
        assignments with no row (dropped by capacity, or on another rank's experts for the all-gather dispatcher).
    asg_R: the assignment (flat index into [num_tokens, k]) of each of those rows; -1 for padding rows.
    has_dropped: some pos_TK are -1.  rows_covered: no asg_R is -1.
    extra: the distributed dispatcher's own state: the all-to-all's split sizes and regroup indices, the
        all-gather dispatcher's local token count, or DeepEP's buffer and handle.
    weights_applied_by: the choice ``dispatch`` was given (see the module docstring).
    probs_R: with ``"experts"``, the combine weight of every row ``dispatch`` returned ([R] fp32); else None.
    """

    num_tokens: int
    probs_TK: Tensor
    pos_TK: Tensor
    asg_R: Tensor
    has_dropped: bool = False
    rows_covered: bool = True
    extra: Any = None
    weights_applied_by: WeightsAppliedBy = "combine"
    probs_R: Optional[Tensor] = None


class TokenDispatcher:
    """Interface (see the module docstring). Subclasses implement ``_dispatch`` and ``_combine``; the public
    ``dispatch`` / ``combine`` check the arguments and record who applies the combine weights.

    ``overlaps``: ``dispatch`` also takes ``overlap``, a callable it runs exactly once after it has issued the
    rows' collective and before it reads the result, so that work independent of the routed rows (the shared
    experts) is queued while the tokens travel (functional collectives wait on first use). Dispatchers that do not
    overlap refuse an ``overlap``.
    ``supports_expert_weights``: ``dispatch(weights_applied_by="experts")`` can hand each row its weight."""

    num_local_experts: Optional[int] = None
    overlaps: ClassVar[bool] = False
    supports_expert_weights: ClassVar[bool] = False

    def dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int, *,
                 weights_applied_by: WeightsAppliedBy = "combine",
                 overlap: Optional[Callable[[], Any]] = None) -> tuple[Tensor, Tensor, DispatchContext]:
        self._check_dispatch(weights_applied_by)
        if overlap is not None and not self.overlaps:
            raise ValueError(f"{type(self).__name__} does not overlap work with its dispatch (overlaps=False): "
                             "pass overlap=None and run the work after it")
        x_RD, counts_e, ctx = self._dispatch(x_TD, routing, num_experts, overlap)
        return x_RD, counts_e, self._record(ctx, weights_applied_by)

    def combine(self, y_RD: Tensor, ctx: DispatchContext, *,
                weights_applied_by: Optional[WeightsAppliedBy] = None) -> Tensor:
        """``weights_applied_by``: when given, checked against the choice ``dispatch`` recorded in ``ctx``."""
        if weights_applied_by is not None and weights_applied_by != ctx.weights_applied_by:
            raise ValueError(
                f"combine(weights_applied_by={weights_applied_by!r}) of rows dispatched with weights_applied_by="
                f"{ctx.weights_applied_by!r}: the combine weights would be applied twice or never; give dispatch "
                "and combine the same choice (the MoE layer's plan fixes it)")
        return self._combine(y_RD, ctx)

    # ---- for subclasses -------------------------------------------------------------------------------------
    def _dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int,
                  overlap: Optional[Callable[[], Any]]) -> tuple[Tensor, Tensor, DispatchContext]:
        raise NotImplementedError

    def _combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        raise NotImplementedError

    def _row_weights(self, ctx: DispatchContext) -> Tensor:
        """[R] fp32 weights of the rows ``_dispatch`` returned; here those whose assignments ``ctx`` describes
        (a dispatcher whose combine-side rows are not the experts' rows moves them the rows' way)."""
        return _RowProbs.apply(ctx.probs_TK.float(), ctx.asg_R, ctx.pos_TK)

    def _check_dispatch(self, weights_applied_by: str) -> None:
        check_weights_applied_by(weights_applied_by)
        if weights_applied_by == "experts" and not self.supports_expert_weights:
            raise ValueError(f"{type(self).__name__} cannot hand the rows their combine weights "
                             "(supports_expert_weights=False): use weights_applied_by='combine'")

    def _record(self, ctx: DispatchContext, weights_applied_by: WeightsAppliedBy) -> DispatchContext:
        ctx.weights_applied_by = weights_applied_by
        ctx.probs_R = self._row_weights(ctx) if weights_applied_by == "experts" else None
        return ctx


def _permute(x_TD: Tensor, probs_TK: Tensor, pos_TK: Tensor, asg_R: Tensor, has_dropped: bool,
             rows_covered: bool) -> tuple[Tensor, DispatchContext]:
    rows = _PermuteRows.apply(x_TD, asg_R, pos_TK, has_dropped, rows_covered)
    return rows, DispatchContext(pos_TK.shape[0], probs_TK, pos_TK, asg_R, has_dropped, rows_covered)


def _unpermute(y_RD: Tensor, ctx: DispatchContext) -> Tensor:
    """The rows back to their tokens, weighted unless the experts applied the weights."""
    if ctx.weights_applied_by == "experts":
        return _SumRows.apply(y_RD, ctx.pos_TK, ctx.asg_R, ctx.has_dropped, ctx.rows_covered)
    return _UnpermuteRows.apply(y_RD, ctx.probs_TK, ctx.pos_TK, ctx.asg_R, ctx.has_dropped, ctx.rows_covered)
