"""LowPrecisionTraining: FP8 (tensorwise / rowwise), MXFP8 and NVFP4 GEMMs for the dense linears and the routed experts.

A model transform (``transform_model``, DESIGN invariant 11): it changes the meta-device model before the strategy
parallelises it, so it composes with every layout of :class:`~lightning_moe.MoEParallelStrategy`.

What is quantized (on the fly, in every forward and backward; the weights stay parameters of the run's dtype, so
state-dict keys, dtypes and checkpoints are unchanged and a checkpoint saved with the callback loads without it):

* **dense linears** (attention projections, dense MLPs, shared experts): ``fp8_*`` swaps them for torchao's
  ``Float8Linear`` (``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name("tensorwise" |
  "rowwise")`` and a module filter; ``emulate=True`` sets torchao's own emulation flag). ``mxfp8`` / ``nvfp4``
  turn them into :class:`BlockScaledLinear` (``lightning_moe.lowp.block_formats.block_scaled_linear``).
* **routed experts**: each chosen MoE layer's plan gets a :class:`LowPrecisionGroupedMM` as its experts' grouped-GEMM
  implementation (``MoELayer.replan(grouped_mm=...)``, :mod:`lightning_moe.moe.grouped_mm`; it refuses the per-expert
  loop fallback, which would skip it): FP8 rowwise grouped GEMM (torchao's on sm90, else
  :func:`~lightning_moe.lowp.fp8_grouped.emulated_fp8_rowwise_grouped_mm`), or ``block_scaled_grouped_mm`` for
  MXFP8 / NVFP4. Groups are padded to the kernel's alignment without a host sync
  (:func:`~lightning_moe.lowp.fp8_grouped.pad_groups`). Under expert parallelism the seam gets the local shards.
* **always kept in the run's precision**: router, norms, embeddings, the LM head (``output``), the shared experts'
  sigmoid gate, losses; plus every module matching ``keep_bf16`` (fnmatch patterns on module names, a name also keeps
  its children: ``["layers.0", "layers.7"]`` keeps the first and last blocks, as NVIDIA's NVFP4 recipe does) and linears
  whose dims are not multiples of the recipe's block (listed in a warning).

Numerics (what ``emulate=True`` reproduces on CPU):

* ``fp8_tensorwise``: dense = torchao tensorwise (one scale per tensor; e4m3 activations and weights, e5m2 gradients);
  experts = FP8 rowwise grouped (torchao has no tensorwise grouped GEMM).
* ``fp8_rowwise``: dense = torchao rowwise (per-row scales, e4m3 everywhere incl. gradients, power-of-2 scales);
  experts = FP8 rowwise grouped (e4m3 everywhere incl. gradients, power-of-2 scales: torchao's
  ``_to_fp8_rowwise_then_scaled_grouped_mm``; details in :mod:`lightning_moe.lowp.fp8_grouped`).
* ``mxfp8`` / ``nvfp4``: as ``lightning_moe.lowp.block_formats`` defines them (32-element E8M0-scaled blocks;
  16-element E4M3-scaled blocks with a per-tensor fp32 scale, random Hadamard transforms on the weight-gradient
  inputs, stochastic rounding of gradients).

Hardware (DESIGN invariant 7: never a silent fallback): ``fp8_*`` without ``emulate`` needs CUDA sm89+ for the
dense linears and sm90+ for the experts (``torch._scaled_grouped_mm``) and torchao (the ``ao`` extra). MXFP8 /
NVFP4 kernels need sm100 and are not wired here: those recipes run only with ``emulate=True`` (their convergence,
not their speed, is what can be measured on Hopper). Anything else is a ValueError naming ``emulate=True``.
Transformer Engine is not used (its core wheel cannot be installed on our GPU machines).

Layouts: FSDP2 gathers the high-precision weights and the quantization runs on the gathered tensors;
``fsdp_float8_all_gather=True`` (``fp8_tensorwise`` only) makes FSDP2 all-gather FP8 weights instead (torchao's
``enable_fsdp_float8_all_gather``; scales are precomputed after every optimizer step; the same FP8 weights, so the
same numbers, as gathering in high precision: tested at W=2 on gloo; the state dict keeps the plain weight).
Tensor parallelism keeps our Colwise/Rowwise styles: torchao's ``Float8Linear`` then runs on DTensors (amaxes reduce
over the tp group); MXFP8 / NVFP4 dense linears under tp > 1 are refused at setup (blocks would straddle shards).

YAML (``lightning-moe fit``)::

    trainer:
      callbacks:
        - class_path: lightning_moe.callbacks.LowPrecisionTraining
          init_args: {recipe: fp8_rowwise}
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
import warnings
from typing import Any, Optional, Sequence, Union

import lightning as L
import torch
from torch import Tensor, nn

import lightning_moe.lowp  # noqa: F401  (quiets what importing torchao prints)
from lightning_moe.moe.grouped_mm import GroupedMM

__all__ = ["BlockScaledLinear", "LowPrecisionGroupedMM", "LowPrecisionTraining", "RECIPES", "check_hardware"]

# recipe -> (what it does, the block size / alignment dense dims and expert group sizes need)
RECIPES = {
    "fp8_tensorwise": ("dense: torchao float8 tensorwise; experts: FP8 rowwise grouped GEMM", 16),
    "fp8_rowwise": ("dense: torchao float8 rowwise; experts: FP8 rowwise grouped GEMM", 16),
    "mxfp8": ("MXFP8 (32-element blocks, E8M0 scales), emulated", 32),
    "nvfp4": ("NVFP4 (16-element blocks, E4M3 scales + fp32 tensor scale, RHT, stochastic rounding), emulated", 16),
}
BLOCK_RECIPES = ("mxfp8", "nvfp4")
# modules that stay in the run's precision whatever the options (suffixes of module names)
ALWAYS_KEPT = ("output", "gate")  # the LM head; the shared experts' sigmoid gate (out dim 1)


def check_hardware(recipe: str, emulate: bool, device: Union[str, torch.device], *, dense: bool = True,
                   experts: bool = True) -> None:
    """Raise a ValueError when ``recipe`` has no kernels on ``device`` and ``emulate`` is False."""
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
    need = (9, 0) if experts else (8, 9)
    if cap < need:
        raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}) needs sm{need[0]}{need[1]}+ "
                         f"({'FP8 grouped GEMM for the experts' if experts else 'FP8 GEMM'}), this GPU is "
                         f"sm{cap[0]}{cap[1]}; pass emulate=True (or experts=False on sm89)")
    try:
        import torchao.float8  # noqa: F401
        if experts:
            import torchao.prototype.moe_training  # noqa: F401
    except ImportError as e:
        raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}) needs torchao>=0.18 (pip install "
                         f"'lightning_moe[ao]'): {e}") from e


def _block_formats():
    try:
        from lightning_moe.lowp import block_formats
    except ImportError as e:  # pragma: no cover - until lightning_moe.lowp.block_formats is merged
        raise ValueError("LowPrecisionTraining: the MXFP8 / NVFP4 recipes need lightning_moe.lowp.block_formats, "
                         f"which this installation lacks ({e})") from e
    return block_formats


class BlockScaledLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs (forward and backward) run in an MXFP8 / NVFP4 recipe (emulated). Same parameters
    and state-dict keys as the ``nn.Linear`` it replaces (its class is swapped in place)."""

    lowp_recipe: str = "mxfp8"

    def forward(self, x: Tensor) -> Tensor:
        fn = _block_formats().block_scaled_linear
        w = self.weight.to(x.dtype) if self.weight.dtype != x.dtype else self.weight
        y = fn(x.reshape(-1, x.shape[-1]), w, self.lowp_recipe).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.lowp_recipe}"


