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
    wf = w.detach().float()
    scale = fp8_scale(wf.abs().amax(dim=dim, keepdim=True))
    y = (wf * scale).clamp(-E4M3_MAX, E4M3_MAX)
    a = y.abs()
    _, exp = torch.frexp(a)  # a = m * 2^exp, m in [0.5, 1): floor(log2 a) = exp - 1
    spacing = torch.exp2((exp - 1).clamp(min=MIN_EXP).float() - MANTISSA_BITS)
    u = torch.rand(a.shape, generator=generator if generator is not None else _generator(a.device), device=a.device)
    r = torch.floor(a / spacing + u) * spacing  # a / spacing exact (a power of two); u < 1 keeps grid values
    return (torch.copysign(r.clamp(max=E4M3_MAX), y) / scale).to(w.dtype)
