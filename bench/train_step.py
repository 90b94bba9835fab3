#!/usr/bin/env python
"""Full training-step benchmark on one device: lightning_moe vs Hugging Face ``transformers`` (DESIGN "Benchmarks").
One piece (about 510 lines): its run, timer and profiler callbacks are what the other step benchmarks reuse.

What it does, in order (each part guarded: a failure is reported in the table and the JSON, the rest still runs):

0. Measures the dense bf16 matmul rate (8192^3 on CUDA; a small fp32 matmul on CPU, only so the MFU column is
   not empty) as the MFU denominator.
1. ``tiny`` preset: 20 steps of ``MoELanguageModel("tiny")`` on ``TextDataModule(seq_len=256)`` through the
   Lightning Trainer; checks the per-step ``train_loss`` is finite and falling.
2. 8-layer Qwen3-30B-A3B-shaped model (vocab 151936, D 2048, 128 experts top-8, F 768, qk-norm), batch 4 x 4096
   tokens, bf16-true, through the Lightning Trainer: per-step loss (finite, falling), step times after a warmup
   (``torch.cuda.synchronize`` + ``perf_counter`` in ``on_train_batch_start`` / ``on_train_batch_end``, i.e.
   forward + backward + optimizer step, the batch already on the device), tokens/s, peak memory, MFU.
3. The same shapes as ``transformers.Qwen3MoeForCausalLM`` (sdpa attention) trained in a plain PyTorch loop
   (fused AdamW, same hyper-parameters and LR schedule, the same batches in the same order, ``labels=input_ids``),
   timed the same way; once with the default experts implementation and once with ``grouped_mm`` when that is
   not already the default (``--hf-impls``). Only one model is alive at a time.
4. A table and a JSON file (``--out``).

MFU convention: ``bench.core.flops`` (model FLOPs, the same numerator for both implementations).

Run (repository root):
    python -m bench train_step                                   # the GPU benchmark (H200: a few minutes)
    python -m bench train_step --device cpu --small --steps 4 --warmup 1   # smoke test of the whole suite
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/train_step.py ...` runs `python -m bench train_step ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import dataclasses
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench.core.device import allocated_gib, build_on, peak_gib, pick_device, reset_memory
from bench.core.env import environment
from bench.core.flops import flops_per_token, measure_matmul_peak, timing_summary
from bench.core.kernel_profile import kernel_categories
from bench.core.schema import save as save_result
from bench.core.text import err as _err, fmt as _fmt, log, md_table
from bench.core.timer import StepTimer, Stopwatch, fit_phases, loss_checks, phases_line
from bench.peers.hf import plain_optimizer as hf_optimizer, qwen3_config as hf_config

DEFAULT_OUT = "bench/results/train_step.json"


def cycle(loader: Any) -> Any:
    """The loader's batches epoch after epoch (a plain loop's view of Lightning's repeated epochs)."""
    while True:
        yield from loader


def _ours_impl(model: Any, variant: str) -> str:
    """``lightning_moe`` and how its experts ran: one grouped GEMM, a loop, or (unaligned shapes) a loop fallback."""
    experts = [blk.moe.experts for blk in model.model.layers.values() if blk.is_moe]
    gm = sorted({bool(getattr(e, "use_grouped_mm", False)) for e in experts})
    impl = "lightning_moe " + ("grouped_mm" if gm == [True] else "loop" if gm == [False] else "mixed")
    if variant:
        impl += f" [{variant}]"
    if any(getattr(e, "_warned_unaligned", False) for e in experts):
        impl += " (unaligned->loop)"
    return impl


