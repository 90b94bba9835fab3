"""What an MoE layer's forward hands its caller (DESIGN invariant 13): the layer keeps no per-forward state.

A caller that wants a forward's losses and routing numbers passes an :class:`MoERecorder` into it
(``MoETransformer.forward`` makes one for its training path and returns what it collected in its
:class:`~lightning_moe.models.outputs.LMStepOutput`); each MoE layer adds one :class:`MoERecord`: its aux and z
losses, attached to the graph, and a detached :class:`RoutingRecord`. Routing records add up (``+``): the module's
step accumulator sums them over a step's micro-batches, the gradient finalisation over ranks
(:mod:`lightning_moe.parallel.finalize`), and the routing monitor over a window of steps.

A forward re-run by activation checkpointing inside the backward adds nothing (:func:`in_recomputation`): the
original forward's record is the one that counts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from torch import Tensor

from lightning_moe.autograd import in_recomputation

__all__ = ["MoERecord", "MoERecorder", "ROUTING_SCALARS", "RoutingRecord"]


@dataclass
class RoutingRecord:
    """Detached routing numbers of one MoE layer, summed over the forwards (and ranks) it covers:
    ``tokens_per_expert`` [E] kept assignments per expert, ``num_dropped`` assignments of valid tokens dropped by
    capacity, ``num_tokens`` valid tokens routed, ``aux_loss`` / ``z_loss`` the sums of the (rank-partial,
    coefficient applied) losses, ``entropy`` the sum over valid tokens of the entropy (nats) of the router's score
    distribution over all E experts (NaN when the router reports no scores), and ``bias_demand`` [E] the expert-bias
    demand (assignments of the biased choice of valid tokens before capacity; None without expert bias), which the
    finalisation turns into the expert-bias update. Counts are int64 from a layer, fp32 after the finalisation's
    reduction."""

    tokens_per_expert: Tensor
    num_dropped: Tensor
    num_tokens: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    entropy: Tensor
    bias_demand: Optional[Tensor] = None

    def __add__(self, other: "RoutingRecord") -> "RoutingRecord":
        if (self.bias_demand is None) != (other.bias_demand is None):
            raise ValueError("cannot add a routing record with expert-bias demand to one without")
        return RoutingRecord(*(a + b if a is not None else None for a, b in zip(self.values(), other.values())))

    def values(self) -> tuple[Optional[Tensor], ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


#: RoutingRecord's per-layer scalars, in the order the finalisation and the monitor pack them after the E counts
ROUTING_SCALARS = ("num_dropped", "num_tokens", "aux_loss", "z_loss", "entropy")


@dataclass
class MoERecord:
    """One forward of one MoE layer: ``aux_loss`` and ``z_loss`` are fp32 scalars attached to the graph
    (coefficients applied) for the objective; ``routing`` is detached, for the step's reductions and monitoring."""

    aux_loss: Tensor
    z_loss: Tensor
    routing: RoutingRecord


class MoERecorder:
    """The explicit channel from the MoE layers of one forward to its caller: ``records`` maps a layer's index to
    its :class:`MoERecord`. Pass a fresh recorder to each forward."""

    def __init__(self) -> None:
        self.records: dict[int, MoERecord] = {}

    def add(self, layer_idx: int, record: MoERecord) -> None:
        """Called by an MoE layer's forward; a forward re-run by activation checkpointing (inside the backward) is
        ignored, so routing is counted once."""
        if in_recomputation():
            return
        if layer_idx in self.records:
            raise RuntimeError(f"MoE layer {layer_idx} recorded twice into one MoERecorder: pass a fresh recorder to "
                               "each forward")
        self.records[layer_idx] = record
