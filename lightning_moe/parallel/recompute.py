"""Selective recomputation (Megatron's ``--recompute-modules``) on ``torch.utils.checkpoint``.

``activation_checkpointing=[kind, ...]`` wraps small, collective-free seams of the single-device model in
``checkpoint(use_reentrant=False)``: a region keeps only its inputs for the backward and re-runs its forward
there. Inputs are saved through autograd's saved-tensor hooks (``checkpoint`` saves them that way), so
:class:`~lightning_moe.callbacks.ActivationOffload` can still move them to the host.

==============  ================================================  ==================================================
kind            region (seam)                                     not kept for the backward
==============  ================================================  ==================================================
norm            every ``RMSNorm.forward``                         the fp32 copy of its input, its internals
attn_core       ``core_attention`` (SDPA / flash); under cp the   the attention output and kernel state (the
                local ``AllGatherKVAttention.kernel`` only        gathered K/V are kept, never gathered again)
moe_act         ``GroupedExperts.act_down``: SwiGLU + down GEMM   the activation h (1 of 3 R x F)
experts         ``GroupedExperts.forward`` (after dispatch)       gate, up, silu(gate), h (the routed rows are kept)
shared_experts  ``SharedExperts.forward``                         its gate/up/activation intermediates
mla_up_proj     ``MLAttention.up_proj``: q/kv norms + up-projs    the latent norms' fp32 copies and outputs
==============  ================================================  ==================================================

Communication is never re-run: the dispatcher's all-to-all / all-gather and context parallelism's K/V gathers lie
outside every region, and the hooks of FSDP2 and tensor parallelism sit on module calls, outside the wrapped
``forward`` methods (under tp, ``mla_up_proj`` holds the column-parallel up-projections' DTensor wrapping, which
communicates only in the backward: the all-reduce of their input gradient, run once). ``full`` (whole blocks,
:func:`~lightning_moe.parallel.parallelize.apply_ac`) may be combined with kinds: they then nest inside the block's
recomputation. Wrapping sets instance attributes only: state-dict keys are unchanged. The router is never inside a
region, so routing statistics are recorded once.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_moe.autograd import recompute_context
from lightning_moe.parallel.layout import RECOMPUTE_KINDS

__all__ = ["Recomputed", "apply_recompute"]


class Recomputed:
    """``fn`` run under non-reentrant checkpoint. ``num_inputs``: only the first n positional arguments are region
    inputs (saved through the saved-tensor hooks); the rest (weights, offsets) are captured as they are, so an
    offload hook never copies a weight."""

    def __init__(self, fn: Callable[..., Any], num_inputs: Optional[int] = None) -> None:
        self.fn = fn
        self.num_inputs = num_inputs

    def __repr__(self) -> str:
        return f"Recomputed({getattr(self.fn, '__qualname__', self.fn)!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.fn(*args, **kwargs)
        n = len(args) if self.num_inputs is None else self.num_inputs
        inputs, rest = args[:n], args[n:]
        # no dropout in these regions: the RNG state need not be saved and restored
        return checkpoint(lambda *a: self.fn(*a, *rest, **kwargs), *inputs, use_reentrant=False,
                          preserve_rng_state=False, context_fn=recompute_context)


def _wrap(obj: Any, name: str, num_inputs: Optional[int] = None) -> None:
    fn = getattr(obj, name)
    while getattr(fn, "recompute_inside", False):
        # a scope wrapper (ActivationOffload's, applied earlier as a model transform): recompute inside it, so
        # what a region drops is recomputed rather than offloaded, and its inputs still go through the scope
        obj, name, fn = fn, "inner", fn.inner
    if not isinstance(fn, Recomputed):  # idempotent (e.g. the one context-parallel core shared by all blocks)
        setattr(obj, name, Recomputed(fn, num_inputs))


def apply_recompute(model: nn.Module, kinds: Sequence[str]) -> None:
    """Wrap the seams of ``kinds`` (a subset of :data:`~lightning_moe.parallel.layout.RECOMPUTE_KINDS`) in place."""
    from lightning_moe.models.transformer import Attention, MLAttention, RMSNorm
    from lightning_moe.moe.experts import GroupedExperts, SharedExperts
    from lightning_moe.parallel.context_parallel import AllGatherKVAttention

    unknown = set(kinds) - set(RECOMPUTE_KINDS)
    if unknown:
        raise ValueError(f"unknown recompute kinds {sorted(unknown)}; valid: {RECOMPUTE_KINDS}")
    for m in model.modules():
        if "norm" in kinds and isinstance(m, RMSNorm):
            _wrap(m, "forward")
        elif "attn_core" in kinds and isinstance(m, (Attention, MLAttention)):
            core = m.core_attention
            if isinstance(core, AllGatherKVAttention):
                _wrap(core, "kernel")
            else:
                _wrap(m, "core_attention")
        elif "moe_act" in kinds and isinstance(m, GroupedExperts):
            _wrap(m, "act_down", num_inputs=3)  # inputs gate, up, row weights; the weight and offsets are captured
        elif "shared_experts" in kinds and isinstance(m, SharedExperts):
            _wrap(m, "forward")
        if "experts" in kinds and isinstance(m, GroupedExperts):
            _wrap(m, "forward")
        if "mla_up_proj" in kinds and isinstance(m, MLAttention):
            _wrap(m, "up_proj")
