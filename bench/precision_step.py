#!/usr/bin/env python
"""bf16 compute with fp32 master state on the 8-layer bench model, one GPU (issue 20): speed, memory, optimizer step,
convergence -- against bf16-true with torch's fused AdamW and against bf16-mixed, in the same run.

The model and batch of ``bench/train_step.py`` (8-layer Qwen3-30B-A3B shape, 4 x 4096 tokens, lr 3e-4, warmup 2 then
cosine to 0.1x at the run's length), one ``--variant`` for every run (default ``chunked+compile``: chunked LM loss,
regional torch.compile through a one-device MoEParallelStrategy), every run from the same fp32 initial weights
(seeded, drawn once; the bf16 runs round them) and the same batches:

``bf16-true``    bf16 weights, torch's fused AdamW with bf16 moments (``--speed-steps``, default 30).
``bf16-master``  bf16-true compute, fp32 master weights and moments (``MoELanguageModel(master_dtype="fp32")``:
                 MasterAdamW's Triton step) (``--conv-steps``, default 300).
``bf16-mixed``   fp32 parameters, bf16 autocast, torch's fused AdamW (``--conv-steps``).

Reported per run: tokens/s (16384 tokens / mean step time after ``--warmup`` steps; a step is forward + backward +
optimizer), peak memory (``torch.cuda.max_memory_allocated``), the optimizer step alone after training (CUDA events,
median of ``--opt-reps``) against its bandwidth bound = the bytes it moves (``deepseek_v3_step.optimizer_bytes``: 28
bytes a bf16 parameter with a master, 14 for bf16 AdamW) / the measured copy bandwidth (a 2 GiB copy, read + write).
Targets: bf16-master tokens/s >= 0.93x bf16-true's; its optimizer step <= 1.25x its bound; its final loss (mean train
loss of the last ``--last`` 20 steps) within 1% of bf16-mixed's over the same steps.

``--time-limit`` (default 330 s, the whole call): a run starts only when the slowest so far would fit, a running one
stops at the deadline (a cut convergence pair is compared at its common length and marked).

GPU (one H200; repository root), with the DeepSeek-V3-shaped step of the same mode after it:
    python -m bench precision_step --out bench/results/precision_step_h200.json
CPU smoke test (tests/test_bench_precision.py; tiny shapes, timings meaningless):
    python -m bench precision_step --smoke --out /tmp/ps.json
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/precision_step.py ...` runs `python -m bench precision_step ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402

from bench import deepseek_v3_step as ds, precision_seeds, train_step as ts  # noqa: E402
from bench.core.device import GIB  # noqa: E402
from bench.core.schema import save as save_result  # noqa: E402

log = ts.log
RUNS = {  # name -> (Lightning precision, MoELanguageModel master_dtype)
    "bf16-true": ("bf16-true", None),
    "bf16-master": ("bf16-true", "fp32"),
    "bf16-mixed": ("bf16-mixed", None),
}
TARGETS = {"speed": 0.93, "optimizer": 1.25, "convergence": 0.01}


def run(name: str, cfg: Any, init: dict[str, torch.Tensor], steps: int, args: argparse.Namespace,
        device: torch.device, peak: Optional[dict], bw: Optional[dict], deadline: Optional[float]) -> dict[str, Any]:
    precision, master = RUNS[name]
    loss_impl, _ = ts.parse_variant(args.variant)
    stats: dict[str, Any] = {}
    guard = ds.ours_guard(deadline, device, args, bw, stats)  # stops at the deadline; times the optimizer at the end
    ns = argparse.Namespace(steps=steps, warmup=args.warmup, precision=precision, out=args.out, profile=False,
                            loss_impl=loss_impl)
    module = precision_seeds.paired_module(cfg, init, lr=args.lr, warmup_steps=2, max_steps=steps,
                                           loss_impl=loss_impl, master_dtype=master)
    r = ts.run_ours(f"qwen3-30b-a3b-{cfg.num_layers}L", cfg, args.seq_len, args.batch_size, ns, args.lr, device, peak,
                    timed=True, extra_callbacks=(guard,), variant=args.variant, seed=args.seed, module=module)
    r.update(stats, impl=f"{name} [{args.variant}]", run=name, precision=precision, master_dtype=master)
    if stats.get("peak_gib_training") is not None:
        r["peak_gib"] = stats["peak_gib_training"]  # not the optimizer timing's
    log(ds.summary_line(r))
    return r


def compare(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The three targets, each with the numbers it rests on (None where a run is missing)."""
    out: dict[str, Any] = {}
    base, new, mixed = runs.get("bf16-true", {}), runs.get("bf16-master", {}), runs.get("bf16-mixed", {})
    if base.get("tokens_per_s") and new.get("tokens_per_s"):
        ratio = new["tokens_per_s"] / base["tokens_per_s"]
        out["speed"] = {"tokens_per_s_ratio": ratio, "target": TARGETS["speed"], "ok": ratio >= TARGETS["speed"]}
    o = new.get("optimizer_step") or {}
    if o.get("ratio_to_bound") is not None:
        out["optimizer"] = {"ratio_to_bound": o["ratio_to_bound"], "seconds": o["seconds"], "bound_s": o["bound_s"],
                            "target": TARGETS["optimizer"], "ok": o["ratio_to_bound"] <= TARGETS["optimizer"]}
    n = min(len(new.get("losses") or []), len(mixed.get("losses") or []))
    if n >= args.last:
        a = precision_seeds.final_loss(new["losses"][:n], args.last)
        b = precision_seeds.final_loss(mixed["losses"][:n], args.last)
        rel = None if a is None or b is None else a / b - 1
        out["convergence"] = {"steps": n, "truncated": n < args.conv_steps, "final_master": a, "final_mixed": b,
                              "rel_diff": rel, "target": TARGETS["convergence"],
                              "same_batches": new.get("first_batch_checksum") == mixed.get("first_batch_checksum"),
                              "ok": None if rel is None or n < args.conv_steps else abs(rel) <= TARGETS["convergence"]}
    return out


