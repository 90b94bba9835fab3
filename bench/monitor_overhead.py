#!/usr/bin/env python
"""Step-time overhead of LoadBalanceMonitor on the training step (issue 9; target: under 1%).

The 8-layer Qwen3-30B-A3B-shaped model of ``bench/train_step.py`` (its ``run_ours``: Lightning Trainer, bf16-true,
batch 4 x 4096, per-batch wall times after a warmup) is trained ``--pairs`` times without and with
``LoadBalanceMonitor(log_every_n_steps=--log-every, heatmap=True, jsonl_path=...)``, alternating the order
(off, on), (on, off), ... so drift cancels. Both arms get the same logger (``--logger``: a W&B offline run when
wandb and pillow are installed, so the heatmap image and histograms are really built; else CSV). The timed steps
include the monitor's log steps (one in every ``--log-every``). Prints the step-time ratio (with / without) and
writes JSON (``--out``).

Run (repository root):
    python -m bench monitor_overhead --out bench/results/monitor_overhead_h200.json          # H200, a few minutes
    python -m bench monitor_overhead --device cpu --small --steps 6 --warmup 1 --log-every 2 --pairs 1 \\
        --out /tmp/monitor_overhead_cpu.json                                                  # smoke test
Other options (``--steps``, ``--warmup``, ``--seq-len``, ``--batch-size``, ``--layers``, ``--precision``, ...) are
``bench/train_step.py``'s.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/monitor_overhead.py ...` runs `python -m bench monitor_overhead ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from bench import train_step
from bench.core.schema import save as save_result


def _logger_factory(kind: str, root: str) -> Any:
    def make() -> Any:
        if kind == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            return WandbLogger(offline=True, save_dir=root, project="monitor_overhead")
        if kind == "csv":
            from lightning.pytorch.loggers import CSVLogger

            return CSVLogger(root, name="monitor_overhead")
        return False

    return make


def _finish(logger: Any) -> None:
    if type(logger).__name__ == "WandbLogger":
        import wandb

        wandb.finish()


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--pairs", type=int, default=2, help="runs without and with the monitor (each)")
    p.add_argument("--log-every", type=int, default=10, help="the monitor's log_every_n_steps")
    have_wandb = importlib.util.find_spec("wandb") is not None and importlib.util.find_spec("PIL") is not None
    p.add_argument("--logger", choices=["wandb", "csv", "none"], default="wandb" if have_wandb else "csv")
    p.add_argument("--out", default="bench/results/monitor_overhead.json")
    own, rest = p.parse_known_args(argv)
    if "--steps" not in " ".join(rest):
        rest += ["--steps", "30"]
    base = train_step.parse_args(rest + ["--skip-hf", "--skip-tiny"])
    if own.log_every < 1 or own.pairs < 1:
        p.error("--log-every and --pairs must be >= 1")
    return own, base


def main(argv: Optional[list[str]] = None) -> int:
    own, args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        train_step.log("--device cuda but CUDA is not available; use --device cpu")
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    from lightning_moe.callbacks import LoadBalanceMonitor

    cfg = train_step.qwen_config(args)
    label = f"qwen3-30b-a3b-{cfg.num_layers}L" + ("-small" if args.small else "")
    root = tempfile.mkdtemp(prefix="monitor_overhead_")
    make_logger = _logger_factory(own.logger, root)
    report: dict[str, Any] = {"args": {**vars(args), **vars(own)}, "env": train_step.environment(device),
                              "runs": []}
    t_all = time.perf_counter()
    for i in range(own.pairs):
        for with_monitor in ((False, True) if i % 2 == 0 else (True, False)):
            jsonl = str(Path(root) / f"routing_{i}.jsonl")
            monitor = LoadBalanceMonitor(log_every_n_steps=own.log_every, heatmap=True, jsonl_path=jsonl)
            logger = make_logger()
            r = train_step.run_ours(f"{label} monitor={'on' if with_monitor else 'off'}", cfg, args.seq_len,
                                    args.batch_size, args, args.lr, device, None, timed=True, logger=logger,
                                    extra_callbacks=(monitor,) if with_monitor else ())
            _finish(logger)
            r["monitor"] = with_monitor
            if with_monitor:
                r["monitor_metrics"] = len(monitor.last_metrics)
                r["jsonl_lines"] = sum(1 for _ in open(jsonl)) if Path(jsonl).exists() else 0
            report["runs"].append(r)

    def times(on: bool, key: str) -> list[float]:
        return [r[key] for r in report["runs"] if r["monitor"] == on and key in r]

    summary: dict[str, Any] = {}
    for key in ("step_time_mean_s", "step_time_median_s"):
        off, on = times(False, key), times(True, key)
        if off and on:
            summary[key.replace("step_time_", "ratio_")] = statistics.mean(on) / statistics.mean(off)
            summary[key + "_off"], summary[key + "_on"] = off, on
    errors = [r.get("error") for r in report["runs"] if r.get("error")]
    summary["ok"] = not errors and "ratio_mean_s" in summary and all(
        r["monitor_metrics"] > 0 and r["jsonl_lines"] > 0 for r in report["runs"] if r["monitor"])
    summary["overhead_pct"] = 100 * (summary["ratio_mean_s"] - 1) if "ratio_mean_s" in summary else None
    summary["target_met"] = summary["overhead_pct"] is not None and summary["overhead_pct"] < 1.0
    report["summary"] = summary
    report["errors"] = errors
    report["total_wall_s"] = time.perf_counter() - t_all
    Path(own.out).parent.mkdir(parents=True, exist_ok=True)
    save_result(own.out, report, "monitor_overhead")
    train_step.log(f"\nLoadBalanceMonitor(log_every_n_steps={own.log_every}, heatmap, jsonl), logger {own.logger}, "
                   f"{own.pairs} pair(s) of {args.steps} steps ({args.warmup} untimed):")
    for key in ("mean_s", "median_s"):
        if f"ratio_{key}" in summary:
            train_step.log(f"  step time {key[:-2]:6s} off {statistics.mean(summary[f'step_time_{key}_off']):.4f} s, "
                           f"on {statistics.mean(summary[f'step_time_{key}_on']):.4f} s, "
                           f"ratio {summary[f'ratio_{key}']:.4f}")
    if errors:
        train_step.log("errors: " + "; ".join(errors))
    train_step.log(f"overhead {summary['overhead_pct']}% (target < 1%), ok={summary['ok']}; JSON: {own.out}")
    return 0 if summary["ok"] else 1