class LowPrecisionGroupedMM(GroupedMM):
    """The low-precision grouped GEMM of the routed experts (a plain object: no state-dict keys)."""

    fallback_hint = "fix the shapes, or keep these experts in high precision with keep_bf16"

    def __init__(self, recipe: str, emulate: bool, name: str = "experts") -> None:
        self.recipe, self.emulate, self.name = recipe, emulate, name
        self.align = RECIPES[recipe][1]

    def __repr__(self) -> str:
        return f"LowPrecisionGroupedMM(recipe={self.recipe!r}, emulate={self.emulate})"

    def _fn(self):
        if self.recipe in BLOCK_RECIPES:
            gmm, recipe = _block_formats().block_scaled_grouped_mm, self.recipe
            return lambda x, w, offs: gmm(x, w, offs, recipe)
        from lightning_moe.lowp import fp8_grouped

        return fp8_grouped.emulated_fp8_rowwise_grouped_mm if self.emulate else fp8_grouped.fp8_rowwise_grouped_mm

    def __call__(self, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        from lightning_moe.lowp.fp8_grouped import grouped_mm_padded

        K, N = w_EKN.shape[-2:]
        if K % self.align or N % self.align:
            raise ValueError(f"LowPrecisionTraining({self.recipe}): {self.name} GEMM dims K={K}, N={N} (local shard) "
                             f"must be multiples of {self.align}; keep it in high precision with keep_bf16")
        return grouped_mm_padded(self._fn(), x_MK, w_EKN, offs_E, self.align)


def _as_list(value: Union[str, Sequence[str], None]) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip().strip("'\"") for v in value.strip("[]").split(",") if v.strip()]
    return list(value)


