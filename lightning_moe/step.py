"""The typed values of one optimizer step (DESIGN invariant 13; docs/architecture.md draws the flow):

    module.training_step -> model.forward -> LMStepOutput      (per micro-batch; models/outputs.py)
        -> StepAccumulator.add                                  (the module's, over the step's micro-batches)
    after the last backward: StepAccumulator.pop -> StepRecord
        -> finalize_step(record, ...) -> StepResult             (parallel/finalize.py, through the strategy's hook)
        -> the module's ``step_result``, its logging and the routing monitor

Nothing here communicates: the module reduces the loss sum and token count over the data ranks before adding them,
the finalisation reduces the routing records over every rank that routes distinct tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from lightning_moe.moe.record import RoutingRecord

__all__ = ["StepAccumulator", "StepRecord", "StepResult"]


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as the module accumulated it: the loss sum and valid-token count already summed over the
    data ranks (fp32, detached), the micro-batches, whether the loss was already divided by the step's token count
    (one micro-batch: ``prescaled``), and per MoE layer the routing record of this process summed over the
    micro-batches (not yet over ranks)."""

    loss_sum: Tensor
    num_tokens: Tensor
    num_micro_batches: int
    prescaled: bool
    routing: dict[int, RoutingRecord]


class StepAccumulator:
    """The module's running optimizer step: :meth:`add` per micro-batch, :meth:`pop` once at finalisation."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._loss_sum: Optional[Tensor] = None
        self._num_tokens: Optional[Tensor] = None
        self._routing: dict[int, RoutingRecord] = {}
        self.num_micro_batches = 0
        self.prescaled = False  # set by the module when it divided the loss by the step's token count itself

    def add(self, loss_sum: Tensor, num_tokens: Tensor, routing: dict[int, RoutingRecord]) -> None:
        """One micro-batch: its loss sum and valid tokens over every data rank, and this process's routing records."""
        loss_sum, num_tokens = loss_sum.detach().float(), num_tokens.detach().float()
        if self._loss_sum is None or self._num_tokens is None:
            self._loss_sum, self._num_tokens = loss_sum, num_tokens
        else:
            self._loss_sum, self._num_tokens = self._loss_sum + loss_sum, self._num_tokens + num_tokens
        if self.num_micro_batches and set(routing) != set(self._routing):
            raise RuntimeError(f"the micro-batches of one step recorded different MoE layers "
                               f"({sorted(self._routing)} then {sorted(routing)})")
        for idx, rec in routing.items():
            self._routing[idx] = rec if idx not in self._routing else self._routing[idx] + rec
        self.num_micro_batches += 1

    def pop(self) -> StepRecord:
        """The step so far, and start the next one. RuntimeError when no micro-batch was added."""
        if self._loss_sum is None or self._num_tokens is None:
            raise RuntimeError("gradient finalisation without a training_step: the step's token count is unknown")
        record = StepRecord(self._loss_sum, self._num_tokens, self.num_micro_batches, self.prescaled,
                            dict(sorted(self._routing.items())))
        self._reset()
        return record


@dataclass
class StepResult:
    """One finalised optimizer step, identical on every rank: the mean token loss, the valid tokens (all data ranks
    and micro-batches), the micro-batches, per MoE layer index the routing record summed over every rank routing
    distinct tokens and over the micro-batches (fp32; the monitor's input), when the step's work was synchronised
    (``time.perf_counter()``), and whether an empty step was skipped (gradients dropped) instead of raising."""

    loss: Tensor
    num_tokens: Tensor
    num_micro_batches: int
    routing: dict[int, RoutingRecord] = field(default_factory=dict)
    finished_at: float = 0.0
    skipped: bool = False

    @property
    def aux_loss(self) -> Tensor:
        """Sum over MoE layers of the per-micro-batch mean aux loss."""
        return self._layer_sum("aux_loss")

    @property
    def z_loss(self) -> Tensor:
        return self._layer_sum("z_loss")

    def _layer_sum(self, name: str) -> Tensor:
        vals = [getattr(r, name) for r in self.routing.values()]
        total = torch.stack(vals).sum() if vals else self.loss.new_zeros(())
        return total / max(self.num_micro_batches, 1)
