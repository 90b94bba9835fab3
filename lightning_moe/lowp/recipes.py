"""The low-precision recipes and the GEMM implementations ``LowPrecisionTraining`` puts into a model: the recipe
table and its constants, the hardware check (DESIGN invariant 7: never a silent fallback), the block-scaled dense
linear, and the experts' low-precision grouped GEMM (:class:`LowPrecisionGroupedMM`, one per projection or, when
``recipe="auto"`` chose differently for gate / up and down, :class:`PerShapeGroupedMM`). The callback
(:mod:`lightning_moe.callbacks.low_precision`) decides which module gets which; the numerics are documented there and in
the kernel modules of this package."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Optional, Union

import torch
from torch import Tensor, nn

from lightning_moe.lowp.high_precision import high_precision_active
from lightning_moe.moe.grouped_mm import GroupedMM, TorchGroupedMM
from lightning_moe.moe.kernels import swiglu

__all__ = ["AUTO", "AUTO_RECIPES", "BLOCK_RECIPES", "GW_HP", "RECIPES", "BlockScaledLinear", "LowPrecisionGroupedMM",
           "PerShapeGroupedMM", "BLOCKWISE_EXPERTS_SLOW", "block_class", "check_hardware"]

# recipe -> (what it does, the block size / alignment dense dims and expert group sizes need)
RECIPES = {
    "fp8_tensorwise": ("dense: torchao float8 tensorwise; experts: FP8 rowwise grouped GEMM", 16),
    "fp8_rowwise": ("dense: torchao float8 rowwise; experts: FP8 rowwise grouped GEMM", 16),
    "fp8_rowwise_gw_hp": ("fp8_rowwise with every weight-gradient GEMM in high precision and the experts' input "
                          "gradients without fast accumulation (torchao's rowwise_with_gw_hp idea)", 16),
    "mxfp8": ("MXFP8 (32-element blocks, E8M0 scales), emulated", 32),
    "nvfp4": ("NVFP4 (16-element blocks, E4M3 scales + fp32 tensor scale, RHT, stochastic rounding), emulated", 16),
    "fp8_blockwise": ("dense and experts: FP8 with 1x128 activation tiles and 128x128 weight blocks (torchao's "
                      "blockwise FP8 training kernels)", 128),
}
AUTO = "auto"  # per-GEMM choice from the crossover table (lightning_moe.lowp.crossover)
AUTO_RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise")  # what the table measures and auto may pick
BLOCK_RECIPES = ("mxfp8", "nvfp4")
GW_HP = "fp8_rowwise_gw_hp"
ROWWISE_GROUPED = ("fp8_tensorwise", "fp8_rowwise", GW_HP)  # recipes whose experts run the FP8 rowwise grouped GEMM
# recipes whose weights may be stochastically rounded (LowPrecisionTraining(stochastic_weights=True)): the rowwise
# grids of the experts' grouped GEMM and of our eager dense linear
SR_RECIPES = ("fp8_rowwise", GW_HP)
# our eager FP8 linear's recipe and wgrad_hp for each recipe it runs; torchao's recipe name inside compiled regions
LINEAR_OF = {"fp8_tensorwise": ("tensorwise", False), "fp8_rowwise": ("rowwise", False), GW_HP: ("rowwise", True)}
TORCHAO_RECIPE = {"fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise", GW_HP: "rowwise_with_gw_hp"}
# the rowwise grouped GEMM's numerics with fp8_rowwise (torchao's _to_fp8_rowwise_then_scaled_grouped_mm)
TORCHAO_GROUPED_NUMERICS = {"wgrad_hp": False, "bwd_fast_accum": True, "fwd_fast_accum": True, "sr_weights": False}
SWAPPED_RECIPES = BLOCK_RECIPES + ("fp8_blockwise",)  # dense linears get their class swapped (not torchao's convert)
# modules that stay in the run's precision whatever the options (suffixes of module names)
ALWAYS_KEPT = ("output", "gate")  # the LM head; the shared experts' sigmoid gate (out dim 1)


# measured on one H200, 2026-12-04 (bench/RESULTS.md): the forced fp8_blockwise bench8 step, experts included
BLOCKWISE_EXPERTS_SLOW = (
    "LowPrecisionTraining(recipe='fp8_blockwise'): the routed experts' blockwise grouped GEMM runs torchao's fallback "
    "(the optional deep_gemm package is not installed), which is several times slower than bf16: on one H200 the "
    "8-layer Qwen3-shaped bench step took 1.33 s against bf16's 0.20 s, and its first steps autotune for minutes. "
    "Install DeepGEMM, or keep the experts off blockwise (experts=False, or recipe='auto' to let the crossover table "
    "choose per GEMM)")


def check_hardware(recipe: str, emulate: bool, device: Union[str, torch.device], *, dense: bool = True,
                   experts: bool = True) -> None:
    """Raise a ValueError when ``recipe`` has no kernels on ``device`` and ``emulate`` is False; warn when its
    kernels exist but are known to be slow (blockwise experts without DeepGEMM)."""
    if emulate:
        return
    device = torch.device(device)
    if recipe in BLOCK_RECIPES:
        raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}): {recipe.upper()} kernels need sm100 (Blackwell) and "
                         "are not wired in lightning_moe; pass emulate=True to train with the emulated numerics")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}) needs a CUDA GPU with FP8 tensor cores (sm89+ for "
                         f"the dense linears, sm90+ for the experts); on {device.type} pass emulate=True")
    cap = torch.cuda.get_device_capability(device)
    need = (9, 0) if experts or recipe == "fp8_blockwise" else (8, 9)
    if cap < need:
        raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}) needs sm{need[0]}{need[1]}+ "
                         f"({'FP8 grouped GEMM for the experts' if experts else 'FP8 GEMM'}), this GPU is "
                         f"sm{cap[0]}{cap[1]}; pass emulate=True (or experts=False on sm89)")
    try:
        import torchao.float8  # noqa: F401
        if experts:
            import torchao.prototype.moe_training  # noqa: F401
        if recipe == "fp8_blockwise":
            import torchao.prototype.blockwise_fp8_training.linear  # noqa: F401
    except ImportError as e:
        raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}) needs torchao>=0.18 (pip install "
                         f"'lightning_moe[ao]'): {e}") from e
    if recipe == "fp8_blockwise" and experts and importlib.util.find_spec("deep_gemm") is None:
        warnings.warn(BLOCKWISE_EXPERTS_SLOW, stacklevel=3)


def load_block_formats():
    try:
        from lightning_moe.lowp import block_formats
    except ImportError as e:  # pragma: no cover - until lightning_moe.lowp.block_formats is merged
        raise ValueError("LowPrecisionTraining: the MXFP8 / NVFP4 recipes need lightning_moe.lowp.block_formats, "
                         f"which this installation lacks ({e})") from e
    return block_formats


class BlockScaledLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs (forward and backward) run in a block-scaled recipe: MXFP8 / NVFP4 (emulated) or
    FP8 blockwise (torchao's kernels, or emulated with ``lowp_emulate``). Same parameters and state-dict keys as the
    ``nn.Linear`` it replaces (its class is swapped in place)."""

    lowp_recipe: str = "mxfp8"
    lowp_emulate: bool = True

    def forward(self, x: Tensor) -> Tensor:
        if high_precision_active():
            return super().forward(x)
        w = self.weight.to(x.dtype) if self.weight.dtype != x.dtype else self.weight
        if self.lowp_recipe == "fp8_blockwise":
            from lightning_moe.lowp import fp8_blockwise as fb

            y = (fb.emulated_fp8_blockwise_linear if self.lowp_emulate else fb.fp8_blockwise_linear)(x, w)
        else:
            fn = load_block_formats().block_scaled_linear
            y = fn(x.reshape(-1, x.shape[-1]), w, self.lowp_recipe).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.lowp_recipe}"


