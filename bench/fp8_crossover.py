#!/usr/bin/env python
"""FP8 crossover sweep (issue 23): for every GEMM shape of every preset and each FP8 recipe, forward + backward time of
the FP8 GEMM *including its quantization* against bf16, over M = 64 .. 16384 (powers of two); writes the table
``lightning_moe/lowp/crossover/<arch>.json`` that ``LowPrecisionTraining(recipe="auto")`` reads (schema:
:mod:`lightning_moe.lowp.crossover`).

Shapes: each preset built on the meta device (:func:`lightning_moe.lowp.crossover.model_gemms`): every dense linear
(attention / MLA projections, dense MLP, shared experts; not the LM head or the shared experts' gate, which always stay
in high precision) and the experts' grouped GEMMs (gate / up ``N=F, K=D``; down ``N=D, K=F``), grouped over the
preset's experts with M rows per expert; at large M the experts are capped so that ``groups * M <= --max-rows``
(recorded per M as ``groups_at``). Identical shapes are measured once (``names`` lists where they occur). Order: the
bench shapes' presets first (Qwen3-30B-A3B, DeepSeek-V3, Mixtral), grouped GEMMs before dense ones, then the other
presets, so a run cut by ``--time-limit`` still has the most informative rows.

What is timed (CUDA events, median of ``--reps`` after ``--warmup``): ``torch.autograd.grad`` of the output with
respect to input and weight, i.e. forward, input gradient and weight gradient, through exactly what training runs:
dense = the module :class:`~lightning_moe.callbacks.LowPrecisionTraining` makes (torchao ``Float8Linear`` for
tensorwise / rowwise, ``BlockScaledLinear`` for blockwise) vs ``nn.Linear`` in bf16; grouped =
:class:`~lightning_moe.callbacks.LowPrecisionGroupedMM` (group padding included) vs ``torch._grouped_mm``. Grouped
GEMMs have no tensorwise variant (the experts run rowwise under ``fp8_tensorwise``).

``--time-limit`` (default 540 s): checked before each (shape, M); the table is rewritten after every shape, so what ran
is always a valid table (``complete`` false, ``not_run`` listing what did not, a cut shape's entries ``partial``).

GPU (one H200, repository root; ~9 minutes or more; prints one line per shape and the table path):
    python -m bench fp8_crossover --time-limit 540
A sweep cut by its time limit resumes from the table it wrote: what it measured completely is kept per (shape,
recipe), the rest is measured. ``--remeasure dense`` measures the dense shapes again (their kernels changed) for the
recipes of ``--recipes`` only and keeps the other recipes' entries, e.g. our fused tensorwise / rowwise linear
without timing torchao's blockwise dense path again (its quantizers autotune over 45 configs per K):
    python -m bench fp8_crossover --merge lightning_moe/lowp/crossover/sm90.json --remeasure dense \
        --recipes fp8_tensorwise,fp8_rowwise --time-limit 540
``not_run`` lists per shape the recipes without a complete entry; ``complete`` is true when it holds no eager one.
CPU smoke test (emulated numerics, toy shapes, a table in /tmp; tests/test_fp8_crossover.py):
    python -m bench fp8_crossover --device cpu --emulate --small --out-dir /tmp/xo
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/fp8_crossover.py ...` runs `python -m bench fp8_crossover ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

_HERE = Path(__file__).resolve().parent

from bench.core.timer import time_steps
from lightning_moe.callbacks.low_precision import (  # noqa: E402
    ALWAYS_KEPT, RECIPES, LowPrecisionGroupedMM, LowPrecisionTraining)
from lightning_moe.lowp.crossover import SCHEMA, Gemm, crossover_m, device_arch, model_gemms  # noqa: E402

DEFAULT_OUT = _HERE.parent / "lightning_moe" / "lowp" / "crossover"
RECIPES_BY_KIND = {"dense": ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"),
                   "grouped": ("fp8_rowwise", "fp8_blockwise")}
FIRST = ("qwen3_moe_30b_a3b", "deepseek_v3", "mixtral_8x7b")  # the bench shapes
# extra model shapes the bench measures: bench/deepseek_v3_step.py's model has 64 experts
EXTRA = {"deepseek_v3_step": ("deepseek_v3", {"moe": {"num_experts": 64, "first_k_dense": 1}, "num_layers": 3})}


def log(*a: Any) -> None:
    print(*a, flush=True)


def shapes(presets: list[str], small: bool) -> list[tuple[Gemm, list[str]]]:
    """Unique (kind, N, K, groups) over the presets, in priority order, with the names where each occurs."""
    from lightning_moe.config import ModelConfig
    from lightning_moe.models.transformer import MoETransformer

    seen: dict[tuple, tuple[Gemm, list[str]]] = {}
    first = [p for p in presets if p in FIRST or p in EXTRA]
    for tier in (first, [p for p in presets if p not in first]):
        models = []
        for p in tier:
            preset, overrides = EXTRA.get(p, (p, {}))
            with torch.device("meta"):
                models.append((p, MoETransformer(ModelConfig.from_preset(preset, **overrides))))
        for grouped_pass in (True, False):
            for p, model in models:
                for g in model_gemms(model):
                    if (g.kind == "grouped") != grouped_pass or g.name.rsplit(".", 1)[-1] in ALWAYS_KEPT:
                        continue
                    key = (g.kind, g.N, g.K, g.groups)
                    label = f"{p}:{_pattern(g.name)}"
                    if key not in seen:
                        seen[key] = (g, [])
                    if label not in seen[key][1]:
                        seen[key][1].append(label)
    return list(seen.values())


def _pattern(name: str) -> str:
    parts = name.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)


def dense_step(recipe: Optional[str], N: int, K: int, M: int, device: torch.device, dtype: torch.dtype,
               emulate: bool, fused: bool = True, compiled: bool = False) -> Callable[[], Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    lin = nn.Linear(K, N, bias=False, device=device, dtype=dtype)
    model = nn.Sequential()
    model.add_module("proj", lin)
    if recipe is not None:
        cb = LowPrecisionTraining(recipe, emulate=emulate, **({} if fused else {"fused_dense": False}))
        cb.device = device
        cb.transform_model(model)
        assert cb.converted == ["proj"], cb.skipped
    x = torch.randn(M, K, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    dy = torch.randn(M, N, device=device, dtype=dtype, generator=gen)
    w = model.proj.weight
    if compiled:
        # every point compiles afresh: the frames of all points share one code object, whose cache would hit dynamo's
        # recompile limit after 8 shapes and silently run the rest eagerly (the first compiled sweep measured that)
        torch.compiler.reset()
    fwd = torch.compile(model, dynamic=False) if compiled else model
    return lambda: torch.autograd.grad(fwd(x), (x, w), dy)


def grouped_step(recipe: Optional[str], N: int, K: int, M: int, groups: int, device: torch.device,
                 dtype: torch.dtype, emulate: bool) -> Callable[[], Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(groups, N, K, device=device, dtype=dtype, generator=gen) * K**-0.5).requires_grad_(True)
    x = torch.randn(groups * M, K, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    dy = torch.randn(groups * M, N, device=device, dtype=dtype, generator=gen)
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * M
    fn = (lambda a, b, o: torch._grouped_mm(a, b, offs=o)) if recipe is None else \
        LowPrecisionGroupedMM(recipe, emulate)
    return lambda: torch.autograd.grad(fn(x, w.transpose(-2, -1), offs), (x, w), dy)


def grouped_blockwise_has_kernels() -> bool:
    """torchao 0.18 runs its blockwise grouped GEMM on DeepGEMM's kernels (the optional ``deep_gemm`` package);
    without it, a dequantizing fallback that is not worth the sweep's time."""
    import importlib.util

    return importlib.util.find_spec("deep_gemm") is not None


