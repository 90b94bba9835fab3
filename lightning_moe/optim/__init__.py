"""Optimizers: :class:`AdamW` (torch's, for parameter groups that mix DTensors and plain tensors) and
:class:`MasterAdamW` (fp32 master weights and moments for bf16 parameters, with a fused Triton step)."""

from lightning_moe.optim.adamw import AdamW
from lightning_moe.optim.master import MasterAdamW

__all__ = ["AdamW", "MasterAdamW"]
