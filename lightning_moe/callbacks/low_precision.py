"""LowPrecisionTraining: FP8 (tensorwise / rowwise / blockwise, chosen per GEMM by default), MXFP8 and NVFP4 GEMMs for
the dense linears and the routed experts.

One piece (about 500 lines): the per-GEMM choice and the model transform that applies it decide together which module
gets which conversion; the recipes and the GEMM implementations it installs are :mod:`lightning_moe.lowp.recipes`, the
kernels and the crossover table the rest of lightning_moe/lowp/.

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
  MXFP8 / NVFP4. With the FP8 rowwise grouped GEMM (``fp8_tensorwise`` / ``fp8_rowwise``) and ``fuse_quant`` (the
  default) the quantization rides inside the experts' own passes (:mod:`lightning_moe.lowp.fp8_fused`, chosen by the
  layer plan's ``fp8_fused``): the SwiGLU kernel quantizes the down projection's input, the row gather (where the
  experts gather their own rows) the gate / up input, and ``cache_fp8_weights`` makes each expert weight's FP8 copy
  once per optimizer step; the unfused path (``fuse_quant=False``) is the reference it equals to fp32 rounding.
  Groups are padded to the kernel's alignment without a host sync (:func:`~lightning_moe.lowp.fp8_grouped.pad_groups`).
  Under expert parallelism the seam gets the local shards.
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
* ``fp8_rowwise_gw_hp``: ``fp8_rowwise`` whose weight gradients are high-precision GEMMs of the bf16 operands (dense
  and experts; torchao's ``rowwise_with_gw_hp``, whose dgrad weight is tensorwise where ours stays per column) and
  whose experts' input gradients accumulate without Hopper's fast FP8 accumulation: a third of the GEMM work stays
  bf16, for the loss a weight gradient scaled per column over every token loses in e4m3.
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

Per-GEMM choice (``recipe="auto"``, the default): see :class:`LowPrecisionTraining`; the table and its lookups are
:mod:`lightning_moe.lowp.crossover`, the decision rules :mod:`lightning_moe.lowp.gemm_choice`. ``fp8_blockwise``
(1x128 activation tiles, 128x128 weight blocks) is :mod:`lightning_moe.lowp.fp8_blockwise`.

YAML (``lightning-moe fit``)::

    trainer:
      callbacks:
        - class_path: lightning_moe.callbacks.LowPrecisionTraining
          init_args: {recipe: fp8_rowwise}   # or {} for the per-GEMM choice (recipe: auto)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

import lightning_moe.lowp  # noqa: F401  (quiets what importing torchao prints)
from lightning_moe.flags import check_flags
from lightning_moe.lowp.crossover import (BENCH_COMMAND, CrossoverTable, Gemm, device_arch, model_gemms,
                                          shipped_table_path)
from lightning_moe.lowp.fp8_linear import Fp8InputCache, Fp8Linear, Fp8QuantRMSNorm, fp8_class
from lightning_moe.lowp.gemm_choice import GemmDecision, decide, decision_table
from lightning_moe.lowp.recipes import (ALWAYS_KEPT, AUTO, AUTO_RECIPES, BLOCK_RECIPES, GW_HP, LINEAR_OF, RECIPES,
                                       ROWWISE_GROUPED, SR_RECIPES, SWAPPED_RECIPES, TORCHAO_RECIPE, BlockScaledLinear,
                                       LowPrecisionGroupedMM, PerShapeGroupedMM, block_class, check_hardware,
                                       load_block_formats)
from lightning_moe.moe.grouped_mm import GroupedMM, TorchGroupedMM

# the recipes and GEMM implementations live in lightning_moe.lowp.recipes; importable from here as before
__all__ = ["AUTO", "BLOCK_RECIPES", "GW_HP", "BlockScaledLinear", "LowPrecisionGroupedMM", "LowPrecisionTraining",
           "PerShapeGroupedMM", "RECIPES", "check_hardware"]

def _as_list(value: Union[str, Sequence[str], None]) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip().strip("'\"") for v in value.strip("[]").split(",") if v.strip()]
    return list(value)


class LowPrecisionTraining(L.Callback):
    """Train the dense linears and routed experts in FP8 / MXFP8 / NVFP4 (see the module docstring).

    Args:
        recipe: ``auto`` (default): each GEMM in FP8 only where the crossover table of this GPU says it pays (see
            below); or one recipe for every GEMM that can take it: ``fp8_tensorwise``, ``fp8_rowwise``,
            ``fp8_rowwise_gw_hp``, ``fp8_blockwise``, ``mxfp8`` or ``nvfp4``.
        emulate: run the recipe's numerics in emulation (quantize-dequantize, fp32 GEMMs): any device, slow. Needed
            on CPU, and for MXFP8 / NVFP4 everywhere.
        experts: quantize the routed experts' grouped GEMMs.
        dense: quantize the dense linears (attention, dense MLPs, shared experts).
        keep_bf16: module-name patterns (fnmatch; a name keeps its children too) left in the run's precision. The
            experts' two grouped GEMMs are named ``<experts>.w1_w3`` (gate / up) and ``<experts>.w2`` (down). A
            pattern that names nothing (here or in ``force``) is an error: a typo would otherwise quantize what it
            meant to keep.
        force: (``auto``) patterns of GEMMs put in FP8 whatever the table says (``keep_bf16`` still wins): the
            recipe with the best measured ratio at their M, else ``fp8_rowwise``.
        tokens_per_microbatch: (``auto``) tokens one rank's micro-batch holds; default: the datamodule's
            ``batch_size * seq_len`` (divided by the context-parallel size).
        table: (``auto``) the crossover table: a path, a dict, or None for the one shipped for this GPU
            (``lightning_moe/lowp/crossover/<arch>.json``).
        min_speedup: (``auto``) the measured bf16 / FP8 time ratio a GEMM needs, from its M up, to be converted.
        fsdp_float8_all_gather: (``fp8_tensorwise`` only) FSDP2 all-gathers FP8 weights.
        fuse_quant: (experts in ``fp8_tensorwise`` / ``fp8_rowwise``) quantize inside the passes the experts already
            make (:mod:`lightning_moe.lowp.fp8_fused`): the SwiGLU kernel quantizes the down projection's input, and
            where the experts gather their own rows (one process, fused kernels) the gather quantizes the gate / up
            input; the same numbers as ``fuse_quant=False`` (the unfused reference: each GEMM quantizes its bf16
            input), to fp32 rounding.
        fused_dense: (dense linears in ``fp8_tensorwise`` / ``fp8_rowwise`` outside compiled regions, tp=1, no FP8
            all-gather) run our eager FP8 linear (:mod:`lightning_moe.lowp.fp8_linear`): one fused kernel per
            quantization, the input quantized once for every projection that reads it (``rowwise``: by the RMSNorm
            before the attention, in its own kernel), each weight's FP8 copy made once per optimizer step (not under
            FSDP: the copy would be the gathered weight), and ``tensorwise`` saving the FP8 input for the backward.
            False, compiled regions, tp > 1 or ``fsdp_float8_all_gather``: torchao's ``Float8Linear``.
        cache_fp8_weights: (with ``fuse_quant``) keep each expert weight's FP8 copies (forward and dgrad layouts)
            until the next optimizer step, so a recompute or another micro-batch does not quantize it again: up to
            the size of the bf16 expert weights in extra memory. Off when FSDP shards the experts (``edp_shard >
            1``: the copies would be the unsharded weights).
        fast_accum: (``fp8_tensorwise`` / ``fp8_rowwise`` / ``fp8_rowwise_gw_hp``) let the FP8 GEMMs use Hopper's
            fast FP8 accumulation where torchao does: the forward GEMMs, and the experts' backward GEMMs (the dense
            backward never does; ``fp8_rowwise_gw_hp``'s experts' backward does not). False: no FP8 GEMM does, every
            partial sum is promoted to fp32 (DeepSeek-V3's practice; slower GEMMs, and ``auto``'s table was measured
            with the default). The block-scaled recipes and emulation accumulate in fp32 either way.
        dgrad_hp: (dense linears in ``fp8_tensorwise`` / ``fp8_rowwise`` / ``fp8_rowwise_gw_hp``) their input
            gradient ``dx = dy @ w`` as a high-precision GEMM (the experts' stays FP8). With ``fp8_rowwise_gw_hp``
            the dense backward has no FP8 GEMM: FP8 in the forward only, a diagnostic of where a loss difference
            comes from (it saves the forward GEMM's time only).
        stochastic_weights: (``fp8_rowwise`` / ``fp8_rowwise_gw_hp``: the routed experts and our eager dense
            linear) each optimizer step's FP8 weights (the forward's and the input gradient's, one draw each) are an
            unbiased stochastic rounding of the weight onto the cast's e4m3 grid instead of the nearest value, whose
            error repeats from step to step while the weight moves less than a rounding step
            (:mod:`lightning_moe.lowp.fp8_stochastic`; a few extra elementwise passes over each weight per step).
            Activations and gradients round to nearest as before. An experiment of issue 23 (bench modifier
            ``:sr_w``).

    ``recipe="auto"``: when the model is built, every dense linear (M = tokens per micro-batch) and every MoE layer's
    gate / up and down grouped GEMM (M = tokens * top_k / local experts) is looked up in the table by its local
    (N, K); a GEMM is converted to the recipe with the best measured ratio among those whose crossover M it reaches,
    and otherwise left exactly as it is (an ``nn.Linear``, the plain grouped GEMM: no cast, no conversion). Shapes
    the table lacks stay in high precision; a missing table leaves everything there, with a warning naming the
    bench command that makes one. The decisions are logged once (a compact table) and kept in ``decisions``.
    """

    def __init__(self, recipe: str = AUTO, emulate: bool = False, experts: bool = True, dense: bool = True,
                 keep_bf16: Union[str, Sequence[str], None] = (), force: Union[str, Sequence[str], None] = (),
                 tokens_per_microbatch: Optional[int] = None, table: Union[str, Path, dict, None] = None,
                 min_speedup: float = 1.0, fsdp_float8_all_gather: bool = False, fuse_quant: bool = True,
                 cache_fp8_weights: bool = True, fused_dense: bool = True, fast_accum: bool = True,
                 dgrad_hp: bool = False, stochastic_weights: bool = False) -> None:
        if recipe != AUTO and recipe not in RECIPES:
            raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}): unknown recipe; valid: "
                             f"{[AUTO, *RECIPES]}")
        check_flags("LowPrecisionTraining", emulate=emulate, experts=experts, dense=dense,
                    fsdp_float8_all_gather=fsdp_float8_all_gather, fuse_quant=fuse_quant,
                    cache_fp8_weights=cache_fp8_weights, fused_dense=fused_dense, fast_accum=fast_accum,
                    dgrad_hp=dgrad_hp, stochastic_weights=stochastic_weights)
        if not (experts or dense):
            raise ValueError("LowPrecisionTraining: experts=False and dense=False leaves nothing to quantize")
        if fsdp_float8_all_gather and (recipe != "fp8_tensorwise" or not dense):
            raise ValueError("LowPrecisionTraining(fsdp_float8_all_gather=True) needs recipe='fp8_tensorwise' and "
                             "dense=True (torchao all-gathers FP8 weights for tensorwise scaling only)")
        auto_only = {"force": _as_list(force), "tokens_per_microbatch": tokens_per_microbatch, "table": table}
        given = [k for k, v in auto_only.items() if v not in (None, [])]
        if recipe != AUTO and given:
            raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}): {given} only apply to recipe='auto' (a "
                             "named recipe converts every GEMM it can take; use keep_bf16 to exclude some)")
        if dgrad_hp and (recipe not in LINEAR_OF or not dense):
            raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}, dense={dense}, dgrad_hp=True): the high-"
                             f"precision input gradient is an option of the FP8 dense linears of {list(LINEAR_OF)}")
        if stochastic_weights and (recipe not in SR_RECIPES
                                   or (dense and (not fused_dense or fsdp_float8_all_gather))):
            raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}, dense={dense}, fused_dense={fused_dense}, "
                             "stochastic_weights=True): stochastically rounded weights are an option of the rowwise "
                             f"recipes {list(SR_RECIPES)}: their experts' grouped GEMM and our eager dense linear "
                             "(fused_dense=True, no FSDP float8 all-gather; or dense=False)")
        if tokens_per_microbatch is not None and tokens_per_microbatch <= 0:
            raise ValueError(f"LowPrecisionTraining(tokens_per_microbatch={tokens_per_microbatch}) must be positive")
        self.recipe, self.emulate = recipe, bool(emulate)
        self.experts, self.dense = bool(experts), bool(dense)
        self.keep_bf16 = tuple(_as_list(keep_bf16))
        self.force = tuple(_as_list(force))
        self.tokens_per_microbatch = tokens_per_microbatch
        self.table, self.min_speedup = table, float(min_speedup)
        self.fsdp_float8_all_gather = bool(fsdp_float8_all_gather)
        self.fuse_quant, self.cache_fp8_weights = bool(fuse_quant), bool(cache_fp8_weights)
        self.fused_dense = bool(fused_dense)
        self.fast_accum = bool(fast_accum)
        self.dgrad_hp = bool(dgrad_hp)
        self.stochastic_weights = bool(stochastic_weights)
        self._edp_shard = 1
        # data ranks FSDP2 spans for the dense weights; None until setup knows the layout. The dense FP8 weight cache
        # needs 1 (FSDP2 refills its unsharded weights without a version bump, so a cached copy could go stale)
        self._dense_data_ranks: Optional[int] = None
        self._compile_regions: tuple[str, ...] = ()
        self.device: Optional[torch.device] = None  # set by setup(); else the current CUDA device, else CPU
        self.converted: list[str] = []  # module names (auto: GEMM names) quantized by the last transform_model
        self.skipped: list[str] = []  # linears / experts left in high precision because of their dims
        self.decisions: list[Any] = []  # auto: one lightning_moe.lowp.gemm_choice.GemmDecision per GEMM
        self._ep = self._etp = self._cp = self._tp = 1
        self._data_tokens: Optional[int] = None  # from the trainer's datamodule (setup)

    def __repr__(self) -> str:
        return (f"LowPrecisionTraining(recipe={self.recipe!r}, emulate={self.emulate}, experts={self.experts}, "
                f"dense={self.dense}, keep_bf16={list(self.keep_bf16)}"
                + (f", force={list(self.force)}" if self.recipe == AUTO else "")
                + ("" if self.fast_accum else ", fast_accum=False") + (", dgrad_hp=True" if self.dgrad_hp else "")
                + (", stochastic_weights=True" if self.stochastic_weights else "")
                + ")")

    # ---- Lightning hooks ------------------------------------------------------------------------
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        """Before ``configure_model``: remember the device, the layout and the batch shape, and refuse layouts this
        recipe cannot do right."""
        from lightning_moe.strategies import MoEParallelStrategy

        strategy = trainer.strategy
        self.device = strategy.root_device
        if isinstance(strategy, MoEParallelStrategy):
            dims = strategy.parallel_dims
            self._ep, self._etp, self._cp, self._tp = dims.ep, dims.etp, dims.cp, dims.tp
            self._edp_shard = dims.edp_shard
            self._dense_data_ranks = dims.dp_replicate * dims.dp_shard * dims.cp
            self._compile_regions = tuple(strategy.compile_regions)
            if self.dense and self.recipe in SWAPPED_RECIPES and dims.tp > 1:
                raise ValueError(f"LowPrecisionTraining(recipe={self.recipe!r}) with tp={dims.tp}: block-scaled "
                                 "dense linears under tensor parallelism are not supported (blocks would straddle "
                                 "shards); use tp=1, dense=False, or an fp8 recipe")
        elif getattr(trainer, "world_size", 1) == 1:  # one process, no FSDP
            self._dense_data_ranks = 1
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and isinstance(getattr(dm, "batch_size", None), int) \
                and isinstance(getattr(dm, "seq_len", None), int):
            self._data_tokens = dm.batch_size * dm.seq_len
        if self.recipe != AUTO:  # auto checks the recipes it picks, when it has picked them
            check_hardware(self.recipe, self.emulate, self.device, dense=self.dense, experts=self.experts)

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(getattr(pl_module, "model", pl_module))

    # ---- the model transform --------------------------------------------------------------------
    def _always_kept(self, name: str) -> bool:
        return name.rsplit(".", 1)[-1] in ALWAYS_KEPT

    def _kept(self, name: str) -> bool:
        return self._always_kept(name) or _matches(name, self.keep_bf16)

    def _check_patterns(self, model: nn.Module) -> None:
        """A ``keep_bf16`` / ``force`` pattern that names nothing is a typo that would silently quantize (or leave)
        what the user meant to exclude (or force): refuse it, with names the model does have."""
        # module names, and the experts' grouped GEMMs under the names the decisions give them (<experts>.w1_w3)
        names = [n for n, _ in model.named_modules() if n] + [g.name for g in model_gemms(model) if g.kind == "grouped"]
        for arg, patterns in (("keep_bf16", self.keep_bf16), ("force", self.force)):
            unused = [p for p in patterns if not any(_matches(n, (p,)) for n in names)]
            if unused:
                examples = [n for n in names if "layers.0." in n or n.startswith("0.")][:6] or names[:6]
                raise ValueError(f"LowPrecisionTraining({arg}={list(patterns)}): {unused} match no module of the "
                                 f"model (fnmatch on full names such as {examples}); fix the pattern, e.g. with a "
                                 "leading '*.'")

    def _device(self) -> torch.device:
        if self.device is not None:
            return self.device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def transform_model(self, model: nn.Module) -> None:
        """Quantize the chosen modules of the (meta-device) model in place; idempotent."""
        self._check_patterns(model)
        if self.recipe == AUTO:
            return self._transform_auto(model)
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
                _set_grouped_mm(m, layers, self._grouped_mm(self.recipe, name))
                self.converted.append(name)
            elif self.dense and isinstance(m, nn.Linear) and not _is_converted_linear(m):
                if m.in_features % align or m.out_features % align:
                    self.skipped.append(name)
                    continue
                linears.append(name)
        if self.skipped:
            warnings.warn(f"LowPrecisionTraining({self.recipe}): left in high precision (dims not multiples of "
                          f"{align}): {self.skipped}", stacklevel=2)
        if linears:
            self._convert_dense(model, set(linears), self.recipe)
            self.converted += linears

    # ---- recipe="auto" ----------------------------------------------------------------------------
    def _load_table(self) -> Optional[CrossoverTable]:
        if isinstance(self.table, CrossoverTable):
            return self.table
        if isinstance(self.table, dict):
            return CrossoverTable(self.table)
        if self.table is not None:
            path = Path(self.table)
            if not path.is_file():
                raise ValueError(f"LowPrecisionTraining(table={str(self.table)!r}): no such file; make one with "
                                 f"`{BENCH_COMMAND}` or leave table=None for the shipped one")
            return CrossoverTable.load(path)
        arch = device_arch(self._device())
        path = shipped_table_path(arch)
        if path.is_file():
            return CrossoverTable.load(path)
        warnings.warn(f"LowPrecisionTraining(recipe='auto'): no FP8 crossover table for {arch} ({path}); every GEMM "
                      f"stays in high precision (never slower). Make one on this GPU with `{BENCH_COMMAND}` (it "
                      "writes that file), or pass table=PATH, or name a recipe", stacklevel=3)
        return None

    def _tokens(self) -> Optional[float]:
        if self.tokens_per_microbatch is not None:
            return float(self.tokens_per_microbatch)
        if self._data_tokens is not None:
            return self._data_tokens / self._cp
        return None

    def _fits(self, recipe: str, gemm: Gemm) -> bool:
        if recipe in SWAPPED_RECIPES and gemm.kind == "dense" and self._tp > 1:
            return False  # blocks would straddle tensor-parallel shards (see setup)
        align = RECIPES[recipe][1]
        return gemm.N % align == 0 and gemm.K % align == 0

    def _transform_auto(self, model: nn.Module) -> None:
        from lightning_moe.moe.experts import GroupedExperts
        from lightning_moe.moe.layer import MoELayer

        layers = {id(m.experts): m for m in model.modules() if isinstance(m, MoELayer)}
        modules = dict(model.named_modules())

        def eligible(g: Gemm) -> bool:
            m = modules[g.name.rsplit(".", 1)[0] if g.kind == "grouped" else g.name]
            if g.kind == "grouped":  # experts without the seam, or already given another GEMM, stay as they are
                return (self.experts and isinstance(m, GroupedExperts) and m.use_grouped_mm
                        and type(m.grouped_mm) is TorchGroupedMM)
            return self.dense and not _is_converted_linear(m) and not self._always_kept(g.name)

        gemms = [g for g in model_gemms(model, ep=self._ep, etp=self._etp, compiled=self._compiled_linear)
                 if eligible(g)]
        table = self._load_table()
        tokens = self._tokens()
        if tokens is None and (table is not None or self.force):
            raise ValueError("LowPrecisionTraining(recipe='auto') needs the tokens of a micro-batch to look up the "
                             "crossover table: pass tokens_per_microbatch=..., or train with a datamodule that has "
                             "batch_size and seq_len")

        def m_of(g: Gemm) -> Optional[float]:
            if tokens is None:
                return None
            if g.kind == "dense":
                return tokens
            layer = layers.get(id(modules[g.name.rsplit(".", 1)[0]]))
            return tokens * getattr(layer, "top_k", 1) / g.groups

        recipes = [r for r in AUTO_RECIPES if table is None or r in table.recipes]
        self.decisions = decide(gemms, table, m_of, recipes=recipes or list(AUTO_RECIPES), kept=self._kept,
                                forced=lambda n: _matches(n, self.force), fits=self._fits,
                                min_speedup=self.min_speedup)
        chosen = [d for d in self.decisions if d.recipe is not None]
        for recipe in sorted({d.recipe for d in chosen}):
            kinds = {d.gemm.kind for d in chosen if d.recipe == recipe}
            check_hardware(recipe, self.emulate, self._device(), dense="dense" in kinds, experts="grouped" in kinds)
        self.skipped = [d.gemm.name for d in self.decisions if d.why == "dims"]
        self.converted = [d.gemm.name for d in chosen]
        by_recipe: dict[str, set[str]] = {}
        for d in chosen:
            if d.gemm.kind == "dense":
                by_recipe.setdefault(d.recipe, set()).add(d.gemm.name)
        for recipe, names in sorted(by_recipe.items()):
            self._convert_dense(model, names, recipe)
        grouped: dict[str, list[GemmDecision]] = {}
        for d in self.decisions:
            if d.gemm.kind == "grouped":
                grouped.setdefault(d.gemm.name.rsplit(".", 1)[0], []).append(d)
        for name, ds in grouped.items():
            impl = self._experts_impl(name, ds)
            if impl is not None:
                _set_grouped_mm(modules[name], layers, impl)
        rank_zero_info(f"LowPrecisionTraining(recipe='auto'): table "
                       f"{'none' if table is None else table.source}, {len(chosen)} of {len(self.decisions)} GEMMs "
                       f"in FP8\n{decision_table(self.decisions)}")

    def _experts_impl(self, name: str, ds: list[GemmDecision]) -> Optional[GroupedMM]:
        """The grouped GEMM of one experts module from its projections' decisions (None: leave it as it is)."""
        recipes = {d.recipe for d in ds}
        if recipes == {None}:
            return None
        if len(recipes) == 1:
            return self._grouped_mm(ds[0].recipe, name)
        # w_EKN of gate / up is [e, D, F_local], of down [e, F_local, D]: the grouped GEMM's (K, N)
        by_shape: dict[tuple[int, int], GroupedMM] = {}
        for d in ds:
            key = (d.gemm.K, d.gemm.N)
            if key in by_shape:
                raise ValueError(f"LowPrecisionTraining(recipe='auto'): {name}'s gate / up and down GEMMs have the "
                                 f"same shape {key} but different choices; force or keep both")
            by_shape[key] = TorchGroupedMM() if d.recipe is None else self._grouped_mm(d.recipe, d.gemm.name)
        return PerShapeGroupedMM(by_shape)

    def _grouped_mm(self, recipe: str, name: str) -> LowPrecisionGroupedMM:
        return LowPrecisionGroupedMM(recipe, self.emulate, name, fuse=self.fuse_quant,
                                     cache_weights=self.cache_fp8_weights and self._edp_shard == 1,
                                     fast_accum=self.fast_accum, sr_weights=self.stochastic_weights)

    def _compiled_linear(self, name: str) -> bool:
        """Whether the dense linear ``name`` runs inside a region ``MoEParallelStrategy(compile=...)`` compiles."""
        parts = name.split(".")
        return ("attention" in self._compile_regions and "attention" in parts) or \
            ("mlp" in self._compile_regions and ("feed_forward" in parts or "shared_experts" in parts))

    def _convert_dense(self, model: nn.Module, names: set[str], recipe: str) -> None:
        if recipe in ROWWISE_GROUPED and self.fused_dense and not self.fsdp_float8_all_gather and self._tp == 1:
            eager = {n for n in names if not self._compiled_linear(n)}
            self._swap_fp8_linears(model, eager, *LINEAR_OF[recipe])
            names = names - eager
            if not names:
                return
        if self.stochastic_weights:
            raise ValueError(f"LowPrecisionTraining(stochastic_weights=True): {sorted(names)} would run torchao's "
                             "Float8Linear (inside a compiled region, or under tensor parallelism), which rounds to "
                             "nearest; leave them out of compile's regions, keep them in bf16 (keep_bf16), or drop "
                             "stochastic_weights")
        original = {name: type(model.get_submodule(name)) for name in names}
        if recipe in SWAPPED_RECIPES:
            if recipe in BLOCK_RECIPES:
                load_block_formats()  # fail now (a clear error), not in the first forward
            for name in names:
                m = model.get_submodule(name)
                m.__class__ = block_class(original[name])
                m.lowp_recipe, m.lowp_emulate = recipe, self.emulate
            return
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as e:
            raise ValueError(f"LowPrecisionTraining(recipe={recipe!r}) converts the dense linears with torchao>=0.18 "
                             f"(pip install 'lightning_moe[ao]'), which failed to import: {e}; or pass dense=False") from e
        config = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPE[recipe])
        if not self.fast_accum:  # torchao uses it in the forward only
            config = dataclasses.replace(config, gemm_config_output=dataclasses.replace(config.gemm_config_output,
                                                                                        use_fast_accum=False))
        if self.dgrad_hp:  # torchao: no cast of dy and w for the input gradient (the weight gradient's dy as before)
            from torchao.float8.config import CastConfig, ScalingType

            off = CastConfig(scaling_type=ScalingType.DISABLED)
            config = dataclasses.replace(config, cast_config_grad_output_for_grad_weight=(
                config.cast_config_grad_output_for_grad_weight or config.cast_config_grad_output),
                cast_config_grad_output=off, cast_config_weight_for_grad_input=off)
        config = dataclasses.replace(config, emulate=self.emulate,
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

    def _swap_fp8_linears(self, model: nn.Module, names: set[str], recipe: str, wgrad_hp: bool = False) -> None:
        """Our eager FP8 linear in place of ``names`` (class swap; same parameters), with one input cache per group
        of linears that read one activation (an attention block's input projections, an MLP's w1 / w3) and, for
        ``rowwise``, the attention block's RMSNorm quantizing that input in its own kernel."""
        from lightning_moe.lowp.fp8_fused import Fp8WeightCache
        from lightning_moe.models.transformer import RMSNorm

        groups: dict[tuple[str, str], list[str]] = {}
        for name in sorted(names):
            m = model.get_submodule(name)
            m.__class__ = fp8_class(Fp8Linear, type(m))
            m.lowp_recipe, m.lowp_emulate, m.lowp_wgrad_hp = recipe, self.emulate, wgrad_hp
            m.lowp_fast_accum, m.lowp_dgrad_hp = self.fast_accum, self.dgrad_hp
            m.lowp_sr_weights = self.stochastic_weights
            m.lowp_weight_cache = Fp8WeightCache() if self._dense_data_ranks == 1 and self.cache_fp8_weights else None
            m.lowp_input_cache = None
            parent, _, leaf = name.rpartition(".")
            role = next((r for r, leaves in SHARED_INPUT.items() if leaf in leaves), None)
            if role is not None:
                groups.setdefault((parent, role), []).append(name)
        for (parent, role), members in groups.items():
            norm = None
            if role == "attention" and recipe == "rowwise" and "norm" not in self._compile_regions:
                block = model.get_submodule(parent.rpartition(".")[0]) if "." in parent else model
                norm = getattr(block, "attention_norm", None) if parent.endswith("attention") else None
                attention = model.get_submodule(parent)
                readers = {f"{parent}.{leaf}" for leaf in SHARED_INPUT["attention"] if hasattr(attention, leaf)
                           and isinstance(getattr(attention, leaf), nn.Linear)}
                if not isinstance(norm, RMSNorm) or not readers <= set(members):
                    norm = None  # a reader left in bf16 (or another recipe) would take nothing from the norm
            if len(members) < 2 and norm is None:
                continue
            cache = Fp8InputCache(consumers=len(members))
            for name in members:
                model.get_submodule(name).lowp_input_cache = cache
            if norm is not None:
                norm.__class__ = fp8_class(Fp8QuantRMSNorm, type(norm))
                norm.lowp_emulate, norm.lowp_input_cache = self.emulate, cache
        # the original init stays: the swapped class is (Fp8Linear, original), whose reset_parameters comes first


# linears that read one activation: (role) -> module leaf names; the attention's are its input projections
SHARED_INPUT = {"attention": ("wq", "wk", "wv", "wq_a", "wkv_a"), "mlp": ("w1", "w3")}

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


def _is_converted_linear(m: nn.Module) -> bool:
    return isinstance(m, (BlockScaledLinear, Fp8Linear)) or type(m).__name__ == "Float8Linear"


def _matches(name: str, patterns: Sequence[str]) -> bool:
    """fnmatch on module names; a pattern naming a module also matches its children."""
    return any(fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns)


def _set_grouped_mm(experts: nn.Module, layers: dict[int, nn.Module], impl: GroupedMM) -> None:
    """Through the MoE layer holding ``experts`` (its plan depends on the grouped GEMM), else directly."""
    if id(experts) in layers:
        layers[id(experts)].replan(grouped_mm=impl)
    else:
        experts.set_grouped_mm(impl)