def fits(recipe: str, g: Gemm) -> bool:
    align = RECIPES[recipe][1]
    return g.N % align == 0 and g.K % align == 0


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--emulate", action="store_true", help="emulated FP8 numerics (always on CPU)")
    p.add_argument("--small", action="store_true", help="the tiny preset, M 64..256, one rep (CPU smoke test)")
    p.add_argument("--time-limit", type=float, default=540.0, help="seconds for the sweep (what ran is written)")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT), help="the table goes to OUT_DIR/<arch>.json")
    p.add_argument("--presets", default=None, help="comma-separated (default: every preset and the bench models)")
    p.add_argument("--recipes", default="fp8_tensorwise,fp8_rowwise,fp8_blockwise")
    p.add_argument("--m-min", type=int, default=None, help="smallest M (default 64)")
    p.add_argument("--m-max", type=int, default=None, help="largest M (default 16384; 256 with --small)")
    p.add_argument("--reps", type=int, default=None, help="timed reps per point (default 5; 1 with --small)")
    p.add_argument("--warmup", type=int, default=None, help="untimed reps per point (default 2; 1 with --small)")
    p.add_argument("--max-rows", type=int, default=131072, help="grouped: cap on experts x M (memory)")
    p.add_argument("--min-speedup", type=float, default=1.0, help="ratio the crossover M needs from there on")
    p.add_argument("--merge", default=None, metavar="TABLE", help="start from this table: its complete entries are "
                   "kept and not measured again (a sweep cut by --time-limit resumes where it stopped), except those "
                   "of the kinds named by --remeasure whose recipe is in --recipes")
    p.add_argument("--remeasure", default="", help="with --merge: comma-separated kinds (dense, grouped) measured "
                   "again with the recipes of --recipes, e.g. after their kernels changed")
    p.add_argument("--dense-impl", choices=["fused", "torchao"], default="fused", help="dense FP8 linears: ours "
                   "(fused quantization kernels, what eager training runs) or torchao's Float8Linear")
    p.add_argument("--mode", choices=["eager", "compiled"], default="eager", help="compiled: the dense linears "
                   "(only) under torch.compile, bf16 and torchao's Float8Linear alike, as a compiled region of "
                   "MoEParallelStrategy(compile=True) runs them (one compile per shape, M and recipe: use with "
                   "--m-min 1024 or so); entries are marked with the mode, and merge with an eager table")
    p.add_argument("--grouped-blockwise-fallback", action="store_true", help="time torchao's blockwise grouped GEMM "
                   "even without DeepGEMM (its dequantizing fallback; skipped by default on CUDA)")
    args = p.parse_args(argv)
    args.m_min = args.m_min or 64
    args.m_max = args.m_max or (256 if args.small else 16384)
    args.reps = args.reps or (1 if args.small else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 2)
    if args.m_min <= 0 or args.m_max < args.m_min or args.m_min & (args.m_min - 1) or args.m_max & (args.m_max - 1):
        raise SystemExit("--m-min / --m-max: powers of two with m-min <= m-max")
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in args.recipes if r not in RECIPES_BY_KIND["dense"]]
    if bad:
        raise SystemExit(f"--recipes: unknown {bad}; choose from {list(RECIPES_BY_KIND['dense'])}")
    from lightning_moe.config import preset_names

    if args.presets:
        args.presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    elif args.small:
        args.presets = ["tiny"]
    else:
        rest = [p for p in preset_names() if p not in FIRST and p != "tiny"]
        args.presets = [*FIRST, *EXTRA, *rest]
    unknown = [p for p in args.presets if p not in preset_names() and p not in EXTRA]
    if unknown:
        raise SystemExit(f"--presets: unknown {unknown}; choose from {preset_names() + list(EXTRA)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --emulate for the smoke test)")
    args.emulate = args.emulate or args.device == "cpu"
    args.remeasure = [k.strip() for k in args.remeasure.split(",") if k.strip()]
    if any(k not in ("dense", "grouped") for k in args.remeasure) or (args.remeasure and not args.merge):
        raise SystemExit("--remeasure: kinds dense and/or grouped, with --merge TABLE")
    if args.merge and not Path(args.merge).is_file():
        raise SystemExit(f"--merge {args.merge}: no such table")
    return args


