"""Selective recomputation (Megatron's ``--recompute-modules``) on ``torch.utils.checkpoint``.

``activation_checkpointing=[kind, ...]`` plans small, collective-free seams of the single-device model for
recomputation: a region keeps only its inputs for the backward and re-runs its forward there. Each kind names seams
of the modules' activation plans (:mod:`lightning_moe.activation_plan`); the modules call their plan at those seams.
Inputs are saved through autograd's saved-tensor hooks (``checkpoint`` saves them that way), so
:class:`~lightning_moe.callbacks.ActivationOffload` can still move them to the host.

==============  ================================================  ==================================================
kind            region (seam)                                     not kept for the backward
==============  ================================================  ==================================================
norm            every ``RMSNorm`` forward                         the fp32 copy of its input, its internals
attn_core       the attention's ``CoreAttention`` (SDPA /         the attention output and kernel state (the
                flash); under cp the local                        gathered K/V are kept, never gathered again)
                ``AllGatherKVAttention.kernel`` only
moe_act         ``GroupedExperts.act_down``: SwiGLU + down GEMM   the activation h (1 of 3 R x F)
experts         ``GroupedExperts`` forward (after dispatch)       gate, up, silu(gate), h (the routed rows are kept)
shared_experts  ``SharedExperts`` forward                         its gate/up/activation intermediates
mla_up_proj     ``MLAttention.up_proj``: q/kv norms + up-projs    the latent norms' fp32 copies and outputs
==============  ================================================  ==================================================

Communication is never re-run: the dispatcher's all-to-all / all-gather and context parallelism's K/V gathers lie
outside every region, and the hooks of FSDP2 and tensor parallelism sit on module calls, outside the planned seams
(under tp, ``mla_up_proj`` holds the column-parallel up-projections' DTensor wrapping, which communicates only in
the backward: the all-reduce of their input gradient, run once). ``full`` (whole blocks,
:func:`~lightning_moe.parallel.parallelize.apply_ac`) may be combined with kinds: they then nest inside the block's
recomputation. Plans are attributes: state-dict keys are unchanged. The router is never inside a region, so routing
statistics are recorded once.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from lightning_moe.activation_plan import plan_activations
from lightning_moe.parallel.layout import RECOMPUTE_KINDS

__all__ = ["apply_recompute"]


def apply_recompute(model: nn.Module, kinds: Sequence[str]) -> None:
    """Plan the seams of ``kinds`` (a subset of :data:`~lightning_moe.parallel.layout.RECOMPUTE_KINDS`) for
    recomputation, in place (idempotent)."""
    from lightning_moe.models.transformer import Attention, MLAttention, RMSNorm
    from lightning_moe.moe.experts import GroupedExperts, SharedExperts
    from lightning_moe.parallel.context_parallel import AllGatherKVAttention

    unknown = set(kinds) - set(RECOMPUTE_KINDS)
    if unknown:
        raise ValueError(f"unknown recompute kinds {sorted(unknown)}; valid: {RECOMPUTE_KINDS}")
    for m in model.modules():
        if "norm" in kinds and isinstance(m, RMSNorm):
            plan_activations(m, recompute=["forward"])
        if "attn_core" in kinds and isinstance(m, (Attention, MLAttention)):
            core = m.core_attention  # one context-parallel core may be shared by every block
            plan_activations(core, recompute=["kernel" if isinstance(core, AllGatherKVAttention) else "forward"])
        if isinstance(m, GroupedExperts):
            plan_activations(m, recompute=[seam for kind, seam in (("moe_act", "act_down"), ("experts", "forward"))
                                           if kind in kinds])
        if "shared_experts" in kinds and isinstance(m, SharedExperts):
            plan_activations(m, recompute=["forward"])
        if "mla_up_proj" in kinds and isinstance(m, MLAttention):
            plan_activations(m, recompute=["up_proj"])
