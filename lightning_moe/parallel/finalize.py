"""Gradient finalisation of one optimizer step (DESIGN invariants 4, 5 and 10).

After the last micro-batch's backward and before any ``on_before_optimizer_step`` hook (callbacks' or the
module's) runs, :func:`finalize_step`:

1. sums the gradients of tp-replicated parameters that saw distinct sequence-parallel tokens over tp;
2. reduces the step's routing statistics of every MoE layer over every rank that routes distinct tokens, in ONE
   all-reduce (kept assignments per expert, dropped assignments, valid tokens, the aux and z losses, the router
   entropy, and the expert-bias demand counts), so every logged routing number is the same under every layout;
3. applies the aux-loss-free expert-bias update from those counts (bitwise identical on every rank);
4. checks the step (no valid token anywhere, or a non-finite loss: one host sync) and multiplies every gradient by
   ``accumulate_grad_batches / N``, N the valid tokens of the whole step (Lightning already divided the loss by
   ``accumulate_grad_batches``). A step of one micro-batch knows N before its backward: the module divides its loss
   by N there (``StepTotals.prescaled``) and this pass over every gradient is skipped.

Both :class:`~lightning_moe.strategies.MoEParallelStrategy` (through ``optimizer_step``) and
:class:`~lightning_moe.MoELanguageModel` under Lightning's single-device strategy (through its ``optimizer_step``
hook) run it by wrapping the optimizer closure with :func:`finalizing_closure`, so it always runs between the
backward and the hooks that inspect gradients.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_moe.parallel.grads import all_reduce_grads, scale_grads_

__all__ = ["StepTotals", "LayerRouting", "StepResult", "finalize_step", "finalize_module_step", "finalizing_closure",
           "EmptyStepError"]


class EmptyStepError(ValueError):
    """No valid token (label != -100 and not padding) in the whole global batch of an optimizer step."""


@dataclass
class StepTotals:
    """What the micro-batches of one optimizer step add up to, already summed over the data ranks."""

    loss_sum: Optional[Tensor] = None  # sum of token losses (fp32, detached)
    num_tokens: Optional[Tensor] = None  # valid tokens
    num_micro_batches: int = 0
    prescaled: bool = False  # the loss was already divided by the step's token count (one micro-batch)

    def add(self, loss_sum: Tensor, num_tokens: Tensor) -> None:
        loss_sum, num_tokens = loss_sum.detach().float(), num_tokens.detach().float()
        if self.loss_sum is None or self.num_tokens is None:
            self.loss_sum, self.num_tokens = loss_sum, num_tokens
        else:
            self.loss_sum, self.num_tokens = self.loss_sum + loss_sum, self.num_tokens + num_tokens
        self.num_micro_batches += 1

    def reset(self) -> None:
        self.loss_sum = self.num_tokens = None
        self.num_micro_batches = 0
        self.prescaled = False


@dataclass
class LayerRouting:
    """One MoE layer over one optimizer step, summed over every rank routing distinct tokens and over the step's
    micro-batches: kept assignments per expert [E], assignments dropped by capacity, valid tokens routed, the
    sums (over micro-batches) of the aux and z losses (coefficients applied), and the sum over valid tokens of the
    router-score entropy (nats; see :class:`~lightning_moe.moe.layer.RoutingStats`). All fp32."""

    tokens_per_expert: Tensor
    num_dropped: Tensor
    num_tokens: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    entropy: Tensor


@dataclass
class StepResult:
    """One finalised optimizer step, identical on every rank."""

    loss: Tensor  # mean token loss of the step
    num_tokens: Tensor  # valid tokens of the step (all data ranks, all micro-batches)
    num_micro_batches: int
    routing: dict[int, LayerRouting] = field(default_factory=dict)  # by layer index
    finished_at: float = 0.0  # time.perf_counter() after the step's work was synchronised
    skipped: bool = False  # an empty step skipped (gradients dropped) instead of raising

    @property
    def aux_loss(self) -> Tensor:
        """Sum over MoE layers of the per-micro-batch mean aux loss."""
        return _layer_sum(self, "aux_loss")

    @property
    def z_loss(self) -> Tensor:
        return _layer_sum(self, "z_loss")


def _layer_sum(result: StepResult, name: str) -> Tensor:
    vals = [getattr(r, name) for r in result.routing.values()]
    total = torch.stack(vals).sum() if vals else result.loss.new_zeros(())
    return total / max(result.num_micro_batches, 1)


#: LayerRouting's scalar fields, in the order they are packed after the E counts of each layer
ROUTING_SCALARS = tuple(f.name for f in fields(LayerRouting) if f.name != "tokens_per_expert")
_NUM_SCALARS = len(ROUTING_SCALARS)


def _reduce_routing(moe_layers: dict[int, nn.Module], global_group: Optional[ProcessGroup]) -> dict[int, LayerRouting]:
    """Pop every layer's accumulated routing statistics, sum them over ``global_group`` in one all-reduce, apply
    the expert-bias update, and return the global statistics."""
    packed: list[Tensor] = []
    sizes: list[tuple[int, int, bool]] = []
    for idx, layer in moe_layers.items():
        st = layer.pop_routing_stats()
        E = layer.num_experts
        bias = layer.router.bias_counts
        parts = [st.tokens_per_expert.float(), torch.stack([getattr(st, name).float() for name in ROUTING_SCALARS])]
        if bias is not None:
            parts.append(bias.float())  # exact in fp32 below 2**24 assignments per expert and step
        packed.append(torch.cat([p.to(parts[0].device) for p in parts]))
        sizes.append((idx, E, bias is not None))
    if not packed:
        return {}
    flat = torch.cat(packed)
    if global_group is not None:
        import torch.distributed._functional_collectives as funcol

        flat = funcol.all_reduce(flat, "sum", global_group)
    out: dict[int, LayerRouting] = {}
    offset = 0
    for idx, E, has_bias in sizes:
        tpe, scalars = flat[offset:offset + E], flat[offset + E:offset + E + _NUM_SCALARS]
        offset += E + _NUM_SCALARS
        out[idx] = LayerRouting(tpe, *scalars.unbind())
        if has_bias:
            counts_E = flat[offset:offset + E]
            offset += E
            moe_layers[idx].router.update_expert_bias(counts_E.round().long())
    return out


def finalize_step(
    model: nn.Module,
    totals: StepTotals,
    *,
    parameters: Iterable[nn.Parameter],
    accumulate_grad_batches: int,
    tp_sync_modules: Iterable[nn.Module] = (),
    tp_group: Optional[ProcessGroup] = None,
    global_group: Optional[ProcessGroup] = None,
    skip_empty: bool = False,
    step: int = 0,
    tp_reduce_dtype: Optional[torch.dtype] = None,
) -> StepResult:
    """Finalise the gradients of one optimizer step in place and return its (global) statistics.

    ``model`` is the :class:`~lightning_moe.models.transformer.MoETransformer`; ``parameters`` every trainable
    parameter (on any meshes); ``totals`` the step's loss sum and valid-token count over all data ranks;
    ``tp_sync_modules`` the modules whose own parameters' gradients must be summed over ``tp_group`` (in
    ``tp_reduce_dtype``, None: their own dtype); ``global_group`` every rank
    routing distinct tokens (None on one process). Collective: every rank calls it with the same arguments.
    Raises :class:`EmptyStepError` when the step has no valid token (or drops the gradients and returns with
    ``skipped=True`` when ``skip_empty``), ``FloatingPointError`` when the loss is not finite.
    """
    params = [p for p in parameters if p.requires_grad]
    if tp_group is not None:
        sync = [p for m in tp_sync_modules for p in m.parameters(recurse=False) if p.grad is not None]
        all_reduce_grads(sync, tp_group, reduce_dtype=tp_reduce_dtype)
    moe = {int(i): blk.moe for i, blk in model.layers.items() if blk.is_moe}
    routing = _reduce_routing(moe, global_group)

    if totals.loss_sum is None or totals.num_tokens is None:
        raise RuntimeError("finalize_step without a training_step: the step's token count is unknown")
    loss_sum, num_tokens, prescaled = totals.loss_sum, totals.num_tokens, totals.prescaled
    # the one host sync of the step: an empty or diverged step must stop here, before the optimizer moves
    loss_host, tokens_host = torch.stack([loss_sum, num_tokens]).tolist()
    result = StepResult(loss_sum / num_tokens.clamp(min=1), num_tokens, totals.num_micro_batches, routing,
                        time.perf_counter())
    totals.reset()
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
    if not prescaled:
        scale_grads_(params, accumulate_grad_batches / num_tokens)  # per local shard: parameters on several meshes
    return result


def finalize_module_step(
    module: nn.Module,
    *,
    tp_sync_modules: Iterable[nn.Module] = (),
    tp_group: Optional[ProcessGroup] = None,
    global_group: Optional[ProcessGroup] = None,
) -> StepResult:
    """:func:`finalize_step` for a :class:`~lightning_moe.MoELanguageModel` attached to a Trainer; hands the
    result to ``module.on_step_finalized``. The one call both strategies' paths make."""
    trainer = module.trainer
    result = finalize_step(
        module.model,
        module.step_totals,
        parameters=module.parameters(),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        tp_sync_modules=tp_sync_modules,
        tp_group=tp_group,
        global_group=global_group,
        skip_empty=module.skip_empty_steps,
        step=trainer.global_step,
        # fp32 master weights: their gradients are summed in fp32 where they are summed (as FSDP2's reduce-scatter)
        tp_reduce_dtype=getattr(module, "master_dtype", None),
    )
    module.on_step_finalized(result)
    return result


def finalizing_closure(closure: Callable[[], object], finalize: Callable[[], None]) -> Callable[[], object]:
    """Wrap Lightning's optimizer closure (training_step + backward) so ``finalize`` runs right after it, before
    the precision plugin calls the ``on_before_optimizer_step`` hooks and clips."""

    def run() -> object:
        out = closure()
        finalize()
        return out

    return run