def shape_key(e: dict[str, Any]) -> tuple:
    return (e["kind"], e["N"], e["K"], e["groups"], e.get("mode", "eager"))


def gemm_key(g: Gemm, mode: str) -> tuple:
    """:func:`shape_key` of the entries ``g`` gets when measured in ``mode``."""
    return (g.kind, g.N, g.K, g.groups, mode)


def merged_entries(path: str, remeasure: list[str], recipes: list[str]) -> tuple[
        list[dict[str, Any]], set[tuple], dict[str, Any], list[dict[str, Any]]]:
    """The entries of a table to keep, the (shape, recipe) pairs they measured completely (not measured again), a
    record of where they came from, and its "not run" records. Dropped: entries cut by a time limit, and those of a
    ``remeasure`` kind whose recipe is in ``recipes`` (a sweep of some recipes keeps the other recipes' entries)."""
    prior = json.loads(Path(path).read_text())
    if prior.get("schema") != SCHEMA:
        raise SystemExit(f"--merge {path}: schema {prior.get('schema')}, this sweep writes {SCHEMA}")
    # tables before per-recipe records marked a cut shape in not_run (every recipe of it partial)
    cut = {(shape_key(n), r) for n in prior.get("not_run", []) if n.get("partial")
           for r in n.get("recipes", RECIPES_BY_KIND[n["kind"]])}
    keep = [e for e in prior["entries"] if not e.get("partial") and (shape_key(e), e["recipe"]) not in cut
            and not (e["kind"] in remeasure and e["recipe"] in recipes)]
    source = {k: prior.get(k) for k in ("command", "date", "torch", "torchao", "gpu")}
    source["entries_kept"] = len(keep)
    # every sweep the kept entries came from, oldest first (the header's command, m_grid and presets are this sweep's)
    prior_from = prior.get("merged_from") or {}
    older = prior_from.get("history") or (
        [{k: v for k, v in prior_from.items() if k != "history"}] if prior_from else [])
    source["history"] = [*older, {k: v for k, v in source.items() if k != "entries_kept"}]
    return keep, {(shape_key(e), e["recipe"]) for e in keep}, source, list(prior.get("not_run", []))