# ----------------------------------------------------------------------------------------- lightning_moe runs
def run_ours(label: str, cfg: Any, seq_len: int, batch_size: int, args: argparse.Namespace, lr: float,
             device: torch.device, peak: Optional[dict], timed: bool, strategy: Any = None,
             extra_callbacks: tuple = (), variant: str = "", logger: Any = False,
             module_kwargs: Optional[dict[str, Any]] = None, trainer_kwargs: Optional[dict[str, Any]] = None,
             data_kwargs: Optional[dict[str, Any]] = None, seed: int = 0,
             module: Optional[Callable[[], Any]] = None, deadline: Optional[float] = None) -> dict[str, Any]:
    """Train ``cfg`` through the Lightning Trainer and time it; ``strategy`` (default: Lightning's single-device
    strategy), ``extra_callbacks`` and ``logger`` (default: none) let other benchmarks (memory options, the routing
    monitor, the multi-GPU scaling) reuse the run. ``variant`` (see ``--ours-variants``): ``loss_impl`` name, optionally
    ``+compile`` (regional torch.compile through a one-device MoEParallelStrategy). ``module_kwargs`` /
    ``trainer_kwargs`` / ``data_kwargs`` override the ``MoELanguageModel`` / ``Trainer`` / ``TextDataModule`` arguments
    (e.g. the schedule, gradient clipping, ``max_time``); ``seed`` seeds the initialisation (``L.seed_everything``).
    ``module``: a factory of another LightningModule to train instead of ``MoELanguageModel(cfg)`` (``bench/scale.py``'s
    transformers peer); the caller then sets its ``impl``. ``deadline`` (a ``perf_counter()`` value, a suite's
    ``--time-limit``): fit stops after the first step that ends past it."""
    import lightning as L

    from lightning_moe.data import TextDataModule
    from lightning_moe.module import MoELanguageModel

    res: dict[str, Any] = {"model": label, "impl": "lightning_moe" if module is None else "other", "seq_len": seq_len,
                           "batch_size": batch_size, "steps": args.steps, "lr": lr}
    log(f"\n=== {label}: {'lightning_moe' if module is None else 'peer'}, {args.steps} steps, "
        f"batch {batch_size} x {seq_len} ===")
    L.seed_everything(seed, verbose=False)
    reset_memory(device)
    t_start = time.perf_counter()
    rec = StepTimer(device, deadline=deadline)
    model = trainer = dm = None
    try:
        dm = TextDataModule(**{"seq_len": seq_len, "batch_size": batch_size, **(data_kwargs or {})})
        loss_impl, extras = parse_variant(variant or getattr(args, "loss_impl", "auto"))
        if "compile" in extras:
            from lightning_moe.strategies import MoEParallelStrategy

            strategy = MoEParallelStrategy(compile=True)
        if module is not None:
            model = module()
        else:
            model = MoELanguageModel(cfg, **{"lr": lr, "warmup_steps": 2, "max_steps": args.steps,
                                             "loss_impl": loss_impl, "master_dtype": "fp32" if "master" in extras
                                             else None, **(module_kwargs or {})})
        trainer = L.Trainer(**{
            "accelerator": "gpu" if device.type == "cuda" else "cpu",
            "devices": 1,
            "strategy": strategy if strategy is not None else single_device_strategy(device),
            "precision": args.precision,
            "max_steps": args.steps,
            "logger": logger,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "callbacks": [rec, *extra_callbacks],
            **(trainer_kwargs or {}),
        })
        prof = None
        if getattr(args, "profile", False) and timed and not getattr(args, "_profiled", False):
            args._profiled = True  # the first timed run only
            trace = Path(args.out).with_suffix(".trace.json") if getattr(args, "profile_trace", True) else None
            prof = step_profiler(args.warmup, 3, trace)
            trainer.callbacks.append(prof)
        trainer.fit(model, datamodule=dm)
        if prof is not None:
            prof.finish()  # a run shorter than the window
            res["profile_top"], res["profile_categories_ms"] = prof.table, prof.categories
        if module is None:
            res["impl"] = _ours_impl(model, variant)
        res["param_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    except Exception as e:  # report, don't crash: the other runs still go
        res["error"] = _err(e)
        res["traceback"] = traceback.format_exc()
        log(res["traceback"])
    t_end = time.perf_counter()
    res["wall_s"] = t_end - t_start
    res["phases_s"] = fit_phases(rec, t_start, t_end)
    res["losses"] = rec.losses
    res["step_times_s"] = rec.times
    res["first_batch_checksum"] = rec.first_batch_checksum
    if rec.stopped_after is not None:
        res["stopped_by_time_limit_after_steps"] = rec.stopped_after
    res["peak_gib"] = peak_gib(device)
    res.update(loss_checks(rec.losses))
    if "error" in res:
        res["ok"] = False
    if rec.losses:
        res["loss_first"], res["loss_last"] = rec.losses[0], rec.losses[-1]
    if timed:
        res["flops"] = flops_per_token(cfg, seq_len)
        res.update(timing_summary(rec.times, args.warmup, batch_size * seq_len, res["flops"], peak))
    # free everything before the next model: the datamodule and the module point back at the trainer
    if dm is not None:
        dm.trainer = None
    del model, trainer, dm, rec
    reset_memory(device)
    res["phases_s"]["free"] = time.perf_counter() - t_end  # the bookkeeping above and the memory's release
    res["allocated_after_free_gib"] = allocated_gib(device)
    log(_summary_line(res))
    log(phases_line(res["phases_s"]))
    return res


def single_device_strategy(device: torch.device) -> Any:
    """Lightning's one-device strategy (what ``strategy="auto"`` picks for one device) without its teardown's move of
    the model and the optimizer state to the CPU: each run's model is dropped after its fit, so the move only costs
    time (about 14 bytes a parameter with fp32 masters, some 80 GB for bench8: the likely share of the 56-91 s that
    each bench8 run on the H200 spent outside its steps which grows with the model; ``phases_s`` records it).
    Training is unchanged."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class KeepOnDevice(SingleDeviceStrategy):
        def teardown(self) -> None:
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()

    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return KeepOnDevice(device=device)


VARIANT_SUFFIXES = ("compile", "master")


def parse_variant(variant: str) -> tuple[str, set[str]]:
    """``loss_impl[+compile][+master]`` -> (loss_impl, suffixes): ``+compile`` regional torch.compile through a
    one-device MoEParallelStrategy, ``+master`` fp32 master weights and moments (``MoELanguageModel(master_dtype=
    "fp32")``). ValueError for an unknown loss_impl or suffix."""
    from lightning_moe.models.lm_loss import LOSS_IMPLS

    loss_impl, *extras = variant.split("+")
    bad = [e for e in extras if e not in VARIANT_SUFFIXES]
    if (loss_impl and loss_impl not in LOSS_IMPLS) or bad:
        raise ValueError(f"variant {variant!r}: expected a loss_impl of {LOSS_IMPLS} optionally followed by "
                         f"{' / '.join('+' + e for e in VARIANT_SUFFIXES)}")
    return loss_impl or "auto", set(extras)


def step_profiler(start: int, n: int, trace: Optional[Path],
                  on_trace: Optional[Callable[[Path, int], Any]] = None) -> Any:
    """A Lightning callback running torch.profiler over ``n`` optimizer steps from step ``start``: prints the top
    kernels by self time (kept in ``.table``), keeps the device time per step by kernel category (``.categories``,
    ms; CUDA) and writes a Chrome trace (unless ``trace`` is None); ``on_trace(trace, steps)`` then reads it (its
    result kept in ``.analysis``). ``finish()`` closes a window that training ended inside (fewer steps)."""
    import lightning as L

    class StepProfiler(L.Callback):
        def __init__(self) -> None:
            self.prof: Any = None
            self.table = ""
            self.steps = 0  # optimizer steps inside the window
            self.analysis: Any = None
            self.categories: dict[str, float] = {}

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == start:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                self.prof = profile(activities=acts)
                self.prof.__enter__()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if self.prof is not None:
                self.steps += 1
                if trainer.global_step == start + n:
                    self.finish()

        def finish(self) -> None:
            if self.prof is None:
                return
            self.prof.__exit__(None, None, None)
            key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            try:
                self.table = self.prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
                log(f"\nprofile of {self.steps} steps (from step {start}):\n{self.table}")
                if torch.cuda.is_available() and self.steps:
                    self.categories = kernel_categories(self.prof, self.steps)
                    log("device ms per step by kernel category: "
                        + "  ".join(f"{k} {v:.2f}" for k, v in self.categories.items()))
                if trace is not None:
                    self.prof.export_chrome_trace(str(trace))
                if on_trace is not None and trace is not None:
                    self.analysis = on_trace(trace, self.steps)
            except Exception as e:  # reported, never a failed training run
                log(f"profile table, trace export or analysis failed: {_err(e)}")
                self.analysis = {"error": _err(e)}
            self.prof = None

    return StepProfiler()


# ------------------------------------------------------------------------------------------ transformers run
def run_hf(label: str, cfg: Any, seq_len: int, batch_size: int, args: argparse.Namespace, lr: float,
           device: torch.device, peak: Optional[dict], impl: str, dtype: torch.dtype) -> dict[str, Any]:
    from lightning_moe.data import TextDataModule

    res: dict[str, Any] = {"model": label, "impl": f"hf {impl}", "requested_experts_impl": impl, "seq_len": seq_len,
                           "batch_size": batch_size, "steps": args.steps, "lr": lr}
    log(f"\n=== {label}: transformers Qwen3MoeForCausalLM (experts: {impl}), {args.steps} steps ===")
    losses: list[float] = []
    times: list[float] = []
    model = opt = sched = None
    t_start = time.perf_counter()
    torch.manual_seed(0)
    reset_memory(device)
    res["allocated_before_gib"] = allocated_gib(device)
    try:
        import transformers
        from transformers import Qwen3MoeForCausalLM

        res["transformers"] = transformers.__version__
        hcfg = hf_config(cfg, impl)
        model = build_on(Qwen3MoeForCausalLM, hcfg, device, dtype)
        model.to(device=device, dtype=dtype)
        model.train()
        res["build_s"] = time.perf_counter() - t_start
        res["experts_impl"] = str(getattr(model.config, "_experts_implementation", "n/a (no experts interface)"))
        res["attn_impl"] = str(getattr(model.config, "_attn_implementation", "?"))
        res["impl"] = f"hf {res['experts_impl']}" + (" (default)" if impl == "default" else "")
        if impl != "default" and res["experts_impl"] != impl:
            res["impl"] += f" (asked {impl})"
        n_params = sum(p.numel() for p in model.parameters())
        res["hf_params_total"] = n_params
        res["params_match_config"] = n_params == cfg.count_params()["total"]
        if not res["params_match_config"]:
            log(f"WARNING: HF model has {n_params} parameters, ModelConfig.count_params() says "
                f"{cfg.count_params()['total']}: the shapes differ")
        log(f"built in {res['build_s']:.1f}s: {n_params / 1e9:.3f}B params, experts={res['experts_impl']}, "
            f"attn={res['attn_impl']}")

        opt, sched = hf_optimizer(model, lr, args.steps, device)

        # the same batches in the same order as the Lightning run (its sampler is seeded, epoch 0)
        dm = TextDataModule(seq_len=seq_len, batch_size=batch_size)
        dm.setup("fit")
        loader = dm.train_dataloader()
        it = cycle(loader)
        coef = hcfg.router_aux_loss_coef
        for step in range(args.steps):
            batch = next(it)
            if step == 0:
                res["first_batch_checksum"] = int(batch["input_ids"].sum())
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            with Stopwatch(device) as watch:
                out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
                out.loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                aux = getattr(out, "aux_loss", None)
                lm_loss = out.loss.detach() - (coef * aux.detach() if aux is not None else 0.0)
            times.append(watch.seconds)
            losses.append(float(lm_loss))
            del out, aux, lm_loss
            if step == 0 or step == args.steps - 1 or args.steps <= 10:
                log(f"  step {step}: loss {losses[-1]:.4f} ({times[-1]:.3f}s)")
        del dm, loader, it, batch, input_ids
    except Exception as e:
        res["error"] = _err(e)
        res["traceback"] = traceback.format_exc()
        log(res["traceback"])
    res["wall_s"] = time.perf_counter() - t_start
    res["losses"] = losses
    res["step_times_s"] = times
    res["peak_gib"] = peak_gib(device)
    res.update(loss_checks(losses))
    if "error" in res:
        res["ok"] = False
    if losses:
        res["loss_first"], res["loss_last"] = losses[0], losses[-1]
    res["flops"] = flops_per_token(cfg, seq_len)
    res.update(timing_summary(times, args.warmup, batch_size * seq_len, res["flops"], peak))
    del model, opt, sched
    reset_memory(device)
    res["allocated_after_free_gib"] = allocated_gib(device)
    log(_summary_line(res))
    return res


# ---------------------------------------------------------------------------------------------------- report
def _summary_line(r: dict[str, Any]) -> str:
    s = (f"[{r['model']} | {r['impl']}] tokens/s {_fmt(r.get('tokens_per_s'), ',.0f')}  "
         f"peak {_fmt(r.get('peak_gib'), '.2f')} GiB  MFU {_fmt(r.get('mfu'), '.1%')}  "
         f"loss {_fmt(r.get('loss_first'), '.4f')} -> {_fmt(r.get('loss_last'), '.4f')}  ok={r.get('ok')}")
    if r.get("error"):
        s += f"  ERROR {r['error']}"
    return s


def print_table(results: list[dict[str, Any]]) -> str:
    head = ["model", "impl", "tokens/s", "peak GiB", "MFU", "loss first -> last", "ok"]
    rows = []
    for r in results:
        ok = "yes" if r.get("ok") else ("FAIL: " + r["error"][:120] if r.get("error") else "NO (" + _why(r) + ")")
        rows.append([
            r["model"], r["impl"], _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("peak_gib"), ".1f"),
            _fmt(r.get("mfu"), ".1%"),
            f"{_fmt(r.get('loss_first'), '.3f')} -> {_fmt(r.get('loss_last'), '.3f')}", ok,
        ])
    return md_table(head, rows)


def _why(r: dict[str, Any]) -> str:
    if not r.get("finite", True):
        return "non-finite loss"
    if not r.get("falling", True):
        return "loss not falling"
    return "?"


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    ours = [r for r in results if r["impl"].startswith("lightning_moe") and r.get("tokens_per_s") and r.get("timed")]
    for o in ours:
        for h in results:
            if h["model"] == o["model"] and h["impl"].startswith("hf") and h.get("tokens_per_s"):
                out.append({"model": o["model"], "ours": o["impl"], "hf": h["impl"],
                            "tokens_per_s_ratio": o["tokens_per_s"] / h["tokens_per_s"],
                            "same_first_batch": o.get("first_batch_checksum") == h.get("first_batch_checksum")})
    return out


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each timed run")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (128 with --small)")
    p.add_argument("--batch-size", type=int, default=None, help="default 4")
    p.add_argument("--layers", type=int, default=None, help="default 8 (2 with --small)")
    p.add_argument("--lr", type=float, default=3e-4, help="lr of the Qwen-shaped runs (ours and HF)")
    p.add_argument("--tiny-lr", type=float, default=3e-3)
    p.add_argument("--tiny-batch-size", type=int, default=16)
    p.add_argument("--precision", default=None, help="Lightning precision; default bf16-true (cuda), 32-true (cpu)")
    p.add_argument("--hf-impls", default="default,grouped_mm",
                   help="comma list of experts implementations for the HF runs ('default' = what transformers "
                        "picks); duplicates of the default are skipped")
    p.add_argument("--ours-variants", default="",
                   help="comma-separated runs of ours, each a loss_impl (auto, torch, chunked, liger) optionally "
                        "with +compile and/or +master (fp32 master weights and moments), e.g. "
                        "'torch,auto,auto+compile,auto+compile+master'; default: one run with --loss-impl")
    p.add_argument("--loss-impl", default="auto", help="MoELanguageModel(loss_impl=...) of the default run")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over 3 steps of the first timed run of ours: top kernels + a Chrome trace")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--skip-ours", action="store_true", help="skip the lightning_moe Qwen-shaped run")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true",
                   help="shrink the Qwen-shaped model (D 256, 8 experts top-2, F 128, vocab 1024, 2 layers, seq 128) "
                        "to test the script on CPU")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 128 if args.small else 4096
    if args.batch_size is None:
        args.batch_size = 4
    if args.layers is None:
        args.layers = 2 if args.small else 8
    if args.precision is None:
        args.precision = "bf16-true" if args.device == "cuda" else "32-true"
    return args


def qwen_config(args: argparse.Namespace) -> Any:
    from lightning_moe.config import ModelConfig

    if args.small:
        return ModelConfig.from_preset(
            "qwen3_moe_30b_a3b", num_layers=args.layers, vocab_size=1024, hidden_size=256, num_heads=4,
            num_kv_heads=2, head_dim=64, dense_hidden_size=512, max_seq_len=max(args.seq_len, 512),
            moe={"num_experts": 8, "top_k": 2, "expert_hidden_size": 128},
        )
    return ModelConfig.from_preset("qwen3_moe_30b_a3b", num_layers=args.layers)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    if device is None:
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    t_all = time.perf_counter()
    report: dict[str, Any] = {"args": vars(args), "env": environment(device), "runs": []}
    log(json.dumps(report["env"]))

    peak = None
    try:
        peak = measure_matmul_peak(device)
        log(f"matmul peak: {peak['n']}^3 {peak['dtype']}: {peak['flops_per_s'] / 1e12:.1f} TFLOP/s")
    except Exception as e:
        log(f"matmul peak measurement failed: {_err(e)}")
        report["matmul_peak_error"] = _err(e)
    report["matmul_peak"] = peak

    runs: list[dict[str, Any]] = report["runs"]

    def save() -> None:
        report["ratios"] = ratios(runs)
        report["total_wall_s"] = time.perf_counter() - t_all
        save_result(args.out, report, "train_step")

    if not args.skip_tiny:
        from lightning_moe.config import ModelConfig

        r = run_ours("tiny", ModelConfig.from_preset("tiny"), 256, args.tiny_batch_size, args, args.tiny_lr,
                     device, peak, timed=False)
        runs.append(r)
        save()

    cfg = None
    try:
        cfg = qwen_config(args)
    except Exception as e:
        runs.append({"model": "qwen3-moe", "impl": "config", "error": _err(e), "ok": False})
    if cfg is not None:
        label = f"qwen3-30b-a3b-{cfg.num_layers}L" + ("-small" if args.small else "")
        fpt = flops_per_token(cfg, args.seq_len)
        report["qwen_config"] = dataclasses.asdict(cfg)
        report["qwen_flops"] = fpt
        log(f"\n{label}: {fpt['params_total'] / 1e9:.3f}B params, {fpt['params_active'] / 1e9:.3f}B active "
            f"({fpt['params_active_matmul'] / 1e9:.3f}B in matmuls), {fpt['flops_per_token'] / 1e9:.2f} GFLOP/token")
        if not args.skip_ours:
            for variant in [v.strip() for v in args.ours_variants.split(",") if v.strip()] or [""]:
                r = run_ours(label, cfg, args.seq_len, args.batch_size, args, args.lr, device, peak, timed=True,
                             variant=variant)
                r["timed"] = True
                runs.append(r)
                save()
        if not args.skip_hf:
            dtype = torch.bfloat16 if "bf16" in args.precision else torch.float32
            impls = [s.strip() for s in args.hf_impls.split(",") if s.strip()]
            done: set[str] = set()
            for impl in impls:
                if impl != "default" and impl in done:
                    log(f"\n(skipping HF experts implementation {impl!r}: it is the default, already run)")
                    continue
                r = run_hf(label, cfg, args.seq_len, args.batch_size, args, args.lr, device, peak, impl, dtype)
                done.add(r.get("experts_impl", impl))
                runs.append(r)
                save()

    save()
    log("\n" + "=" * 100)
    if peak:
        log(f"matmul peak {peak['n']}^3 {peak['dtype']}: {peak['flops_per_s'] / 1e12:.1f} TFLOP/s "
            f"(MFU denominator); MFU numerator: 6*N_active(matmul) + 12*L*H*K*S per token")
    log(print_table(runs))
    for q in report["ratios"]:
        log(f"ours/HF tokens/s [{q['model']}] {q['ours']} vs {q['hf']}: {q['tokens_per_s_ratio']:.2f}x"
            + ("" if q["same_first_batch"] else "  (WARNING: the runs saw different first batches)"))
    log(f"total wall time {report['total_wall_s']:.0f}s; results in {args.out}")
    return 0 if all(r.get("ok") for r in runs) else 1
