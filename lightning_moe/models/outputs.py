"""The model's typed output for a training or evaluation step (DESIGN invariant 13)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from lightning_moe.moe.record import MoERecord, RoutingRecord

__all__ = ["LMStepOutput"]


@dataclass
class LMStepOutput:
    """What ``MoETransformer.forward(..., labels_BS=...)`` returns: everything one micro-batch's step needs.

    ``loss_sum``: the sum of this process's token cross-entropies (fp32 scalar, attached to the graph);
    ``num_tokens``: this process's valid labels (int64 scalar); ``moe``: per MoE layer index its
    :class:`~lightning_moe.moe.record.MoERecord` (aux and z losses attached to the graph, detached routing record).
    Nothing is reduced over ranks yet: the module sums ``loss_sum`` / ``num_tokens`` over the data ranks and the
    gradient finalisation the routing records.
    """

    loss_sum: Tensor
    num_tokens: Tensor
    moe: dict[int, MoERecord] = field(default_factory=dict)

    @property
    def aux_loss(self) -> Tensor:
        """Sum over MoE layers of the aux losses (with grad; fp32 zero without MoE layers)."""
        return sum((r.aux_loss for r in self.moe.values()), self.loss_sum.new_zeros(()))

    @property
    def z_loss(self) -> Tensor:
        return sum((r.z_loss for r in self.moe.values()), self.loss_sum.new_zeros(()))

    @property
    def routing(self) -> dict[int, RoutingRecord]:
        return {i: r.routing for i, r in self.moe.items()}
