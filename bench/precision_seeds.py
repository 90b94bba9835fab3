#!/usr/bin/env python
"""Seed study of the precision modes (issue 20): does bf16 compute with fp32 master state converge like fp32?

The main job (``examples/configs/tiny.yaml``: the tiny preset on the embedded corpus, 8 x 256 tokens a step, AdamW lr
3e-3, wd 0.1, warmup 20, cosine to 0.1x at 300 steps, clip 1.0) trained once per seed and mode, **paired**: for seed s
every mode starts from the same fp32 initial weights (a seeded init of the unsharded model, rounded to bf16 by the bf16
modes; the routers stay fp32) and reads the same batches (the data module's seed is s too; seed 0 is the main job).

Modes (``--modes``):

``32-true``      fp32 weights, fp32 AdamW (the reference).
``bf16-true``    bf16 weights and bf16 AdamW moments (torch's AdamW on the bf16 parameters).
``bf16-master``  bf16-true compute with fp32 master weights and moments in the optimizer
                 (``MoELanguageModel(master_dtype="fp32")``: MasterAdamW; its Triton kernel on CUDA).
``bf16-sr``      bf16 weights and moments, torchao's AdamW with bf16 stochastic rounding
                 (``torchao.optim._AdamW(bf16_stochastic_round=True)``; bf16-true's memory).

Final loss = mean train loss of the last ``--last`` (20) steps. For every mode: every seed's final loss, its paired
relative difference to 32-true, and their mean, sample standard deviation and min / max over seeds. The issue's
target: bf16-master's mean paired difference within +-1% and smaller (in size) than bf16-true's. Writes JSON (every
loss curve) and a markdown table next to ``--out`` (``.md``), and the curves as PNG (matplotlib) or CSV.

Time: runs go seed by seed (every mode of a seed, then the next seed), so a ``--time-limit`` that stops the study
leaves complete pairs; a run starts only if the slowest run so far still fits.

GPU (one H200, seconds per run; repository root):
    python -m bench precision_seeds --seeds 5 --time-limit 420 --out bench/results/precision_seeds_h200.json
CPU (about 65-100 s a run on one thread of the 2-core box; 20 runs):
    python -m bench precision_seeds --device cpu --threads 1 --seeds 5 --out bench/results/precision_seeds_cpu.json
Seeds in parallel processes on one GPU (the tiny preset is launch-bound, so 5 processes share an H200 well; each
child runs one seed's modes in order, then the parent merges their reports into one table):
    python -m bench precision_seeds --seeds 5 --jobs 5 --time-limit 400 --out bench/results/precision_seeds_h200.json
Seeds split over calls (``--first-seed 3 --seeds 2``), one table:
    python -m bench precision_seeds --merge a.json b.json --out bench/results/precision_seeds_h200.json
Smoke test (tests/test_bench_precision.py): ``--device cpu --seeds 2 --steps 10 --last 3 --small``.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/precision_seeds.py ...` runs `python -m bench precision_seeds ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench import train_step
from bench.core.env import child_env
from bench.core.schema import save as save_result
from bench.core.curves import _moving_average, pyplot_or_csv

_HERE = Path(__file__).resolve().parent

log = train_step.log
TINY_YAML = _HERE.parent / "examples" / "configs" / "tiny.yaml"
REFERENCE = "32-true"
MODES = {  # mode -> (Lightning precision, MoELanguageModel master_dtype, optimizer)
    "32-true": ("32-true", None, "adamw"),
    "bf16-true": ("bf16-true", None, "adamw"),
    "bf16-master": ("bf16-true", "fp32", "adamw"),
    "bf16-sr": ("bf16-true", None, "torchao-sr"),
}
TARGET = 0.01  # bf16-master: |mean paired difference to 32-true| <= 1%, and below bf16-true's


# ---------------------------------------------------------------------------------------------------- settings
def main_job_settings(small: bool) -> dict[str, Any]:
    """The main job's model, data and optimisation settings, read from examples/configs/tiny.yaml."""
    import yaml

    spec = yaml.safe_load(TINY_YAML.read_text())
    model, data, trainer = spec["model"], spec["data"], spec["trainer"]
    return {"preset": model["config"], "lr": float(model["lr"]), "warmup_steps": int(model["warmup_steps"]),
            "min_lr_ratio": float(model["min_lr_ratio"]), "weight_decay": float(model["weight_decay"]),
            "seq_len": 64 if small else int(data["seq_len"]), "batch_size": 2 if small else int(data["batch_size"]),
            "val_fraction": float(data["val_fraction"]), "steps": int(trainer["max_steps"]),
            "clip": float(trainer["gradient_clip_val"]), "source": str(TINY_YAML.relative_to(_HERE.parent))}


