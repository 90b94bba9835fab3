#!/usr/bin/env python
"""Low-precision training (issues 11, 23): speed of FP8 vs the high-precision run, and convergence of every recipe.

One piece (about 600 lines; the convergence mode's runs live in ``bench/lowp_convergence.py``): its three modes share
one protocol (the baseline in the same process, the same precision), one recipe list and one report.

Modes (``--mode``, comma-separated; all three by default), each against a baseline *in the same process* with the
same Lightning precision (``--precision``: bf16-true on CUDA, 32-true on CPU):

``layer``        MoE layer forward + backward at the three shapes of ``bench/moe_layer.py`` (its ``SHAPES``,
                 ``build_ours``, ``time_steps``, ``fwd_bwd_step``: Qwen3-30B-A3B 16384 tokens, DeepSeek-V3 and Mixtral
                 8192), baseline vs ``--layer-recipes`` (default ``auto``: the callback's per-GEMM choice from the
                 crossover table, ``--table`` or the shipped one; ``fp8_tensorwise``; ``fp8_rowwise``: experts
                 through torchao's FP8 rowwise grouped GEMM with our 16-row group padding, shared experts through
                 the dense FP8 linear), each the median of ``--repeats`` (3) runs interleaved across recipes,
                 same weights, same x / dy, routing as initialised ("learned") and round-robin ("forced",
                 ``MoEConfig.force_balance``). Also the output's relative difference to the baseline (quantization
                 happened, and no more than that) and the peak memory. ``--profile``: one profiled fwd+bwd of the
                 baseline and of ``--profile-recipes`` per shape: device time by kernel category (bf16 GEMM, fp8
                 GEMM, quantize, copy / pad, other) and the top kernels -- where FP8's time goes.
``step``         train step of each ``--step-models`` entry (``qwen8``: the 8-layer Qwen3-30B-A3B-shaped bench model of
                 ``bench/train_step.py``, 4 x 4096 tokens; ``dsv3``: ``bench/deepseek_v3_step.py``'s DeepSeek-V3
                 shape, 3 layers and 64 experts, 2 x 4096) in each ``--step-modes`` entry (``eager``; ``compiled``:
                 regional torch.compile through ``MoEParallelStrategy(compile=True)``): baseline vs
                 ``--step-recipes`` (auto, fp8_rowwise): tokens/s, peak memory, how many GEMMs ran in FP8. A run's
                 tokens/s is the median of ``--step-windows`` (3) equal windows of its timed steps, a recipe's the
                 median over ``--step-repeats`` (1) interleaved runs: one run builds the model in 40-90 s on an
                 H200, so repeats as separate runs would not fit a call. ``--profile``: 3 steps of each recipe's
                 first run profiled (the window after the warmup; the median of windows keeps it out of the rate),
                 device time per step by kernel category (attention, optimizer, quantize, GEMMs, copies).
``convergence``  ``--conv-steps`` (300) steps of ``--preset`` from the same init (same seed: the callback keeps
                 every module's init; each run records checksums of its first batch and initial weights) on the
                 embedded corpus, baseline then each of ``--recipes`` (``fp8_rowwise`` is FP8 forced on every GEMM
                 a recipe can take; ``auto`` the default choice), then with ``--noise-seed N`` the baseline from
                 another init (the noise to read the differences against). ``bench8``: the 8-layer bench model,
                 lr 1e-4, warmup a tenth of the steps, fp32 master weights and AdamW moments at bf16 (at lr 3e-4,
                 a 20-step warmup and bf16 AdamW state its baseline spiked and two runs of one bf16 program ended
                 5.6% apart); ``tiny``: the main job's model and settings (``examples/configs/tiny.yaml``: lr 3e-3,
                 8 x 256 tokens, AdamW wd 0.1, warmup min(20, steps / 10)). ``--conv-lr``, ``--conv-warmup``,
                 ``--conv-master`` override them;
                 ``--conv-model KEY=VALUE`` (repeatable, ``moe.KEY`` for the MoE block) rebuilds bench8 at another
                 shape, e.g. fewer layers, a narrower width or 64 experts top-8 small enough for a CPU, to find
                 where a recipe's loss difference appears. Both presets: cosine to 0.1 x lr, AdamW wd 0.1, clip 1.0.
                 Smoothed final loss = mean train loss of the last ``--smooth`` (20) steps; relative difference to
                 the baseline (targets: FP8 recipes 1%, MXFP8 / NVFP4 3%). Curves: ``<out stem>_curves.png``
                 (matplotlib, the ``bench`` extra) or ``.csv``. ``--conv-seeds 0,1,2``: every init seed runs the
                 baseline and each recipe, paired: the mean (sd, min, max) of the per-seed differences is what the
                 targets read. ``--conv-reference JSON ...``: the finished runs of earlier reports with the same
                 settings are kept and only the missing (recipe, seed) runs run (seeds spread over calls; nothing
                 missing: a merge, on any machine). ``repeat`` in ``--recipes``: the baseline's program again from
                 the same init, compared with that init's baseline and given no target: the spread that kernel
                 nondeterminism alone makes (on bench8 it is as large as the target). ``--conv-hp-loss``: each
                 quantized run also records, before every step, the same batch's loss at the same weights with
                 every low-precision module in high precision (``lightning_moe.lowp.high_precision``): the
                 quantized forward's own cost (its loss over that one) apart from what the low-precision training
                 did to the weights (that loss over the baseline's); dashed in the curves. ``noise`` in
                 ``--recipes``: the bf16 program with zero-mean Gaussian noise of FP8's size (``--noise-sigma``,
                 default a rowwise e4m3 GEMM's relative error) on the outputs and gradients of the GEMMs a forced
                 recipe converts (``bench/lowp_noise.py``), no target: what perturbations of FP8's size cost
                 without FP8's rounding. ``--conv-grad-check STEPS``: each non-baseline run compares, in windows
                 of ``--conv-grad-window`` steps, its gradient with the high-precision gradient of the same batch
                 at the same weights, per parameter group (error, cosine, projection, persistence over steps),
                 also in AdamW's coordinates (each element over the run's own sqrt(v_hat) + eps: how large the
                 error is in the update the optimizer makes of it, small-gradient elements weighing as much).

Recipes (``--layer-recipes``, ``--step-recipes``, ``--recipes``): any may carry ``:dense`` or ``:experts``, e.g.
``fp8_rowwise:experts``: FP8 on that kind of GEMM only (``LowPrecisionTraining(dense=False)`` / ``(experts=False)``),
to find which GEMMs cost the speed or the loss; and ``:precise``: no FP8 GEMM uses Hopper's fast accumulation
(``LowPrecisionTraining(fast_accum=False)``), e.g. ``fp8_rowwise:experts:precise``; ``:dgrad_hp``: the dense linears'
input gradient in bf16 (``LowPrecisionTraining(dgrad_hp=True)``; ``fp8_rowwise_gw_hp:dense:dgrad_hp`` is FP8 in the
dense forward only); ``:sr_w``: the FP8 weights (experts and dense linears) stochastically rounded each step
(``LowPrecisionTraining(stochastic_weights=True)``, e.g. ``fp8_rowwise:sr_w``, ``fp8_rowwise:dense:sr_w``); and ``:keep=PATTERN``
(repeatable): those modules stay in bf16 (``LowPrecisionTraining(keep_bf16=[...])``, fnmatch on module names), e.g.
``fp8_rowwise:dense:keep=*.wo`` for FP8 on the attention's q / k / v projections only (bench8's dense linears are
the attention's four); and ``:emulate``: that arm emulated on CUDA too (``fp8_rowwise:emulate`` pairs the
emulation, the reference numerics, with the same baselines as the kernels' ``fp8_rowwise``).

Targets (issue 23, bf16 time / FP8 time of the default ``auto``): at least 0.98 everywhere (never slower), Mixtral
layer 1.3, DeepSeek-V3 layer 1.1, DeepSeek-V3-shaped step 1.1 (``SPEED_TARGETS``); printed beside each ratio.

Emulation: on CPU every recipe runs emulated; MXFP8 / NVFP4 always do (no sm100 kernels wired); ``--emulate``
forces it for the FP8 recipes on CUDA too. ``--small``: toy sizes for a smoke test (tests/test_low_precision_bench.py).

Time: ``--time-limit S`` bounds the whole call. Before each unit (a layer shape, a step run, a convergence run) the
script checks what is left and skips the unit with a "SKIPPED" line when it cannot fit; a convergence run gets a
Lightning ``max_time`` of all that is left (``--conv-share in-order``, the default: the runs complete one after
another, and when not all fit the last ones are truncated or skipped) or of a share by its expected cost
(``proportional``: a quantizing run 2.5 times a bf16 one until runs of each kind have finished, then their measured
step times; every run then gets steps, all truncated when not all fit); a truncated pair is compared at its common
length and flagged. Every run prints its wall time and seconds per step; the JSON is rewritten (atomically) after every
mode and every convergence run, so a call killed from outside leaves what it finished (``partial``, readable with
``--conv-reference``).

GPU (one H200; repository root), the issue 23 recording in two calls:
    python -m bench low_precision --mode layer,step --profile --time-limit 570 \
        --out bench/results/low_precision_h200.json
    python -m bench low_precision --mode convergence --recipes fp8_rowwise,auto --noise-seed 1 --batch-size 2 \
        --time-limit 480 --out bench/results/low_precision_conv_h200.json
CPU (the emulated MXFP8 / NVFP4 convergence on the tiny preset; 1.5 / 4 / 5.5 minutes for baseline / mxfp8 / nvfp4
on one thread of a 2-core Xeon: ``--threads 1`` on a shared machine, where 2 threads ran 10x slower; bf16-true runs
about as fast as the default 32-true there):
    python -m bench low_precision --device cpu --threads 1 --precision bf16-true --mode convergence --preset tiny \\
        --recipes mxfp8,nvfp4 --conv-steps 300 --out bench/results/low_precision_tiny_cpu_bf16.json
Curves of a report written where matplotlib is missing (a CSV there), redrawn elsewhere:
    python -m bench low_precision --plot-from bench/results/low_precision_h200.json
Smoke test (CPU, seconds):
    python -m bench low_precision --device cpu --small --shapes mixtral --conv-steps 3 --out /tmp/lowp.json
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/low_precision.py ...` runs `python -m bench low_precision ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import os
import datetime
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench import moe_layer, train_step
from bench.core.curves import BASE, NOISE, REPEAT, convergence_table, save_curves, tightest_target
from bench.core.kernel_profile import profile_lines, profile_step
from bench.core.text import err as _err, fmt_cell as _fmt, log
from bench.lowp_convergence import BENCH8_LR, bench8_config, bench_convergence
from bench.lowp_noise import FP8_ROWWISE_SIGMA, NoiseInjection
from lightning_moe.callbacks import LowPrecisionTraining
from lightning_moe.callbacks.low_precision import AUTO, BLOCK_RECIPES, GW_HP

FP8_RECIPES = ("fp8_tensorwise", "fp8_rowwise")
# AUTO: FP8 per GEMM where the table pays
ALL_RECIPES = (AUTO,) + FP8_RECIPES + (GW_HP, "fp8_blockwise") + BLOCK_RECIPES
# issue 23's speed targets (bf16 time / FP8 time): the default (auto) never below NEVER_SLOWER anywhere, and at least
# these where the shapes allow (layer: bench/moe_layer.py's shape names; step: --step-models names)
NEVER_SLOWER = 0.98
SPEED_TARGETS = {"layer": {"mixtral": 1.3, "deepseek_v3": 1.1}, "step": {"dsv3": 1.1}}
STEP_MODELS = ("qwen8", "dsv3")  # the 8-layer Qwen3-30B-A3B bench model; bench/deepseek_v3_step.py's model
STEP_MODES = ("eager", "compiled")
# rough seconds a unit needs on an H200 (setup included), to decide before starting it; CPU --small: a few seconds
UNIT_S = {"cuda": {"layer": 25.0, "step": 40.0, "convergence": 45.0}, "cpu": {"layer": 5.0, "step": 10.0,
                                                                              "convergence": 10.0}}
# a step run's rough cost relative to "step" (model size, torch.compile)
STEP_COST = {("qwen8", "eager"): 1.0, ("qwen8", "compiled"): 2.0, ("dsv3", "eager"): 1.5, ("dsv3", "compiled"): 2.5}


class Budget:
    """``--time-limit``: seconds left, and whether a unit that needs ``need`` seconds may start."""

    def __init__(self, limit: Optional[float]) -> None:
        self.limit, self.t0 = limit, time.perf_counter()

    def left(self) -> float:
        return math.inf if self.limit is None else self.limit - (time.perf_counter() - self.t0)

    def allows(self, need: float, what: str) -> bool:
        if self.left() >= need:
            return True
        log(f"SKIPPED {what}: {max(0.0, self.left()):.0f} s left of --time-limit {self.limit:.0f} s, needs ~{need:.0f} s")
        return False


# ``recipe:modifier[:modifier]``: the recipe on one kind of GEMM only (to find which GEMMs cost speed or loss), or
# without Hopper's fast FP8 accumulation (``precise``: LowPrecisionTraining(fast_accum=False))
SCOPES = {"dense": {"experts": False}, "experts": {"dense": False}, "precise": {"fast_accum": False},
          "dgrad_hp": {"dgrad_hp": True},  # the dense linears' input gradient in bf16
          "sr_w": {"stochastic_weights": True}}  # the FP8 weights stochastically rounded (rowwise recipes)
# ``recipe:emulate``: that arm emulated on CUDA too (a distinct arm beside the kernels' run of the same recipe, so
# that the emulation's convergence pairs with the same baselines: the reference numerics against the kernels')
EMULATE = "emulate"
KEEP = "keep="  # ``recipe:keep=PATTERN``: LowPrecisionTraining(keep_bf16=[PATTERN, ...]), e.g. ``fp8_rowwise:keep=*.wo``


def _valid_modifier(m: str) -> bool:
    return m in SCOPES or m == EMULATE or (m.startswith(KEEP) and len(m) > len(KEEP))


def _modifiers(recipe: str) -> list[str]:
    return recipe.split(":")[1:]


def _emulate(recipe: str, args: argparse.Namespace) -> bool:
    return (args.device == "cpu" or args.emulate or recipe.partition(":")[0] in BLOCK_RECIPES
            or EMULATE in _modifiers(recipe))


def _callback(recipe: str, args: argparse.Namespace, tokens: Optional[int] = None) -> LowPrecisionTraining:
    name = recipe.partition(":")[0]
    kw: dict[str, Any] = {"fused_dense": args.dense_impl == "fused"}
    keep = [m[len(KEEP):] for m in _modifiers(recipe) if m.startswith(KEEP)]
    for modifier in _modifiers(recipe):
        kw.update(SCOPES.get(modifier, {}))
    if keep:
        kw["keep_bf16"] = keep
    if name == AUTO:  # tokens: the layer's; a train step's come from its datamodule
        return LowPrecisionTraining(AUTO, emulate=_emulate(recipe, args), tokens_per_microbatch=tokens,
                                    table=args.table, **kw)
    return LowPrecisionTraining(name, emulate=_emulate(recipe, args), **kw)


def _median_of_repeats(reps: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One result from ``--repeats`` runs: the median of their ``key`` (and every value), the largest peak."""
    vals = [r[key] for r in reps if r.get(key) is not None]
    out = dict(reps[len(reps) // 2]) if reps else {}
    if vals:
        out[key] = statistics.median(vals)
    out[f"{key}_repeats"] = vals
    peaks = [r["peak_gib"] for r in reps if r.get("peak_gib") is not None]
    out["peak_gib"] = max(peaks) if peaks else None
    return out


# ------------------------------------------------------------------------------------------------ (a) layer
def bench_layer(args: argparse.Namespace, device: torch.device, budget: Budget) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if "bf16" in args.precision else torch.float32
    recipes = (BASE, *args.layer_recipes)
    out = []
    for name in args.shapes:
        res: dict[str, Any] = {"shape": name}
        out.append(res)
        if not budget.allows(UNIT_S[device.type]["layer"] * args.repeats, f"layer {name}"):
            res["skipped"] = "time limit"
            continue
        try:
            cfg = moe_layer.model_config(name, args.small)
            T = moe_layer.SMALL_TOKENS if args.small else moe_layer.SHAPES[name]["tokens"]
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, generator=gen).requires_grad_(True)
            dy = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
        except Exception as e:  # report, keep going
            res["error"] = _err(e)
            log(f"layer {name}: {res['error']}")
            continue
        res["tokens"] = T
        y_base = None
        timings: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for rep in range(args.repeats):  # repeats interleaved across recipes: drifts hit every recipe alike
            for recipe in recipes:
                r: dict[str, Any] = res.setdefault(recipe, {})
                if "error" in r:
                    continue
                layer = None
                try:
                    layer = moe_layer.build_ours(cfg, device, dtype, seed=0)
                    if recipe != BASE:
                        cb = _callback(recipe, args, tokens=T)
                        cb.device = device
                        cb.transform_model(layer)
                        r["converted"], r["emulate"] = cb.converted, cb.emulate
                    r["plan"] = str(layer.plan)  # FP8 rowwise experts: fp8_fused=True
                    if rep == 0:
                        with torch.no_grad():
                            y = layer(x).float()
                        if recipe == BASE:
                            y_base = y
                        elif y_base is not None:
                            r["y_rel_diff"] = float((y - y_base).norm() / y_base.norm())
                        del y
                    if rep == 0 and args.profile and recipe in (BASE, *args.profile_recipes):
                        res.setdefault("profile", {})[recipe] = profile_step(
                            moe_layer.fwd_bwd_step(layer, x, dy), device)
                    for routing in args.routing:
                        layer.router.config.force_balance = routing == "forced"
                        try:
                            t = moe_layer.time_steps(moe_layer.fwd_bwd_step(layer, x, dy), device, args.warmup,
                                                     args.iters)
                        finally:
                            layer.router.config.force_balance = False
                        t.pop("times_ms", None)
                        timings.setdefault((recipe, routing), []).append(t)
                        r[routing] = _median_of_repeats(timings[(recipe, routing)], "ms")
                except Exception as e:  # report, keep going
                    r["error"] = _err(e)
                    log(traceback.format_exc())
                finally:
                    del layer
                    train_step.reset_memory(device)
        for routing in args.routing:
            base_ms = res[BASE].get(routing, {}).get("ms")
            for recipe in args.layer_recipes:
                ms = res[recipe].get(routing, {}).get("ms")
                if base_ms and ms:
                    res[recipe][routing]["speedup"] = base_ms / ms
        log(layer_lines(res, args))
        if res.get("profile"):
            log(profile_lines(res))
    return out


def layer_lines(res: dict[str, Any], args: argparse.Namespace) -> str:
    if "skipped" in res or "error" in res:
        return f"layer {res['shape']:12s} {res.get('skipped') or res.get('error')}"
    lines = []
    for recipe in (BASE, *args.layer_recipes):
        r = res.get(recipe, {})
        if "error" in r:
            lines.append(f"layer {res['shape']:12s} T={res['tokens']:6d} {recipe:15s} ERROR {r['error']}")
            continue
        parts = []
        for routing in args.routing:
            t = r.get(routing, {})
            sp = f" {t['speedup']:.3f}x" if "speedup" in t else ""
            peak = _fmt(t.get("peak_gib"), ".2f")
            parts.append(f"{routing} {t.get('ms', float('nan')):8.3f} ms{sp} (peak {peak} GiB)")
        diff = f"  y rel diff {r['y_rel_diff']:.2e}" if "y_rel_diff" in r else ""
        if recipe == AUTO:
            diff += f"  {len(r.get('converted', []))} GEMMs in FP8"
        lines.append(f"layer {res['shape']:12s} T={res['tokens']:6d} {recipe:15s} " + ", ".join(parts) + diff
                     + (f"  (target >= {speed_target('layer', res['shape'], recipe)}x)" if recipe == AUTO else ""))
    return "\n".join(lines)


def speed_target(mode: str, name: str, recipe: str) -> float:
    """The bf16 / FP8 ratio issue 23 asks of ``recipe`` (the default, auto) at one layer shape / step model."""
    return max(NEVER_SLOWER, SPEED_TARGETS[mode].get(name, NEVER_SLOWER)) if recipe == AUTO else NEVER_SLOWER


# ------------------------------------------------------------------------------------------------ (b) step
def _init_checksum_callback() -> Any:
    """A Lightning callback recording the sum of all parameters when training starts (same init check)."""
    import lightning as L

    class InitChecksum(L.Callback):
        value: Optional[float] = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            with torch.no_grad():
                self.value = float(sum(p.float().sum() for p in pl_module.parameters()
                                       if not hasattr(p, "full_tensor")))

    return InitChecksum()


def _run(label: str, cfg: Any, recipe: str, args: argparse.Namespace, device: torch.device, peak: Optional[dict],
         timed: bool, steps: int, seq_len: int, batch_size: int, lr: float, seed: Optional[int] = None,
         profile: bool = False, more_callbacks: tuple = (), **run_kwargs: Any) -> dict[str, Any]:
    # profile: 3 steps from the warmup's end, kernels by category (no trace file: a step's trace is ~100 MB)
    ts_args = argparse.Namespace(steps=steps, warmup=args.warmup, precision=args.precision, loss_impl="auto",
                                 profile=profile, profile_trace=False, out=args.out)
    chk = _init_checksum_callback()
    plain = recipe in (BASE, REPEAT)  # REPEAT: the baseline's program again (convergence)
    seed = args.seed if seed is None else seed
    if recipe == NOISE:  # the bf16 program with FP8-sized noise on the forced recipes' GEMMs (convergence)
        cb: Any = NoiseInjection(args.noise_sigma, seed=seed)
    else:
        cb = None if plain else _callback(recipe, args)
    extra = ((chk,) if cb is None else (chk, cb)) + tuple(more_callbacks)
    r = train_step.run_ours(f"{label}-{recipe}", cfg, seq_len, batch_size, ts_args, lr, device, peak, timed,
                            extra_callbacks=extra, seed=seed, **run_kwargs)
    r["recipe"], r["init_checksum"], r["precision"], r["seed"] = recipe, chk.value, args.precision, seed
    r["emulate"] = None if plain or recipe == NOISE else _emulate(recipe, args)
    if recipe == NOISE:
        r["noise_sigma"] = args.noise_sigma
    if not plain:
        r["converted"] = list(extra[1].converted)
    n = len(r.get("step_times_s") or [])
    r["mean_step_s"] = sum(r["step_times_s"]) / n if n else None
    log(f"run {label}-{recipe}: {n} steps in {r['wall_s']:.1f} s wall "
        f"({'-' if r['mean_step_s'] is None else format(r['mean_step_s'], '.3f')} s/step)")
    return r


def _step_model(name: str, args: argparse.Namespace) -> tuple[Any, int, int]:
    """(config, sequence length, batch size) of a ``--step-models`` entry: ``qwen8`` the 8-layer Qwen3-30B-A3B bench
    model (``--seq-len`` x ``--batch-size``), ``dsv3`` bench/deepseek_v3_step.py's reduced DeepSeek-V3 (3 layers,
    64 experts, 2 x 4096 tokens as that bench runs it; its tiny twin with ``--small``)."""
    if name == "qwen8":
        return bench8_config(args), args.seq_len, args.batch_size
    from bench import deepseek_v3_step

    return deepseek_v3_step.model_config(args.small), (64 if args.small else 4096), 2


def bench_step(args: argparse.Namespace, device: torch.device, budget: Budget) -> list[dict[str, Any]]:
    """Every (model, mode) of ``--step-models`` x ``--step-modes``: the baseline and each step recipe, ``--repeats``
    times interleaved (a cut call still has one run of each first), the median tokens/s."""
    peak = None
    if device.type == "cuda":
        try:
            peak = train_step.measure_matmul_peak(device)
        except Exception as e:  # the ratios do not need it
            log(f"matmul peak: {_err(e)}")
    recipes = (BASE, *args.step_recipes)
    cells = [(m, mode) for m in args.step_models for mode in args.step_modes]
    reps: dict[tuple[str, str, str], list[dict[str, Any]]] = {(m, mode, r): [] for m, mode in cells for r in recipes}
    for rep in range(args.step_repeats):
        for m, mode in cells:
            cfg, seq_len, batch_size = _step_model(m, args)
            need = UNIT_S[device.type]["step"] * STEP_COST.get((m, mode), 1.0)
            for recipe in recipes:
                if not budget.allows(need, f"step {m} {mode} {recipe} (repeat {rep + 1})"):
                    continue
                variant = "auto+compile" if mode == "compiled" else ""
                r = _run(f"{m}-{mode}" + ("-small" if args.small else ""), cfg, recipe, args, device, peak, True,
                         args.steps, seq_len, batch_size, 3e-4, variant=variant, profile=args.profile and rep == 0)
                r.pop("losses", None)
                windows = step_windows(r.get("step_times_s") or [], args.warmup, args.step_windows,
                                       batch_size * seq_len)
                if windows:  # the run's rate: the median of its windows (a slow step moves one window only)
                    r["tokens_per_s_windows"], r["tokens_per_s"] = windows, statistics.median(windows)
                reps[(m, mode, recipe)].append(r)
    runs: list[dict[str, Any]] = []
    for m, mode in cells:
        cell = []
        for recipe in recipes:
            done = [r for r in reps[(m, mode, recipe)] if r.get("tokens_per_s")]
            base_fields = {"model": m, "mode": mode, "recipe": recipe, "repeats": len(done)}
            if done:
                prof = {k: done[0][k] for k in ("profile_categories_ms", "profile_top") if k in done[0]}
                cell.append({**_median_of_repeats(done, "tokens_per_s"), **prof, **base_fields})
            else:
                first = reps[(m, mode, recipe)][0] if reps[(m, mode, recipe)] else {"skipped": "time limit"}
                cell.append({**first, **base_fields})
        base = cell[0].get("tokens_per_s")
        for r in cell:
            if base and r.get("tokens_per_s"):
                r["speedup"] = r["tokens_per_s"] / base
            if r["recipe"] != BASE:
                r["target"] = speed_target("step", m, r["recipe"])
        runs += cell
    log(step_table(runs))
    for r in runs:
        if r.get("profile_categories_ms"):
            log(f"profile {r['model']} {r['mode']} {r['recipe']} (device ms per step): "
                + "  ".join(f"{k} {v:.1f}" for k, v in r["profile_categories_ms"].items()))
    return runs


def step_windows(times: list[float], warmup: int, n: int, tokens_per_step: int) -> list[float]:
    """Tokens/s of ``n`` consecutive equal windows of the steps after ``warmup`` (a remainder at the end is left
    out); empty when there are fewer timed steps than windows."""
    timed = times[warmup:]
    size = len(timed) // n if n > 0 else 0
    if size == 0:
        return []
    return [tokens_per_step * size / sum(timed[i * size:(i + 1) * size]) for i in range(n)]


def step_table(runs: list[dict[str, Any]]) -> str:
    lines = [f"{'step model':10s} {'mode':9s} {'recipe':15s} {'tokens/s':>10s} {'speedup':>8s} {'target':>7s} "
             f"{'peak GiB':>9s} {'repeats':>7s} {'FP8 GEMMs':>9s}  note"]
    for r in runs:
        note = r.get("skipped") or (r.get("error") or "")[:100]
        target = f"{r['target']:.2f}" if r.get("target") else ""
        n_fp8 = "" if r["recipe"] == BASE else str(len(r.get("converted") or []))
        lines.append(f"{r.get('model', ''):10s} {r.get('mode', ''):9s} {r['recipe']:15s} "
                     f"{_fmt(r.get('tokens_per_s'), '10.0f')} {_fmt(r.get('speedup'), '8.3f')} {target:>7s} "
                     f"{_fmt(r.get('peak_gib'), '9.2f')} {r.get('repeats', 0):7d} {n_fp8:>9s}  {note}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main
def _recipes(value: str, allowed: tuple[str, ...], what: str, scoped: bool = False) -> tuple[str, ...]:
    out = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in out if (v.partition(":")[0] if scoped else v) not in allowed
           or (not scoped and ":" in v) or not all(_valid_modifier(m) for m in _modifiers(v))
           or {"dense", "experts"} <= set(_modifiers(v)) or (v.partition(":")[0] in (REPEAT, NOISE) and ":" in v)]
    if bad:
        extra = (", each optionally with :dense or :experts (not both), :precise (no fast FP8 accumulation), "
                 ":dgrad_hp (the dense linears' input gradient in bf16), :sr_w (FP8 weights stochastically rounded), "
                 ":emulate (emulated on CUDA too) and :keep=PATTERN (module names kept in bf16; repeatable)"
                 if scoped else "")
        raise SystemExit(f"{what}: unknown {bad}; choose from {list(allowed)}{extra}")
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="layer,step,convergence", help="comma-separated: layer, step, convergence")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes and few steps (CPU smoke test)")
    p.add_argument("--emulate", action="store_true", help="emulate the FP8 recipes on CUDA too (always on CPU)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole call (units that cannot "
                   "fit are skipped, convergence runs cut and flagged)")
    p.add_argument("--precision", default=None, help="Lightning precision of every run (baseline and recipes); "
                   "default bf16-true (cuda), 32-true (cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--repeats", type=int, default=3, help="layer and step: runs per recipe, interleaved; the median "
                   "is reported (and every repeat's value)")
    p.add_argument("--table", default=None, help="crossover table for the auto recipe (default: the one shipped "
                   "for this GPU, lightning_moe/lowp/crossover/<arch>.json)")
    p.add_argument("--dense-impl", choices=["fused", "torchao"], default="fused", help="FP8 dense linears outside "
                   "compiled regions: our eager FP8 linear (the default) or torchao's Float8Linear")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed of every run (the data order is the "
                   "data module's own seed); another seed's baseline gauges the run-to-run spread")
    p.add_argument("--out", default="bench/results/low_precision.json")
    p.add_argument("--plot-from", default=None, metavar="JSON", help="only redraw the convergence curves of a "
                   "report this script wrote (e.g. a GPU run's, on a machine with matplotlib), next to it")
    g = p.add_argument_group("layer")
    g.add_argument("--shapes", default="qwen3,deepseek_v3,mixtral")
    g.add_argument("--layer-recipes", default="auto,fp8_tensorwise,fp8_rowwise")
    g.add_argument("--routing", default="learned,forced", help="learned (as initialised) and/or forced (balanced)")
    g.add_argument("--iters", type=int, default=None, help="timed layer steps (default 20; 2 with --small)")
    g.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5; 1 with --small)")
    g = p.add_argument_group("step")
    g.add_argument("--step-recipes", default="auto,fp8_rowwise")
    g.add_argument("--step-repeats", type=int, default=1, help="step: runs per recipe (each builds the model: "
                   "40-90 s on an H200), interleaved; the median")
    g.add_argument("--step-windows", type=int, default=3, help="step: the timed steps of a run in this many equal "
                   "windows; the run's tokens/s is their median")
    g.add_argument("--step-models", default=",".join(STEP_MODELS), help=f"comma-separated: {', '.join(STEP_MODELS)}")
    g.add_argument("--step-modes", default=",".join(STEP_MODES), help="eager and/or compiled (regional "
                   "torch.compile through MoEParallelStrategy(compile=True))")
    g.add_argument("--steps", type=int, default=None, help="train-step mode steps per run, warmup included "
                   "(default 29: 5 warmup, 3 windows of 8; 4 with --small)")
    g.add_argument("--seq-len", type=int, default=None, help="bench8 sequence length (default 4096; 128 --small)")
    g.add_argument("--batch-size", type=int, default=4, help="bench8 batch size")
    g = p.add_argument_group("convergence")
    g.add_argument("--preset", choices=["bench8", "tiny"], default=None,
                   help="bench8: the 8-layer bench model (default on cuda); tiny: the main job (default on cpu)")
    g.add_argument("--recipes", default=None, help="default: fp8_tensorwise,fp8_rowwise for bench8, mxfp8,nvfp4 "
                   "for tiny")
    g.add_argument("--conv-steps", type=int, default=None, help="steps per run (default 300; 8 with --small)")
    g.add_argument("--smooth", type=int, default=None, help="steps averaged for the final loss (default 20; 3 small)")
    g.add_argument("--conv-model", action="append", default=None, metavar="KEY=VALUE", help="bench8 only: override "
                   "a field of its model (moe.KEY for the MoE block), repeatable, e.g. --conv-model hidden_size=512 "
                   "--conv-model moe.num_experts=128; recorded in the report's settings")
    g.add_argument("--noise-seed", type=int, default=None, help="also run the baseline from this init seed: its "
                   "difference to the first baseline is the noise the recipes' differences are read against")
    g.add_argument("--conv-seeds", default=None, help="comma-separated init seeds (default: --seed): each runs the "
                   "baseline and every recipe from that init; the target reads the mean paired difference")
    g.add_argument("--conv-reference", default=None, nargs="+", metavar="JSON", help="the finished runs of earlier "
                   "reports (same settings): only the (recipe, seed) runs they lack run here; none left: a merge")
    g.add_argument("--conv-share", choices=["in-order", "proportional"], default="in-order", help="how a "
                   "--time-limit is split among the convergence runs: in-order (each run, in order, may use all that "
                   "is left: runs complete one after another, the last ones truncated or skipped when not all fit; "
                   "the target counts complete pairs only) or proportional (each run a share by its expected cost, so "
                   "every run gets steps and all are truncated when not all fit)")
    g.add_argument("--conv-lr", type=float, default=None, help=f"peak learning rate (default: bench8 {BENCH8_LR:g}, "
                   "tiny the main job's)")
    g.add_argument("--conv-warmup", type=int, default=None, help="warmup steps (default: bench8 a tenth of the "
                   "steps, tiny min(20, steps / 10))")
    g.add_argument("--conv-master", choices=["auto", "fp32", "none"], default="auto", help="fp32 master weights and "
                   "AdamW moments in every run (MoELanguageModel(master_dtype='fp32')); auto: on for bench8 at bf16")
    g.add_argument("--conv-hp-loss", action="store_true", help="every quantized run also records, before each step, "
                   "the loss of the same batch at the same weights in high precision (lightning_moe.lowp."
                   "high_precision): the quantized forward's own cost apart from what training did to the weights")
    g.add_argument("--conv-grad-check", type=lambda v: [int(x) for x in v.split(",") if x], default=None,
                   metavar="STEP[,STEP]", help="every run but the baselines also compares, in windows of "
                   "--conv-grad-window steps starting at these, its gradient with the high-precision gradient of the "
                   "same batch at the same weights, per parameter group (error, cosine, projection, and whether the "
                   "error persists from step to step: a bias; each also over AdamW's denominator, adam_*)")
    g.add_argument("--conv-grad-window", type=int, default=8, help="steps per --conv-grad-check window")
    g.add_argument("--noise-sigma", type=float, default=FP8_ROWWISE_SIGMA, help="the noise arm: each GEMM output's "
                   "noise, relative to its rows' rms (default: a rowwise e4m3 GEMM's relative rms error)")
    g = p.add_argument_group("profile")
    g.add_argument("--profile", action="store_true", help="layer mode: profile one fwd+bwd of the baseline and of "
                   "--profile-recipes at each shape; step mode: 3 steps of every first run (device time by kernel "
                   "category, top kernels)")
    g.add_argument("--profile-recipes", default="fp8_rowwise")
    a = p.parse_args(argv)
    for k, full, tiny in (("iters", 20, 2), ("warmup", 5, 1), ("steps", 29, 4), ("conv_steps", 300, 8),
                          ("smooth", 20, 3), ("seq_len", 4096, 128)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.small else full)
    if a.precision is None:
        a.precision = "bf16-true" if a.device == "cuda" else "32-true"
    if a.preset is None:
        a.preset = "bench8" if a.device == "cuda" else "tiny"
    if a.conv_model and a.preset != "bench8":
        raise SystemExit("--conv-model overrides the bench8 model; add --preset bench8 (tiny is the main job's model)")
    if a.recipes is None:
        a.recipes = ",".join(FP8_RECIPES if a.preset == "bench8" else BLOCK_RECIPES)
    a.modes = [m.strip() for m in a.mode.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in ("layer", "step", "convergence")]
    if bad:
        raise SystemExit(f"--mode: unknown {bad}; choose from layer, step, convergence")
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in a.shapes if s not in moe_layer.SHAPES]
    if bad:
        raise SystemExit(f"--shapes: unknown {bad}; choose from {list(moe_layer.SHAPES)}")
    a.routing = [s.strip() for s in a.routing.split(",") if s.strip()]
    if not a.routing or any(r not in ("learned", "forced") for r in a.routing):
        raise SystemExit("--routing: learned and/or forced")
    a.layer_recipes = _recipes(a.layer_recipes, ALL_RECIPES, "--layer-recipes", scoped=True)
    a.step_recipes = _recipes(a.step_recipes, ALL_RECIPES, "--step-recipes", scoped=True)
    a.recipes = _recipes(a.recipes, ALL_RECIPES + (REPEAT, NOISE), "--recipes", scoped=True)
    a.profile_recipes = _recipes(a.profile_recipes, ALL_RECIPES, "--profile-recipes", scoped=True)
    a.step_models = _recipes(a.step_models, STEP_MODELS, "--step-models")
    a.step_modes = _recipes(a.step_modes, STEP_MODES, "--step-modes")
    try:
        a.conv_seeds = tuple(dict.fromkeys(int(v) for v in a.conv_seeds.split(",") if v.strip())) \
            if a.conv_seeds else None
    except ValueError:
        raise SystemExit(f"--conv-seeds: comma-separated integers, got {a.conv_seeds!r}") from None
    return a