class LowPrecisionGroupedMM(GroupedMM):
    """The low-precision grouped GEMM of the routed experts (a plain object: no state-dict keys)."""

    fallback_hint = "fix the shapes, or keep these experts in high precision with keep_bf16"

    def __init__(self, recipe: str, emulate: bool, name: str = "experts", *, fuse: bool = True,
                 cache_weights: bool = True, fast_accum: bool = True, sr_weights: bool = False) -> None:
        if sr_weights and recipe not in SR_RECIPES:
            raise ValueError(f"LowPrecisionGroupedMM(recipe={recipe!r}, sr_weights=True): stochastically rounded "
                             f"weights go with the rowwise grouped GEMM of {list(SR_RECIPES)}")
        self.recipe, self.emulate, self.name = recipe, emulate, name
        self.sr_weights = bool(sr_weights)
        self.align = RECIPES[recipe][1]
        # the rowwise grouped GEMM's numerics (lightning_moe.lowp.fp8_fused._Ops): Hopper's fast FP8 accumulation in
        # the forward (fast_accum) and in the backward (also off for gw_hp), high-precision weight gradients
        self.wgrad_hp = recipe == GW_HP
        self.fwd_fast_accum = bool(fast_accum)
        self.bwd_fast_accum = self.fwd_fast_accum and recipe != GW_HP
        # both FP8 recipes run the experts as the rowwise grouped GEMM, whose quantization the experts' own passes can
        # do (lightning_moe.lowp.fp8_fused); fuse=False keeps the unfused reference path
        self.fused_fp8 = fuse and recipe in ROWWISE_GROUPED
        self.weight_cache = None
        if self.fused_fp8 and cache_weights:
            from lightning_moe.lowp.fp8_fused import Fp8WeightCache

            self.weight_cache = Fp8WeightCache()

    def __repr__(self) -> str:
        fused = f", fused_fp8=True, cache_weights={self.weight_cache is not None}" if self.fused_fp8 else ""
        accum = ("" if self.fwd_fast_accum else ", fast_accum=False") + (", sr_weights=True" if self.sr_weights else "")
        return f"LowPrecisionGroupedMM(recipe={self.recipe!r}, emulate={self.emulate}{fused}{accum})"

    def _numerics(self) -> dict[str, bool]:
        """The keyword arguments of the fp8_fused functions that set the rowwise grouped GEMM's numerics."""
        return {"wgrad_hp": self.wgrad_hp, "bwd_fast_accum": self.bwd_fast_accum,
                "fwd_fast_accum": self.fwd_fast_accum, "sr_weights": self.sr_weights}

    def _check_dims(self, K: int, N: int) -> None:
        if K % self.align or N % self.align:
            raise ValueError(f"LowPrecisionTraining({self.recipe}): {self.name} GEMM dims K={K}, N={N} (local shard) "
                             f"must be multiples of {self.align}; keep it in high precision with keep_bf16")

    def swiglu_down(self, g_RF: Tensor, u_RF: Tensor, probs_R: Optional[Tensor], w_EKN: Tensor,
                    offs_E: Tensor) -> Tensor:
        if high_precision_active():
            return self._plain(swiglu(g_RF, u_RF, probs_R), w_EKN, offs_E)
        from lightning_moe.lowp.fp8_fused import fp8_swiglu_down

        self._check_dims(*w_EKN.shape[-2:])
        return fp8_swiglu_down(g_RF, u_RF, probs_R, w_EKN, offs_E, emulate=self.emulate, cache=self.weight_cache,
                               **self._numerics())

    def gather_gate_up(self, x_TD: Tensor, asg_R: Tensor, pos_TK: Tensor, w1_EKN: Tensor, w3_EKN: Tensor,
                       offs_E: Tensor) -> tuple[Tensor, Tensor]:
        if high_precision_active():  # the unconverted experts' own gather and plain GEMMs (the same program)
            from lightning_moe.moe.experts import _GatherGateUp

            return _GatherGateUp.apply(x_TD, asg_R, pos_TK, w1_EKN.transpose(-2, -1).to(x_TD.dtype),
                                       w3_EKN.transpose(-2, -1).to(x_TD.dtype), offs_E)
        from lightning_moe.lowp.fp8_fused import fp8_gather_gate_up

        self._check_dims(*w1_EKN.shape[-2:])
        return fp8_gather_gate_up(x_TD, asg_R, pos_TK, w1_EKN, w3_EKN, offs_E, emulate=self.emulate,
                                  cache=self.weight_cache, **self._numerics())

    def _fn(self):
        if self.recipe in BLOCK_RECIPES:
            gmm, recipe = load_block_formats().block_scaled_grouped_mm, self.recipe
            return lambda x, w, offs: gmm(x, w, offs, recipe)
        if self.recipe == "fp8_blockwise":
            from lightning_moe.lowp import fp8_blockwise as fb

            return fb.emulated_fp8_blockwise_grouped_mm if self.emulate else fb.fp8_blockwise_grouped_mm
        if self._numerics() != TORCHAO_GROUPED_NUMERICS:  # numerics torchao's function does not offer
            from lightning_moe.lowp.fp8_fused import fp8_rowwise_grouped_mm

            kw = {"emulate": self.emulate, **self._numerics()}
            return lambda x, w, offs: fp8_rowwise_grouped_mm(x, w, offs, **kw)
        from lightning_moe.lowp import fp8_grouped

        return fp8_grouped.emulated_fp8_rowwise_grouped_mm if self.emulate else fp8_grouped.fp8_rowwise_grouped_mm

    @staticmethod
    def _plain(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        """The high-precision grouped GEMM (:func:`~lightning_moe.lowp.high_precision.high_precision`)."""
        return torch._grouped_mm(x_MK, w_EKN.to(x_MK.dtype), offs=offs_E)

    def __call__(self, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        if high_precision_active():
            return self._plain(x_MK, w_EKN, offs_E)
        from lightning_moe.lowp.fp8_grouped import grouped_mm_padded

        self._check_dims(*w_EKN.shape[-2:])
        return grouped_mm_padded(self._fn(), x_MK, w_EKN, offs_E, self.align)


class PerShapeGroupedMM(GroupedMM):
    """The experts' grouped GEMM when ``recipe="auto"`` chose differently for gate / up and down: the
    implementation of each projection, told apart by the local weight operand's (K, N); any other shape is
    ``torch._grouped_mm``. Not ``exact_torch`` (one projection is quantized), no loop fallback (it would skip it)."""

    fallback_hint = LowPrecisionGroupedMM.fallback_hint

    def __init__(self, by_shape: dict[tuple[int, int], GroupedMM]) -> None:
        self.by_shape = dict(by_shape)
        self.default = TorchGroupedMM()

    def __repr__(self) -> str:
        return f"PerShapeGroupedMM({self.by_shape!r})"

    def __call__(self, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        return self.by_shape.get(tuple(w_EKN.shape[-2:]), self.default)(x_MK, w_EKN, offs_E)


_BLOCK_CLASSES: dict[type, type] = {nn.Linear: BlockScaledLinear}


def block_class(cls: type) -> type:
    """BlockScaledLinear's forward on top of ``cls`` (an nn.Linear subclass keeps its own init)."""
    if cls not in _BLOCK_CLASSES:
        _BLOCK_CLASSES[cls] = type(f"BlockScaled{cls.__name__.lstrip('_')}", (BlockScaledLinear, cls), {})
    return _BLOCK_CLASSES[cls]