def report_text(report: dict[str, Any]) -> str:
    bw, c = report.get("copy_bandwidth"), report["comparison"]
    lines = [f"{report['model']}, batch {report['args']['batch_size']} x {report['args']['seq_len']}, variant "
             f"{report['args']['variant']}, device {report['env'].get('gpu', report['env']['device'])}"]
    if bw:
        lines.append(f"optimizer bound = bytes moved / measured copy bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s "
                     f"(read + write of a {bw['tensor_bytes'] / GIB:.2f} GiB copy)")
    lines += ["", ds.table(report["runs"]), ""]
    lines += [r["skipped"] for r in report["runs"] if r.get("skipped")]
    if "speed" in c:
        lines.append(f"tokens/s bf16-master / bf16-true: {c['speed']['tokens_per_s_ratio']:.3f}x "
                     f"(target >= {TARGETS['speed']}) -> {'OK' if c['speed']['ok'] else 'MISSED'}")
    if "optimizer" in c:
        o = c["optimizer"]
        lines.append(f"bf16-master optimizer step {1e3 * o['seconds']:.1f} ms vs bound {1e3 * o['bound_s']:.1f} ms: "
                     f"{o['ratio_to_bound']:.2f}x (target <= {TARGETS['optimizer']}) -> {'OK' if o['ok'] else 'MISSED'}")
    if "convergence" in c:
        v = c["convergence"]
        verdict = {True: "OK", False: "MISSED", None: "NOT DECIDED (truncated or non-finite)"}[v["ok"]]
        lines.append(f"final loss (mean of the last {report['args']['last']} of {v['steps']} steps) bf16-master "
                     f"{ts._fmt(v['final_master'], '.4f')} vs bf16-mixed {ts._fmt(v['final_mixed'], '.4f')}: "
                     f"{'-' if v['rel_diff'] is None else format(100 * v['rel_diff'], '+.2f') + '%'} (target +-1%) -> "
                     f"{verdict}" + ("" if v["same_batches"] else "  (WARNING: different first batches)"))
    lines.append(f"total wall time {report['total_wall_s']:.0f}s (--time-limit {report['args']['time_limit']:.0f}s); "
                 f"JSON {report['args']['out']}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {list(RUNS)}")
    p.add_argument("--speed-steps", type=int, default=None, help="steps of bf16-true (default 30; 4 with --smoke)")
    p.add_argument("--conv-steps", type=int, default=None,
                   help="steps of bf16-master and bf16-mixed (default 300; 6 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps at the start (default 5; 1 with --smoke)")
    p.add_argument("--last", type=int, default=None, help="final loss = mean of the last N (default 20; 3 --smoke)")
    p.add_argument("--variant", default=None, help="loss_impl[+compile] of every run (default chunked+compile; "
                                                   "auto with --smoke)")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (64 with --smoke)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0, help="seed of the shared initial weights")
    p.add_argument("--opt-reps", type=int, default=5, help="timed repetitions of the optimizer step alone")
    p.add_argument("--time-limit", type=float, default=330.0, help="seconds for the whole call (0 = none)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default cuda (cpu with --smoke)")
    p.add_argument("--smoke", action="store_true", help="CPU test of every code path: 2 small layers, a few steps")
    p.add_argument("--out", default="bench/results/precision_step.json")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="no training: the comparison of the runs in these reports together (runs from separate calls, "
                        "paired by the seeded init and the first batch's checksum, which the table checks)")
    args = p.parse_args(argv)
    for name, full, small in (("speed_steps", 30, 4), ("conv_steps", 300, 6), ("warmup", 5, 1), ("last", 20, 3),
                              ("variant", "chunked+compile", "auto"), ("seq_len", 4096, 64), ("device", "cuda", "cpu")):
        if getattr(args, name) is None:
            setattr(args, name, small if args.smoke else full)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in args.runs if r not in RUNS]
    if bad or not args.runs:
        raise ValueError(f"--runs: unknown {bad}; choose from {list(RUNS)}")
    loss_impl, extras = ts.parse_variant(args.variant)
    if "master" in extras:
        raise ValueError("--variant: '+master' is the bf16-master run's; give loss_impl[+compile]")
    if not 0 <= args.warmup < min(args.speed_steps, args.conv_steps):
        raise ValueError("--warmup must be below --speed-steps and --conv-steps: no step would be timed")
    if args.last < 1 or args.last > args.conv_steps:
        raise ValueError(f"--last must be in [1, --conv-steps {args.conv_steps}]")
    return args