class LowPrecisionTraining(L.Callback):
    """Train the dense linears and routed experts in FP8 / MXFP8 / NVFP4 (see the module docstring).

    Args:
        recipe: ``fp8_tensorwise``, ``fp8_rowwise`` (default), ``mxfp8`` or ``nvfp4``.
        emulate: run the recipe's numerics in emulation (quantize-dequantize, fp32 GEMMs): any device, slow. Needed
            on CPU, and for MXFP8 / NVFP4 everywhere.
        experts: quantize the routed experts' grouped GEMMs.
        dense: quantize the dense linears (attention, dense MLPs, shared experts).
        keep_bf16: module-name patterns (fnmatch; a name keeps its children too) left in the run's precision.
        fsdp_float8_all_gather: (``fp8_tensorwise`` only) FSDP2 all-gathers FP8 weights.
    """

    def __init__(self, recipe: str = "fp8_rowwise", emulate: bool = False, experts: bool = True, dense: bool = True,
                 keep_bf16: Union[str, Sequence[str], None] = (), fsdp_float8_all_gather: bool = False) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}): unknown recipe; valid: {list(RECIPES)}")
        if not (experts or dense):
            raise ValueError("LowPrecisionTraining: experts=False and dense=False leaves nothing to quantize")
        if fsdp_float8_all_gather and (recipe != "fp8_tensorwise" or not dense):
            raise ValueError("LowPrecisionTraining(fsdp_float8_all_gather=True) needs recipe='fp8_tensorwise' and "
                             "dense=True (torchao all-gathers FP8 weights for tensorwise scaling only)")
        self.recipe, self.emulate = recipe, bool(emulate)
        self.experts, self.dense = bool(experts), bool(dense)
        self.keep_bf16 = tuple(_as_list(keep_bf16))
        self.fsdp_float8_all_gather = bool(fsdp_float8_all_gather)
        self.device: Optional[torch.device] = None  # set by setup(); else the current CUDA device, else CPU
        self.converted: list[str] = []  # module names quantized by the last transform_model
        self.skipped: list[str] = []  # linears / experts left in high precision because of their dims

    def __repr__(self) -> str:
        return (f"LowPrecisionTraining(recipe={self.recipe!r}, emulate={self.emulate}, experts={self.experts}, "
                f"dense={self.dense}, keep_bf16={list(self.keep_bf16)})")

    # ---- Lightning hooks ------------------------------------------------------------------------
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        """Before ``configure_model``: remember the device, and refuse layouts this recipe cannot do right."""
        from lightning_moe.strategies import MoEParallelStrategy

        strategy = trainer.strategy
        self.device = strategy.root_device
        if isinstance(strategy, MoEParallelStrategy) and self.dense and self.recipe in BLOCK_RECIPES:
            tp = strategy.parallel_dims.tp
            if tp > 1:
                raise ValueError(f"LowPrecisionTraining(recipe={self.recipe!r}) with tp={tp}: block-scaled dense "
                                 "linears under tensor parallelism are not supported (blocks would straddle "
                                 "shards); use tp=1, dense=False, or an fp8 recipe")
        check_hardware(self.recipe, self.emulate, self.device, dense=self.dense, experts=self.experts)

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(getattr(pl_module, "model", pl_module))

    # ---- the model transform --------------------------------------------------------------------
    def _kept(self, name: str) -> bool:
        if name.rsplit(".", 1)[-1] in ALWAYS_KEPT:
            return True
        return any(fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in self.keep_bf16)

    def _device(self) -> torch.device:
        if self.device is not None:
            return self.device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def transform_model(self, model: nn.Module) -> None:
        """Quantize the chosen modules of the (meta-device) model in place; idempotent."""
        from lightning_moe.moe.experts import GroupedExperts
        from lightning_moe.moe.layer import MoELayer

        check_hardware(self.recipe, self.emulate, self._device(), dense=self.dense, experts=self.experts)
        align = RECIPES[self.recipe][1]
        self.converted, self.skipped = [], []
        linears: list[str] = []
        # an MoE layer's plan depends on its experts' grouped GEMM: such experts get it through the layer
        layers = {id(m.experts): m for m in model.modules() if isinstance(m, MoELayer)}
        for name, m in model.named_modules():
            if self._kept(name):
                continue
            if self.experts and isinstance(m, GroupedExperts):
                if isinstance(m.grouped_mm, LowPrecisionGroupedMM):
                    continue
                if not m.use_grouped_mm:
                    raise ValueError(f"LowPrecisionTraining: {name} has use_grouped_mm=False; the low-precision "
                                     "experts need the grouped GEMM seam (or keep it with keep_bf16)")
                if m.dim % align or m.hidden_dim % align:
                    self.skipped.append(name)
                    continue
                impl = LowPrecisionGroupedMM(self.recipe, self.emulate, name)
                if id(m) in layers:
                    layers[id(m)].replan(grouped_mm=impl)
                else:
                    m.set_grouped_mm(impl)
                self.converted.append(name)
            elif self.dense and not isinstance(m, BlockScaledLinear) and isinstance(m, nn.Linear) \
                    and not _is_float8_linear(m):
                if m.in_features % align or m.out_features % align:
                    self.skipped.append(name)
                    continue
                linears.append(name)
        if self.skipped:
            warnings.warn(f"LowPrecisionTraining({self.recipe}): left in high precision (dims not multiples of "
                          f"{align}): {self.skipped}", stacklevel=2)
        if linears:
            self._convert_dense(model, set(linears))
            self.converted += linears

    def _convert_dense(self, model: nn.Module, names: set[str]) -> None:
        original = {name: type(model.get_submodule(name)) for name in names}
        if self.recipe in BLOCK_RECIPES:
            _block_formats()  # fail now (a clear error), not in the first forward
            for name in names:
                m = model.get_submodule(name)
                m.__class__ = _block_class(original[name])
                m.lowp_recipe = self.recipe
            return
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as e:
            raise ValueError(f"LowPrecisionTraining(recipe={self.recipe!r}) converts the dense linears with torchao>=0.18 "
                             f"(pip install 'lightning_moe[ao]'), which failed to import: {e}; or pass dense=False") from e
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe.removeprefix("fp8_")),
                                     emulate=self.emulate,
                                     enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in names)
        if self.fsdp_float8_all_gather:
            for name in names:  # the weight is now torchao's wrapper subclass: keep it out of checkpoints
                model.get_submodule(name).register_state_dict_post_hook(_plain_fp8_weight)
        for name, cls in original.items():
            # keep the original initialisation (e.g. the shared experts' normal init): the same seed gives the
            # same initial weights with and without the callback
            if cls.reset_parameters is not nn.Linear.reset_parameters:
                m = model.get_submodule(name)
                m.reset_parameters = types.MethodType(cls.reset_parameters, m)
                if hasattr(cls, "init_std"):
                    m.init_std = cls.init_std


_BLOCK_CLASSES: dict[type, type] = {nn.Linear: BlockScaledLinear}


def _block_class(cls: type) -> type:
    """BlockScaledLinear's forward on top of ``cls`` (an nn.Linear subclass keeps its own init)."""
    if cls not in _BLOCK_CLASSES:
        _BLOCK_CLASSES[cls] = type(f"BlockScaled{cls.__name__.lstrip('_')}", (BlockScaledLinear, cls), {})
    return _BLOCK_CLASSES[cls]


def _plain_fp8_weight(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` post-hook of a Float8Linear whose weight torchao wrapped for the FP8 all-gather
    (``WeightWithDynamicFloat8CastTensor``, a wrapper around the high-precision tensor): the state dict holds the
    plain tensor, so a single-file checkpoint loads with ``weights_only=True`` without torchao and into a model
    without the callback. Under FSDP the value is a DTensor whose local shard is the wrapper: distributed checkpoints
    write its plain bytes and full state dicts are gathered to plain tensors already, so it is left alone."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if type(value).__name__ == "WeightWithDynamicFloat8CastTensor":
        state_dict[key] = value._tensor.detach()


def _is_float8_linear(m: nn.Module) -> bool:
    return type(m).__name__ == "Float8Linear"