def initial_state(cfg: Any, seed: int, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """The seeded fp32 init of the unsharded model (drawn on ``device``, kept on the host): every run of a seed
    starts from it (bf16 modes round it)."""
    from lightning_moe.models.transformer import MoETransformer

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model.to_empty(device=device)
    model.init_weights()
    out = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    del model
    return out


def paired_module(cfg: Any, init: dict[str, torch.Tensor], optimizer: str = "adamw",
                  **module_kwargs: Any) -> Callable[[], Any]:
    """A factory of MoELanguageModel(cfg, **module_kwargs) that starts from ``init``; ``optimizer="torchao-sr"``:
    torchao's AdamW with bf16 stochastic rounding instead of the module's (same groups, hyper-parameters and
    schedule)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lightning_moe.module import MoELanguageModel

    class Paired(MoELanguageModel):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            # a copy: set_model_state_dict rewrites the dict it is given
            set_model_state_dict(self.model, dict(init), options=StateDictOptions(full_state_dict=True))

        def configure_optimizers(self) -> Any:
            out = super().configure_optimizers()
            if optimizer == "adamw":
                return out
            from torchao.optim import _AdamW

            hp = self.hparams
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in out["optimizer"].param_groups]
            opt = _AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, bf16_stochastic_round=True)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, out["lr_scheduler"]["scheduler"].lr_lambdas[0])
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return lambda: Paired(cfg, **module_kwargs)


# ---------------------------------------------------------------------------------------------------- runs
def run_one(mode: str, seed: int, cfg: Any, init: dict[str, torch.Tensor], s: dict[str, Any],
            args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    precision = MODES[mode][0]
    ts_args = argparse.Namespace(steps=args.steps, warmup=0, precision=precision, loss_impl="auto", profile=False,
                                 out=args.out)
    warmup = min(s["warmup_steps"], max(1, args.steps // 10))
    _, master, optimizer = MODES[mode]
    module = paired_module(cfg, init, optimizer, lr=s["lr"], warmup_steps=warmup, min_lr_ratio=s["min_lr_ratio"],
                           weight_decay=s["weight_decay"], max_steps=args.steps, master_dtype=master)
    r = train_step.run_ours(f"tiny-{mode}-seed{seed}", cfg, s["seq_len"], s["batch_size"], ts_args, s["lr"], device,
                            None, False, seed=seed, module=module,
                            trainer_kwargs={"gradient_clip_val": s["clip"]},
                            data_kwargs={"val_fraction": s["val_fraction"], "seed": seed})
    r.update(mode=mode, seed=seed, precision=precision, impl=mode)
    r["final"] = final_loss(r["losses"], args.last) if len(r["losses"]) == args.steps else None
    n = len(r.get("step_times_s") or [])
    r["mean_step_s"] = sum(r["step_times_s"]) / n if n else None
    log(f"[seed {seed} | {mode}] final {train_step._fmt(r['final'], '.4f')} after {len(r['losses'])} steps, "
        f"{r['wall_s']:.0f} s ({train_step._fmt(r['mean_step_s'], '.3f')} s/step)"
        + (f"  ERROR {r['error']}" if r.get("error") else ""))
    return r


def final_loss(losses: list[float], last: int) -> Optional[float]:
    tail = losses[-last:]
    if not tail or not all(math.isfinite(v) for v in tail):
        return None
    return sum(tail) / len(tail)


# ---------------------------------------------------------------------------------------------------- summary
def summarize(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode: the final loss of every seed, the paired relative differences to 32-true and their statistics;
    the verdict on the issue's target (a seed counts only when all its modes finished)."""
    by = {(r["seed"], r["mode"]): r.get("final") for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    complete = [sd for sd in seeds if all(by.get((sd, m)) is not None for m in modes)]
    batches = {sd: {r.get("first_batch_checksum") for r in runs if r["seed"] == sd} for sd in seeds}
    out: dict[str, Any] = {"seeds": seeds, "complete_seeds": complete, "modes": {},
                           "same_batches_per_seed": all(len(b) == 1 for b in batches.values())}
    for m in modes:
        finals = {sd: by.get((sd, m)) for sd in seeds}
        diffs = {sd: by[(sd, m)] / by[(sd, REFERENCE)] - 1 for sd in complete} if REFERENCE in modes else {}
        d = list(diffs.values())
        out["modes"][m] = {
            "final_by_seed": finals, "rel_diff_by_seed": diffs,
            "final_mean": _mean([v for v in finals.values() if v is not None]),
            "rel_diff_mean": _mean(d), "rel_diff_std": statistics.stdev(d) if len(d) > 1 else None,
            "rel_diff_min": min(d) if d else None, "rel_diff_max": max(d) if d else None,
        }
    master, bf16 = out["modes"].get("bf16-master"), out["modes"].get("bf16-true")
    if master and bf16 and master["rel_diff_mean"] is not None and bf16["rel_diff_mean"] is not None:
        within = abs(master["rel_diff_mean"]) <= TARGET
        smaller = abs(master["rel_diff_mean"]) < abs(bf16["rel_diff_mean"])
        out["target"] = {"within_1_percent": within, "smaller_than_bf16_true": smaller, "met": within and smaller,
                         "seeds": len(complete)}
    return out


def _mean(v: list[float]) -> Optional[float]:
    return sum(v) / len(v) if v else None


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:+.2f}%"


def table(summary: dict[str, Any], modes: list[str], header: str) -> str:
    seeds = summary["seeds"]
    head = ["mode"] + [f"seed {s}" for s in seeds] + ["mean", "paired diff vs 32-true: mean", "sd", "min", "max"]
    rows = []
    for m in modes:
        st = summary["modes"][m]
        cells = [m]
        for sd in seeds:
            v = st["final_by_seed"].get(sd)
            diff = st["rel_diff_by_seed"].get(sd)
            cells.append("-" if v is None else f"{v:.4f}" + ("" if m == REFERENCE or diff is None else f" ({_pct(diff)})"))
        cells.append(train_step._fmt(st["final_mean"], ".4f"))
        if m == REFERENCE:
            cells += ["", "", "", ""]
        else:
            cells += [_pct(st["rel_diff_mean"]), _pct(st["rel_diff_std"]).lstrip("+"), _pct(st["rel_diff_min"]),
                      _pct(st["rel_diff_max"])]
        rows.append(cells)
    lines = [header, "", "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if not summary["same_batches_per_seed"]:
        lines += ["", "WARNING: the modes of a seed read different first batches: the pairs are not paired"]
    t = summary.get("target")
    if t:
        lines += ["", f"target (bf16-master's mean paired difference within +-1% and smaller than bf16-true's), over "
                      f"{t['seeds']} seeds: within 1%: {t['within_1_percent']}, smaller than bf16-true's: "
                      f"{t['smaller_than_bf16_true']} -> {'MET' if t['met'] else 'NOT MET'}"]
    return "\n".join(lines)


def save_curves(runs: list[dict[str, Any]], out: Path, modes: list[str], smooth: int = 20) -> Optional[Path]:
    """Mean curve per mode over seeds (moving mean) and the paired relative difference to 32-true, as PNG; a CSV of
    every curve where matplotlib is missing."""
    runs = [r for r in runs if r.get("losses")]
    if not runs:
        return None
    plt, path = pyplot_or_csv(out.with_name(out.stem + "_curves"), ["mode", "seed", "step", "loss"],
                              ((r["mode"], r["seed"], i + 1, v) for r in runs for i, v in enumerate(r["losses"])))
    if plt is None:
        return path
    ref = {r["seed"]: _moving_average(r["losses"], smooth) for r in runs if r["mode"] == REFERENCE}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for m in modes:
        curves = [(r["seed"], _moving_average(r["losses"], smooth)) for r in runs if r["mode"] == m]
        n = min((len(c) for _, c in curves), default=0)
        if not n:
            continue
        line, = ax.plot(range(1, n + 1), [statistics.fmean(c[i] for _, c in curves) for i in range(n)], label=m)
        paired = [(c, ref[sd]) for sd, c in curves if sd in ref and m != REFERENCE]
        k = min((min(len(c), len(b)) for c, b in paired), default=0)
        if k:
            ax2.plot(range(1, k + 1), [100 * statistics.fmean(c[i] / b[i] - 1 for c, b in paired) for i in range(k)],
                     color=line.get_color(), label=m)
    ax.set(title=f"train loss, mean over seeds (moving mean of {smooth})", xlabel="optimizer step", ylabel="loss")
    ax.legend()
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set(title="paired difference to 32-true, mean over seeds (%)", xlabel="optimizer step", ylabel="%")
    if ax2.lines[1:]:
        ax2.legend()
    path = out.with_name(out.stem + "_curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"curves: {path}")
    return path


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5, help="seeds 0 .. n-1 (seed 0 is the main job)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {list(MODES)} (32-true always runs)")
    p.add_argument("--steps", type=int, default=None, help="default: the main job's max_steps (300)")
    p.add_argument("--last", type=int, default=20, help="final loss = mean train loss of the last N steps")
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds for the whole call (0 = none)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU")
    p.add_argument("--small", action="store_true", help="2 x 64-token batches (smoke test)")
    p.add_argument("--out", default="bench/results/precision_seeds.json")
    p.add_argument("--jobs", type=int, default=1,
                   help="run the seeds in this many child processes at once (one seed each), then merge")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="no training: the table of the runs in these reports together (seeds split over calls)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes: unknown {bad}; choose from {list(MODES)}")
    args.modes = [REFERENCE] + [m for m in modes if m != REFERENCE]
    if args.jobs < 1:
        raise ValueError("--jobs must be at least 1")
    if args.seeds < 1 or args.last < 1 or (args.steps is not None and args.steps < args.last):
        raise ValueError("--seeds and --last must be positive and --steps at least --last")
    return args


def environment(device: torch.device) -> dict[str, Any]:
    env = train_step.environment(device)
    env["cpu"] = platform.processor() or platform.machine()
    for mod in ("torchao", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            env[mod] = f"unavailable ({train_step._err(e)})"
    return env


def merge(paths: list[str], out: Path) -> int:
    """One summary and table over several reports' runs (a seed run twice: the last report's)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    runs = list({(r["seed"], r["mode"]): r for rep in reports for r in rep["runs"]}.values())
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    s, args = reports[0]["settings"], reports[0]["args"]
    header = (f"tiny preset, the main job's schedule ({s['source']}; {args['steps']} steps, batch {s['batch_size']} x "
              f"{s['seq_len']}), device {reports[0]['env'].get('gpu', args['device'])}; final = mean train loss of the "
              f"last {args['last']} steps; in brackets the paired difference to 32-true; merged from {', '.join(paths)}")
    summary = summarize(runs, modes)
    text = table(summary, modes, header)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_result(out, {"env": reports[0]["env"], "args": args, "merged_from": paths, "summary": summary,
                      "table": text, "runs": runs}, "precision_seeds")
    out.with_suffix(".md").write_text(text + "\n")
    save_curves(runs, out, modes)
    log(text)
    return 0


def run_parallel(args: argparse.Namespace, argv: list[str], t0: float) -> int:
    """``--jobs N``: one child process per seed, N at a time, each with this call's other options and the time left;
    the children's reports are merged into ``--out``. A child that fails or is stopped by the time limit leaves its
    seed incomplete (the table shows which), never a mixed pair."""
    import os
    import subprocess

    out = Path(args.out)
    parts = out.with_name(out.stem + "_parts")
    parts.mkdir(parents=True, exist_ok=True)
    drop = {"--jobs", "--seeds", "--first-seed", "--out", "--time-limit"}
    keep: list[str] = []
    it = iter(argv)
    for a in it:  # this call's own options, minus the ones each child gets its own value of
        name = a.split("=", 1)[0]
        if name in drop:
            if "=" not in a:
                next(it, None)
            continue
        keep.append(a)
    env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    pending = list(range(args.first_seed, args.first_seed + args.seeds))
    running: list[tuple[int, Any, Path]] = []
    done: list[Path] = []
    failed: list[int] = []
    while pending or running:
        while pending and len(running) < args.jobs:
            seed = pending.pop(0)
            part = parts / f"seed{seed}.json"
            cmd = [sys.executable, "-m", "bench", "precision_seeds", "--first-seed", str(seed), "--seeds", "1",
                   "--out", str(part)] + keep
            if args.time_limit:
                left = args.time_limit - (time.perf_counter() - t0) - 15  # the merge and the plot
                if left <= 30:
                    log(f"--time-limit: seed {seed} not started ({left:.0f} s left)")
                    failed.append(seed)
                    continue
                cmd += ["--time-limit", f"{left:.0f}"]
            log(f"[jobs] seed {seed}: {' '.join(cmd[1:])}")
            running.append((seed, subprocess.Popen(cmd, env=env), part))
        time.sleep(1.0)
        for item in list(running):
            seed, proc, part = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if part.exists():
                done.append(part)
            if proc.returncode != 0:
                failed.append(seed)
                log(f"[jobs] seed {seed}: exit {proc.returncode}")
    if not done:
        log("[jobs] no child wrote a report")
        return 1
    merge([str(p) for p in sorted(done, key=lambda q: int(q.stem[len('seed'):]))], out)
    return 0 if not failed else 1


def main(argv: Optional[list[str]] = None) -> int:
    t0 = time.perf_counter()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.merge:
        return merge(args.merge, Path(args.out))
    if args.jobs > 1:
        return run_parallel(args, raw, t0)
    device = train_step.pick_device(args.device)
    if device is None:
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from lightning_moe.config import ModelConfig

    s = main_job_settings(args.small)
    args.steps = args.steps or s["steps"]
    cfg = ModelConfig.from_preset(s["preset"])
    report: dict[str, Any] = {"args": vars(args), "env": environment(device), "settings": s, "runs": []}
    runs: list[dict[str, Any]] = report["runs"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    slowest = 0.0
    header = (f"tiny preset, the main job's schedule ({s['source']}; {args.steps} steps, batch {s['batch_size']} x "
              f"{s['seq_len']}), device {report['env'].get('gpu', args.device)}; final = mean train loss of the last "
              f"{args.last} steps; in brackets the paired difference to 32-true (same init and batches)")

    def save() -> None:
        report["summary"] = summarize(runs, args.modes)
        report["table"] = table(report["summary"], args.modes, header)
        report["total_wall_s"] = time.perf_counter() - t0
        save_result(out, report, "precision_seeds")
        out.with_suffix(".md").write_text(report["table"] + "\n")

    stopped = None
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        init = initial_state(cfg, seed)
        for mode in args.modes:
            left = args.time_limit - (time.perf_counter() - t0) if args.time_limit else math.inf
            if left < slowest * 1.1:
                stopped = f"--time-limit {args.time_limit:.0f} s: stopped before seed {seed} {mode}"
                break
            t_run = time.perf_counter()
            runs.append(run_one(mode, seed, cfg, init, s, args, device))
            slowest = max(slowest, time.perf_counter() - t_run)
            save()
        if stopped:
            log(stopped)
            report["stopped"] = stopped
            break
    save()
    report["curves"] = str(save_curves(runs, out, args.modes) or "")
    save()
    log("\n" + report["table"])
    log(f"total wall time {report['total_wall_s']:.0f} s; {out} and {out.with_suffix('.md')}")
    return 0 if runs and all(r.get("final") is not None for r in runs) else 1