def environment(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    env = train_step.environment(device)
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001
        env["torchao"] = f"unavailable ({_err(e)})"
    env["date"] = datetime.date.today().isoformat()
    env["torch_threads"] = torch.get_num_threads()
    env["cpu"] = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        env["cpu_count"] = os.cpu_count()
    except (OSError, StopIteration):
        pass
    return env


def plot_from(path: Path) -> int:
    report = json.loads(path.read_text())
    conv = report.get("convergence") or {}
    if not conv.get("runs"):
        log(f"{path}: no convergence runs to plot")
        return 1
    title = f"{conv.get('preset')}, {conv.get('settings', {}).get('precision')}"
    return 0 if save_curves(conv["runs"], path, conv.get("smooth", 20), title,
                            tightest_target(conv.get("summary", []))) else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        return plot_from(Path(args.plot_from))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = train_step.pick_device(args.device)
    if device is None:
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    budget = Budget(args.time_limit)
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "command": " ".join(sys.argv),
                              "env": environment(device, args)}
    log(json.dumps(report["env"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["wall_s"] = time.perf_counter() - budget.t0
        tmp = out.with_name(out.name + ".tmp")  # a call killed while writing keeps the last whole report
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(tmp, out)

    def partial(conv: dict[str, Any]) -> None:  # after each convergence run: what a killed call still leaves
        report["convergence"] = conv
        save()

    modes: list[tuple[str, Callable[..., Any]]] = [("layer", bench_layer), ("step", bench_step),
                                                    ("convergence", lambda a, d, b: bench_convergence(
                                                        a, d, b, _run, UNIT_S[d.type]["convergence"],
                                                        checkpoint=partial))]
    for mode, fn in modes:
        if mode not in args.modes:
            continue
        log(f"\n##### {mode} ({max(0.0, budget.left()):.0f} s left)" if args.time_limit else f"\n##### {mode}")
        try:
            report[mode] = fn(args, device, budget)
        except Exception as e:  # a mode that fails as a whole: report (keeping the runs it finished), go on
            done = report.get(mode) if isinstance(report.get(mode), dict) else {}
            report[mode] = {**done, "error": _err(e), "traceback": traceback.format_exc()}
            log(report[mode]["traceback"])
        save()
    log("\n##### summary")
    if "layer" in report and isinstance(report["layer"], list):
        log("\n".join(layer_lines(r, args) for r in report["layer"]))
    if "step" in report and isinstance(report["step"], list):
        log(step_table(report["step"]))
    if "convergence" in report and "runs" in report["convergence"]:
        log(convergence_table(report["convergence"]))
    save()
    log(f"wrote {out} ({report['wall_s']:.0f} s)")
    return 0