def not_run(todo: list[tuple[Gemm, list[str]]], entries: list[dict[str, Any]], mode: str,
            fitting: Callable[[Gemm], list[str]]) -> list[dict[str, Any]]:
    """One record per shape of ``todo`` with a fitting recipe that has no complete entry: which recipes are missing
    and whether a time limit cut one (``partial``: its entry holds the Ms that ran)."""
    complete = {(shape_key(e), e["recipe"]) for e in entries if not e.get("partial")}
    cut = {(shape_key(e), e["recipe"]) for e in entries if e.get("partial")}
    out = []
    for g, names in todo:
        key = gemm_key(g, mode)
        missing = [r for r in fitting(g) if (key, r) not in complete]
        if missing:
            out.append({"kind": g.kind, "N": g.N, "K": g.K, "groups": g.groups, "names": names, "mode": mode,
                        "recipes": missing, "partial": any((key, r) in cut for r in missing)})
    return out


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__}
    try:
        import torchao

        out["torchao"] = torchao.__version__
    except ImportError:
        out["torchao"] = None
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch = device_arch(device)
    m_grid = [2**i for i in range(int(math.log2(args.m_min)), int(math.log2(args.m_max)) + 1)]
    out = Path(args.out_dir) / f"{arch}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = shapes(args.presets, args.small)
    compiled = args.mode == "compiled"
    if compiled:  # the experts run eagerly under MoEParallelStrategy(compile=True): only dense linears compile
        todo = [(g, names) for g, names in todo if g.kind == "dense"]
    skip_grouped_blockwise = (device.type == "cuda" and not args.emulate and not grouped_blockwise_has_kernels()
                              and not args.grouped_blockwise_fallback)
    if skip_grouped_blockwise:
        log("grouped fp8_blockwise: not timed (no deep_gemm: torchao's fallback dequantizes; "
            "--grouped-blockwise-fallback times it anyway)")

    def fitting(g: Gemm) -> list[str]:  # the recipes a complete table holds for g
        return [r for r in RECIPES_BY_KIND[g.kind] if fits(r, g)
                and not (skip_grouped_blockwise and g.kind == "grouped" and r == "fp8_blockwise")]

    table: dict[str, Any] = {
        "schema": SCHEMA, "arch": arch, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **versions(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", "bench", "fp8_crossover", *argv]), "emulate": args.emulate,
        "dtype": str(dtype).removeprefix("torch."), "reps": args.reps, "warmup": args.warmup,
        "max_rows": args.max_rows, "min_speedup": args.min_speedup, "m_grid": m_grid, "presets": args.presets,
        "recipes": args.recipes, "entries": [], "complete": False, "not_run": [], "errors": [],
        "dense_impl": args.dense_impl, "grouped_blockwise_timed": not skip_grouped_blockwise}
    done: set[tuple] = set()
    other_modes: list[dict[str, Any]] = []  # not-run records of the other mode: this sweep does not measure them
    if args.merge:
        table["entries"], done, table["merged_from"], prior_not_run = merged_entries(
            args.merge, args.remeasure, args.recipes)
        other_modes = [n for n in prior_not_run if n.get("mode", "eager") != args.mode]
        log(f"--merge {args.merge}: {len(table['entries'])} entries kept"
            + (f"; measuring {args.remeasure} {args.recipes} again" if args.remeasure else ""))

    def save() -> None:
        table["not_run"] = other_modes + not_run(todo, table["entries"], args.mode, fitting)
        # complete: every shape measured eagerly with every recipe (a compiled sweep covers what it is asked to)
        table["complete"] = not [n for n in table["not_run"] if n.get("mode", "eager") == "eager"]
        table["elapsed_s"] = round(time.perf_counter() - t0, 1)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, out)

    def recipes_todo(g: Gemm) -> list[str]:
        key = gemm_key(g, args.mode)
        return [r for r in fitting(g) if r in args.recipes and (key, r) not in done]

    n_todo = sum(1 for g, _ in todo if recipes_todo(g))
    log(f"fp8 crossover on {table['gpu']} ({arch}), torch {table['torch']}, torchao {table['torchao']}: "
        f"{n_todo} shapes x M {m_grid[0]}..{m_grid[-1]}, recipes {args.recipes}, time limit {args.time_limit:.0f} s")
    point_s = 0.5  # seconds one (shape, M) took last: the budget check before the next
    stopped = False
    for g, names in todo:
        recipes = recipes_todo(g)
        label = f"{g.kind} N={g.N} K={g.K} E={g.groups}"
        if not fitting(g):
            log(f"{label}: no recipe fits these dims")
        if stopped or not recipes:
            continue
        t_shape = time.perf_counter()
        entries = {r: {"kind": g.kind, "N": g.N, "K": g.K, "groups": g.groups, "recipe": r, "names": names,
                       "ratios": {}, "bf16_ms": {}, "fp8_ms": {}, "groups_at": {}, "mode": args.mode,
                       "dense_impl": None if g.kind == "grouped" else
                       ("torchao" if compiled else args.dense_impl)} for r in recipes}
        for M in m_grid:
            left = args.time_limit - (time.perf_counter() - t0)
            if left < 2 * point_s + 1.0:
                stopped = True
                log(f"time limit: stopping at {label} M={M} ({left:.0f} s left)")
                break
            t_point = time.perf_counter()
            groups = max(1, min(g.groups, args.max_rows // M)) if g.kind == "grouped" else 1
            try:
                def step(recipe: Optional[str]) -> Callable[[], Any]:
                    if g.kind == "dense":
                        return dense_step(recipe, g.N, g.K, M, device, dtype, args.emulate,
                                          args.dense_impl == "fused" and not compiled, compiled)
                    return grouped_step(recipe, g.N, g.K, M, groups, device, dtype, args.emulate)

                base = time_steps(step(None), device, args.warmup, args.reps)["ms"]
                for r in recipes:
                    try:
                        ms = time_steps(step(r), device, args.warmup, args.reps)["ms"]
                    except Exception as e:  # noqa: BLE001 - a recipe that fails at a shape is recorded
                        table["errors"].append(f"{label} M={M} {r}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    e_ = entries[r]
                    e_["bf16_ms"][str(M)], e_["fp8_ms"][str(M)] = round(base, 4), round(ms, 4)
                    e_["ratios"][str(M)] = round(base / ms, 4)
                    if g.kind == "grouped":
                        e_["groups_at"][str(M)] = groups
            except Exception as e:  # noqa: BLE001 - out of memory, a kernel that refuses the shape: record, go on
                table["errors"].append(f"{label} M={M}: {type(e).__name__}: {str(e)[:200]}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            point_s = time.perf_counter() - t_point
        for e_ in entries.values():
            e_["crossover_m"] = crossover_m({int(k): v for k, v in e_["ratios"].items()}, args.min_speedup)
            if stopped:
                e_["partial"] = True  # the Ms that ran; a --merge sweep measures the shape again
            if e_["ratios"]:
                table["entries"].append(e_)
        log(f"{label} [{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}] "
            f"{time.perf_counter() - t_shape:.0f} s: "
            + "; ".join(f"{r} x{entries[r]['crossover_m'] or '-'} "
                        f"({' '.join(format(v, '.2f') for v in entries[r]['ratios'].values())})" for r in recipes))
        save()
    save()
    log(f"wrote {out}: {len(table['entries'])} entries, complete={table['complete']}, "
        f"{len(table['errors'])} errors, {table['elapsed_s']:.0f} s")
    missing: dict[str, int] = {}
    for n in table["not_run"]:
        for r in n.get("recipes", ["all"]):
            missing[f"{n['kind']} {r}"] = missing.get(f"{n['kind']} {r}", 0) + 1
    if missing:
        log("not run (shapes): " + ", ".join(f"{k} {v}" for k, v in sorted(missing.items())))
    for err in table["errors"][:20]:
        log(f"  error: {err}")
    return 0
