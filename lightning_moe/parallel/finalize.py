"""Gradient finalisation of one optimizer step (DESIGN invariants 4, 5 and 10).

After the last micro-batch's backward and before any ``on_before_optimizer_step`` hook (callbacks' or the
module's) runs, :func:`finalize_step`, given the step's :class:`~lightning_moe.step.StepRecord`:

1. sums the gradients of tp-replicated parameters that saw distinct sequence-parallel tokens over tp;
2. reduces the record's routing of every MoE layer over every rank that routes distinct tokens, in ONE all-reduce
   (kept assignments per expert, dropped assignments, valid tokens, the aux and z losses, the router entropy, and
   the expert-bias demand), so every logged routing number is the same under every layout;
3. hands the reduced expert-bias demand to ``update_expert_bias`` (the model's
   :meth:`~lightning_moe.models.transformer.MoETransformer.update_expert_bias`: bitwise identical on every rank);
4. checks the step (no valid token anywhere, or a non-finite loss: one host sync) and multiplies every gradient by
   ``accumulate_grad_batches / N``, N the valid tokens of the whole step (Lightning already divided the loss by
   ``accumulate_grad_batches``). A step of one micro-batch knows N before its backward: the module divides its loss
   by N there (``StepRecord.prescaled``) and this pass over every gradient is skipped.

Everything arrives as an argument: this module knows no LightningModule, no strategy and no model class. The
module calls it from its ``optimizer_step`` (a wrapped optimizer closure, :func:`finalizing_closure`, so it runs
between the backward and the hooks that inspect gradients): through
:meth:`~lightning_moe.strategies.MoEParallelStrategy.finalize_step`, which adds its layout's groups, or directly on
one device.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_moe.moe.record import ROUTING_SCALARS, RoutingRecord
from lightning_moe.parallel.grads import all_reduce_grads, scale_grads_
from lightning_moe.step import StepRecord, StepResult

__all__ = ["finalize_step", "finalizing_closure", "EmptyStepError"]


class EmptyStepError(ValueError):
    """No valid token (label != -100 and not padding) in the whole global batch of an optimizer step."""


def _reduce_routing(routing: dict[int, RoutingRecord], global_group: Optional[ProcessGroup]
                    ) -> dict[int, RoutingRecord]:
    """Sum every layer's routing record (this process's, over the step's micro-batches) over ``global_group`` in one
    all-reduce; fp32 results (the expert-bias demand is exact in fp32 below 2**24 assignments per expert and step)."""
    if not routing:
        return {}
    packed, layout = [], []
    for idx, rec in routing.items():
        parts = [rec.tokens_per_expert.float(), torch.stack([getattr(rec, n).float() for n in ROUTING_SCALARS])]
        if rec.bias_demand is not None:
            parts.append(rec.bias_demand.float())
        packed.append(torch.cat([p.reshape(-1).to(parts[0].device) for p in parts]))
        layout.append((idx, rec.tokens_per_expert.numel(), rec.bias_demand is not None))
    flat = torch.cat(packed)
    if global_group is not None:
        from lightning_moe.collectives import all_reduce

        flat = all_reduce(flat, "sum", global_group)
    out: dict[int, RoutingRecord] = {}
    offset = 0
    for idx, E, has_bias in layout:
        tpe, scalars = flat[offset:offset + E], flat[offset + E:offset + E + len(ROUTING_SCALARS)]
        offset += E + len(ROUTING_SCALARS)
        bias = None
        if has_bias:
            bias, offset = flat[offset:offset + E], offset + E
        out[idx] = RoutingRecord(tpe, **dict(zip(ROUTING_SCALARS, scalars.unbind())), bias_demand=bias)
    return out


def finalize_step(
    record: StepRecord,
    *,
    parameters: Iterable[nn.Parameter],
    accumulate_grad_batches: int,
    update_expert_bias: Callable[[dict[int, Tensor]], None],
    tp_sync_modules: Iterable[nn.Module] = (),
    tp_group: Optional[ProcessGroup] = None,
    global_group: Optional[ProcessGroup] = None,
    skip_empty: bool = False,
    step: int = 0,
    tp_reduce_dtype: Optional[torch.dtype] = None,
) -> StepResult:
    """Finalise the gradients of one optimizer step in place and return its (global) statistics.

    ``record``: the step's loss sum and valid-token count over all data ranks and this process's routing records;
    ``parameters``: every trainable parameter (on any meshes); ``update_expert_bias``: called once with
    ``{layer index: the step's expert-bias demand [E], int64, summed over every rank}`` for the layers that have
    expert bias (not called when none has); ``tp_sync_modules``: the modules whose own parameters' gradients must be
    summed over ``tp_group`` (in ``tp_reduce_dtype``, None: their own dtype); ``global_group``: every rank routing
    distinct tokens (None on one process); ``step``: the step's index (for messages). Collective: every rank calls
    it with the same arguments. Raises :class:`EmptyStepError` when the step has no valid token (or drops the
    gradients and returns with ``skipped=True`` when ``skip_empty``), ``FloatingPointError`` when the loss is not
    finite.
    """
    params = [p for p in parameters if p.requires_grad]
    if tp_group is not None:
        sync = [p for m in tp_sync_modules for p in m.parameters(recurse=False) if p.grad is not None]
        all_reduce_grads(sync, tp_group, reduce_dtype=tp_reduce_dtype)
    routing = _reduce_routing(record.routing, global_group)
    demand = {i: r.bias_demand.round().long() for i, r in routing.items() if r.bias_demand is not None}
    if demand:
        update_expert_bias(demand)

    loss_sum, num_tokens = record.loss_sum, record.num_tokens
    # the one host sync of the step: an empty or diverged step must stop here, before the optimizer moves
    loss_host, tokens_host = torch.stack([loss_sum, num_tokens]).tolist()
    result = StepResult(loss_sum / num_tokens.clamp(min=1), num_tokens, record.num_micro_batches, routing,
                        time.perf_counter())
    if tokens_host == 0:
        msg = (f"step {step} has no valid token in its whole global batch (every label is -100 or masked by the "
               "attention_mask): check the data's labels and attention_mask")
        if not skip_empty:
            raise EmptyStepError(msg + ", or set MoELanguageModel(skip_empty_steps=True) to skip such steps")
        warnings.warn(msg + "; the step is skipped (skip_empty_steps=True)", stacklevel=2)
        for p in params:
            p.grad = None
        result.skipped = True
        return result
    if not math.isfinite(loss_host):
        raise FloatingPointError(
            f"train_loss is {loss_host / tokens_host} at step {step}: the run diverged. Lower the learning rate, "
            "enable gradient clipping (gradient_clip_val) or check the data; the last checkpoint is intact."
        )
    if not record.prescaled:
        scale_grads_(params, accumulate_grad_batches / num_tokens)  # per local shard: parameters on several meshes
    return result


def finalizing_closure(closure: Callable[[], object], finalize: Callable[[], None]) -> Callable[[], object]:
    """Wrap Lightning's optimizer closure (training_step + backward) so ``finalize`` runs right after it, before
    the precision plugin calls the ``on_before_optimizer_step`` hooks and clips."""

    def run() -> object:
        out = closure()
        finalize()
        return out

    return run
