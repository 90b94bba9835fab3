"""Stochastic rounding of a weight onto the e4m3 grid of its rowwise scale (``LowPrecisionTraining(
stochastic_weights=True)``, issue 23): each step's FP8 weight an unbiased random rounding of the master weight instead
of round-to-nearest, whose error repeats step after step while the weight moves less than a rounding step.

:func:`stochastic_round_e4m3` returns values in the weight's dtype that the round-to-nearest casts of the dense FP8
linear (:mod:`lightning_moe.lowp.fp8_linear`, Triton or PyTorch) then quantize *exactly*: it computes the same
power-of-two scale (``448 / amax`` rounded down, amax along ``dim``) and rounds ``w * scale`` down or up to a
neighbouring e4m3 value with probabilities that make the expectation ``w * scale`` (values beyond 448 saturate, as
in the casts). The amax of the result can only fall, by less than one rounding step, so its scale is the same or
twice as large, and both keep the rounded values exact (a power-of-two rescale of e4m3 values below 448 is an e4m3
value). Random numbers: one ``torch.Generator`` per device, seeded from ``torch.initial_seed()`` when first used
(``L.seed_everything`` makes runs reproducible).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_moe.lowp.fp8_grouped import E4M3_MAX, fp8_scale

__all__ = ["stochastic_round_e4m3"]

_GENERATORS: dict[torch.device, torch.Generator] = {}
MIN_EXP = -6  # e4m3's smallest normal exponent; below it the spacing is the subnormal step 2^-9
MANTISSA_BITS = 3


def _generator(device: torch.device) -> torch.Generator:
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = _GENERATORS[device] = torch.Generator(device=device).manual_seed(torch.initial_seed())
    return gen


@torch.no_grad()
def stochastic_round_e4m3(w: Tensor, dim: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """``w`` stochastically rounded onto the e4m3 grid of its power-of-two scale along ``dim`` (the amax dimension
    of the cast that follows: -1 for the forward's per-row weight, 0 for the input gradient's per-column one), in
    ``w``'s dtype; unbiased for values within the format's range."""
    scale = fp8_scale(w.detach().abs().amax(dim=dim, keepdim=True).float())
    y = (w.detach().float() * scale).clamp_(-E4M3_MAX, E4M3_MAX)
    a = y.abs()
    # the e4m3 spacing at |y|: 2^floor(log2 |y|) (y's exponent bits) * 2^-3, at least the subnormal step 2^-9
    spacing = (a.view(torch.int32) & 0x7F800000).view(torch.float32).mul_(2.0 ** -MANTISSA_BITS)
    spacing.clamp_(min=2.0 ** (MIN_EXP - MANTISSA_BITS))
    u = torch.rand(a.shape, generator=generator if generator is not None else _generator(a.device), device=a.device)
    # a / spacing is exact (a power of two); u < 1 keeps grid values; the top of the range stays 448
    r = a.div_(spacing).add_(u).floor_().mul_(spacing).clamp_(max=E4M3_MAX)
    return r.copysign_(y).div_(scale).to(w.dtype)
