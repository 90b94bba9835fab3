"""The ``noise`` arm of ``bench/low_precision.py --mode convergence``: the bf16 program with zero-mean Gaussian noise of
FP8's size added to the outputs of the GEMMs a forced FP8 recipe converts (every dense linear but the LM head and the
shared experts' gate, every routed-expert projection), forward and backward: no rounding, no bias, no error that
persists from step to step. Against forced FP8 it separates the two explanations of FP8's loss penalty: if the noise
costs as much, the penalty is what perturbations of this size do to the trajectory and no rounding scheme removes it;
if it costs nothing, the penalty is in what round-to-nearest FP8 adds beyond noise (its bias, its persistence).

Noise model: each GEMM output (y, and in the backward dx and dw) gets ``sigma * rms * N(0, 1)`` per element, ``rms``
the root mean square of its row (of the whole tensor for dw). The default sigma 0.0375 is the relative rms error of a
rowwise e4m3 GEMM output (x and w quantized per row, 2.65% each: ``sqrt(2) * 2.65%``), measured with the emulation
(:func:`lightning_moe.lowp.fp8_grouped.quantize_rowwise`) on Gaussian operands at a bench8 shape. The backward
recomputes the product (one extra GEMM per linear; a bench arm, not a recipe). Draws come from one generator per run,
seeded from the run's init seed (the same noise on every rerun on CPU). Inside
:func:`lightning_moe.lowp.high_precision.high_precision` the modules run noiselessly (``--conv-grad-check`` then
measures the noise's gradient error, to set beside FP8's).
"""

from __future__ import annotations

from typing import Callable, Optional

import lightning as L
import torch
from torch import Tensor, nn

from lightning_moe.lowp.high_precision import high_precision_active
from lightning_moe.lowp.recipes import ALWAYS_KEPT
from lightning_moe.moe.grouped_mm import GroupedMM

FP8_ROWWISE_SIGMA = 0.0375  # sqrt(2) x the 2.65% relative rms error of a rowwise-quantized e4m3 operand


def _noisy(t: Tensor, sigma: float, gen: torch.Generator, rowwise: bool) -> Tensor:
    """``t`` plus ``sigma * rms * N(0, 1)`` (rms of each row, or of the whole tensor)."""
    tf = t.float()
    rms = tf.pow(2).mean(dim=-1, keepdim=True).sqrt() if rowwise else tf.pow(2).mean().sqrt()
    eps = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)
    return (tf + sigma * rms * eps).to(t.dtype)


class _NoisyGemm(torch.autograd.Function):
    """``fn(x, w, *rest)`` with noise on the output; the backward recomputes ``fn`` for dx and dw, then noises them."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, fn: Callable[..., Tensor], rest: tuple, noise: "NoiseInjection") -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.fn, ctx.rest, ctx.noise = fn, rest, noise
        return noise.add(fn(x, w, *rest), rowwise=True)  # (autograd records nothing inside forward)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            dx, dw = torch.autograd.grad(ctx.fn(xl, wl, *ctx.rest), (xl, wl), dy)
        noise = ctx.noise
        return noise.add(dx, rowwise=True), noise.add(dw, rowwise=False), None, None, None


def _linear(x: Tensor, w: Tensor) -> Tensor:
    return torch.nn.functional.linear(x, w)


class NoisyGroupedMM(GroupedMM):
    """``torch._grouped_mm`` with the noise of :class:`NoiseInjection` on its output and on both gradients (no fused
    steps: the experts gather their rows themselves)."""

    loop_fallback = False

    def __init__(self, noise: "NoiseInjection") -> None:
        self.noise = noise

    def __call__(self, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        if high_precision_active():  # high_precision() (the gradient check's reference): no noise
            return _grouped(x_MK, w_EKN, offs_E)
        return _NoisyGemm.apply(x_MK, w_EKN, _grouped, (offs_E,), self.noise)

    def __repr__(self) -> str:
        return f"NoisyGroupedMM(sigma={self.noise.sigma})"


def _grouped(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return torch._grouped_mm(x, w, offs=offs)


class _NoisyLinear(nn.Linear):
    """``nn.Linear`` (class swap in place: same parameters) whose GEMMs get the noise of ``lowp_noise``."""

    lowp_noise: Optional["NoiseInjection"] = None

    def forward(self, x: Tensor) -> Tensor:
        assert self.lowp_noise is not None
        if high_precision_active():
            return super().forward(x)
        y = _NoisyGemm.apply(x, self.weight, _linear, (), self.lowp_noise)
        return y if self.bias is None else y + self.bias.to(y.dtype)


_CLASSES: dict[type, type] = {}


def _noisy_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Noisy{cls.__name__.lstrip('_')}", (_NoisyLinear, cls), {})
    return _CLASSES[cls]


class NoiseInjection(L.Callback):
    """The ``noise`` arm's model transform (a Trainer callback with ``transform_model``: see
    :class:`lightning_moe.build.ModelTransform`): the same modules as a forced FP8 recipe, noised instead of
    quantized. ``converted``: their names."""

    def __init__(self, sigma: float = FP8_ROWWISE_SIGMA, seed: int = 0) -> None:
        if not sigma >= 0:
            raise ValueError(f"noise sigma must be >= 0, got {sigma}")
        self.sigma, self.seed = sigma, seed
        self.converted: list[str] = []
        self._gens: dict[torch.device, torch.Generator] = {}

    def add(self, t: Tensor, rowwise: bool) -> Tensor:
        gen = self._gens.get(t.device)
        if gen is None:
            gen = self._gens[t.device] = torch.Generator(device=t.device).manual_seed(self.seed)
        return _noisy(t, self.sigma, gen, rowwise)

    def transform_model(self, model: nn.Module) -> None:
        from lightning_moe.moe.experts import GroupedExperts

        self.converted = []
        for name, m in model.named_modules():
            if name.rsplit(".", 1)[-1] in ALWAYS_KEPT:
                continue
            if isinstance(m, GroupedExperts):
                if not m.use_grouped_mm:
                    raise ValueError(f"the noise arm needs the grouped GEMM seam; {name} has use_grouped_mm=False")
                m.set_grouped_mm(NoisyGroupedMM(self))
                self.converted.append(name)
            elif isinstance(m, nn.Linear) and not isinstance(m, _NoisyLinear):
                m.__class__ = _noisy_class(type(m))
                m.lowp_noise = self
                self.converted.append(name)

    def __repr__(self) -> str:
        return f"NoiseInjection(sigma={self.sigma}, seed={self.seed})"