def merge(paths: list[str], args: argparse.Namespace) -> int:
    """One report over the runs of several (a run that ran in two: the last report's); the settings of the first."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    done = {r["run"]: r for rep in reports for r in rep["runs"] if not r.get("skipped")}
    first = reports[0]
    merged_args = argparse.Namespace(**{**first["args"], "out": args.out, "time_limit": 0.0})
    report = {**first, "args": vars(merged_args), "merged_from": paths,
              "runs": [done[n] for n in RUNS if n in done], "copy_bandwidth": first.get("copy_bandwidth")}
    report["comparison"] = compare(done, merged_args)
    report["total_wall_s"] = sum(rep.get("total_wall_s", 0.0) for rep in reports)
    report["table"] = report_text(report) + f"\nmerged from {', '.join(paths)}"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    log(report["table"])
    return 0 if report["runs"] and all(r.get("ok") for r in report["runs"]) else 1  # as a training call's


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args)
    device = ts.pick_device(args.device)
    if device is None:
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    budget = ds.Budget(args.time_limit, start=_T_START)
    cfg = ts.qwen_config(argparse.Namespace(small=args.smoke, layers=2 if args.smoke else 8, seq_len=args.seq_len))
    report: dict[str, Any] = {"args": vars(args), "env": ts.environment(device), "runs": [],
                              "model": f"qwen3-30b-a3b-{cfg.num_layers}L ({cfg.count_params()['total'] / 1e9:.2f}B)"}
    log(json.dumps(report["env"]))
    peak, bw = ds.measure_device(device, report)
    t0 = time.perf_counter()
    init = precision_seeds.initial_state(cfg, args.seed, device)
    log(f"shared fp32 init of {cfg.count_params()['total'] / 1e9:.2f}B parameters: {time.perf_counter() - t0:.0f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict[str, Any]] = {}

    def save(text: Optional[str] = None) -> None:
        report["comparison"] = compare(done, args)
        report["total_wall_s"] = budget.elapsed()
        if text is not None:
            report["table"] = text
            out.with_suffix(".log").write_text(text + "\n")
        save_result(out, report, "precision_step")

    for name in args.runs:
        reason = budget.refusal(name)
        if reason:
            log(reason)
            report["runs"].append({"run": name, "impl": name, "skipped": reason})
            continue
        t_run = time.perf_counter()
        steps = args.speed_steps if name == "bf16-true" else args.conv_steps
        r = run(name, cfg, init, steps, args, device, peak, bw, budget.deadline())
        budget.ran(time.perf_counter() - t_run)
        report["runs"].append(r)
        done[name] = r
        save()
    save()
    text = report_text(report)
    save(text)
    log("\n" + "=" * 100 + "\n" + text)
    ran = [r for r in report["runs"] if not r.get("skipped")]
    return 0 if ran and all(r.get("ok") for r in ran) else 1
