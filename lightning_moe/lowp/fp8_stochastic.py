"""Stochastic rounding of a weight onto the e4m3 grid of its rowwise scale (``LowPrecisionTraining(
stochastic_weights=True)``, issue 23): each step's FP8 weight an unbiased random rounding of the master weight instead
of round-to-nearest, whose error repeats step after step while the weight moves less than a rounding step.

:func:`stochastic_round_e4m3` returns values in the weight's dtype that the round-to-nearest casts of the dense FP8
linear (:mod:`lightning_moe.lowp.fp8_linear`, Triton or PyTorch) then quantize *exactly*: it computes the same
power-of-two scale (``448 / amax`` rounded down, amax along ``dim``) and rounds ``w * scale`` down or up to a
neighbouring e4m3 value with probabilities that make the expectation ``w * scale`` (values beyond 448 saturate, as
in the casts). The amax of the result can only fall, by less than one rounding step, so its scale is the same or
twice as large, and both keep the rounded values exact (a power-of-two rescale of e4m3 values below 448 is an e4m3
value). Where :func:`lightning_moe.moe.kernels.use_triton` says the kernels run (CUDA by default), the rounding is one Triton
pass after one amax reduction (``_fp8_dense_triton.stochastic_round_kernel``, Philox numbers keyed by a seed drawn on
the host, so no sync); elsewhere PyTorch ops, with the same distribution (not the same draws). Random numbers: one
``torch.Generator`` per device (a CPU one for the kernel's seeds), seeded from ``torch.initial_seed()`` when first
used (``L.seed_everything`` makes runs reproducible).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_moe.lowp.fp8_grouped import E4M3_MAX, fp8_scale
from lightning_moe.moe import kernels

__all__ = ["stochastic_round_e4m3"]

_GENERATORS: dict[Any, torch.Generator] = {}  # device -> generator; ("kernel seeds", device) -> host one
MIN_EXP = -6  # e4m3's smallest normal exponent; below it the spacing is the subnormal step 2^-9
MANTISSA_BITS = 3


def _generator(device: torch.device) -> torch.Generator:
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = _GENERATORS[device] = torch.Generator(device=device).manual_seed(torch.initial_seed())
    return gen


def _kernel_seed(device: torch.device, generator: Optional[torch.Generator]) -> int:
    """The Triton kernel's Philox seed: drawn from ``generator``, else from a host generator kept for ``device``
    (a host draw: no device sync on the hot path)."""
    if generator is None:
        key = ("kernel seeds", device)
        generator = _GENERATORS.get(key)
        if generator is None:
            generator = _GENERATORS[key] = torch.Generator().manual_seed(torch.initial_seed())
    return int(torch.randint(2 ** 31 - 1, (1,), generator=generator, device=generator.device))


def _stochastic_round_triton(w: Tensor, scale: Tensor, seed: int) -> Tensor:
    """The kernel over ``w`` in its memory order (a transposed view, such as the experts' ``w_EKN``, reads
    coalesced); the result has ``w``'s shape and strides."""
    from lightning_moe.lowp import _fp8_dense_triton as k

    w3 = w.reshape((1,) * (3 - w.dim()) + tuple(w.shape)) if w.dim() < 3 else w
    assert w3.dim() == 3, "stochastic rounding takes 1-D to 3-D weights"
    scale3 = scale.reshape((1,) * (3 - scale.dim()) + tuple(scale.shape)).expand(w3.shape)
    order = sorted(range(3), key=lambda d: (-w3.stride(d), -d))  # outermost first
    wp, sp = w3.permute(order), scale3.permute(order)
    if not wp.is_contiguous():  # not dense (a slice): round a contiguous copy
        wp, sp, order = w3.contiguous(), scale3, [0, 1, 2]
    out = torch.empty(wp.shape, dtype=w.dtype, device=w.device)
    rows, R, C = wp.shape[0] * wp.shape[1], wp.shape[1], wp.shape[2]
    br, bc = 16, 128
    k.stochastic_round_kernel[(-(-rows // br), -(-C // bc))](
        wp, sp, out, seed, rows, R, C, *sp.stride(), FP8_MAX=E4M3_MAX, STEP=2.0 ** -MANTISSA_BITS,
        MIN_STEP=2.0 ** (MIN_EXP - MANTISSA_BITS), ROW_SCALE=sp.stride(2) == 0, BLOCK_R=br, BLOCK_C=bc)
    inverse = [order.index(d) for d in range(3)]
    return out.permute(inverse).reshape(w.shape)


@torch.no_grad()
def stochastic_round_e4m3(w: Tensor, dim: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """``w`` stochastically rounded onto the e4m3 grid of its power-of-two scale along ``dim`` (the amax dimension
    of the cast that follows: -1 for the forward's per-row weight, 0 for the input gradient's per-column one), in
    ``w``'s dtype; unbiased for values within the format's range."""
    if kernels.use_triton(w):
        w = w.detach()
        amax = torch.linalg.vector_norm(w, float("inf"), dim=dim, keepdim=True)  # one reduction, no |w| copy
        return _stochastic_round_triton(w, fp8_scale(amax.float()), _kernel_seed(w.device, generator))
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
