"""``high_precision()``: the low-precision modules ``LowPrecisionTraining`` put into a model run their plain
high-precision GEMMs inside this context -- the same weights, no quantization, no cast.

What it is for: evaluating or generating with an FP8-trained model in bf16, and telling apart the two costs of a
low-precision run -- the loss the quantized forward adds at fixed weights (``loss(fp8 forward) / loss(bf16 forward)``
on the same batch) and what the low-precision training did to the weights (the bf16 forward's loss against a bf16
run's). ``bench/low_precision.py --mode convergence --conv-hp-loss`` records both.

It covers our modules: the eager FP8 linear (:class:`~lightning_moe.lowp.fp8_linear.Fp8Linear`), the norm that
quantizes its output (:class:`~lightning_moe.lowp.fp8_linear.Fp8QuantRMSNorm`), the block-scaled linear
(:class:`~lightning_moe.lowp.recipes.BlockScaledLinear`) and the experts' grouped GEMM
(:class:`~lightning_moe.lowp.recipes.LowPrecisionGroupedMM`, also its fused steps). torchao's ``Float8Linear``, which
the callback keeps inside ``torch.compile``'d regions, is not ours and is not affected: :func:`torchao_linears` names
them, and ``high_precision(model)`` refuses a model that has any (a silent FP8 forward would be a wrong answer).

The switch is process-wide (a counter, so contexts nest), read by the modules' eager forwards; it is meant for
evaluation and diagnostics between training steps, not for another thread's concurrent training step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from torch import nn

__all__ = ["high_precision", "high_precision_active", "torchao_linears"]

_DEPTH = [0]


def high_precision_active() -> bool:
    """Whether a :func:`high_precision` context is open (the low-precision modules then run in high precision)."""
    return _DEPTH[0] > 0


def torchao_linears(model: nn.Module) -> list[str]:
    """Names of the torchao float8 linears in ``model`` (those :func:`high_precision` cannot switch)."""
    return [name for name, m in model.named_modules()
            if type(m).__module__.startswith("torchao.") and "float8" in type(m).__module__.lower()]


@contextlib.contextmanager
def high_precision(model: Optional[nn.Module] = None) -> Iterator[None]:
    """Run every low-precision module of ours in its high-precision path while the context is open. With ``model``,
    first check that no torchao float8 linear (which this switch does not reach) is in it: a ValueError names them."""
    if model is not None:
        left = torchao_linears(model)
        if left:
            shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise ValueError(f"high_precision(model): {len(left)} torchao float8 linears ({shown}) would still run "
                             "in FP8; they come with LowPrecisionTraining inside torch.compile'd regions. Evaluate "
                             "with an eager model (MoEParallelStrategy(compile=False)) to switch every GEMM")
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1
