#!/usr/bin/env python
"""Memory benchmark: selective recomputation and activation offload on the 8-layer Qwen3-30B-A3B-shaped model.

One GPU, bf16-true, ``MoEParallelStrategy()`` (world size 1), batch 4 x 4096 tokens, through ``bench/train_step.py``'s
``run_ours`` (the Lightning Trainer). For each setting: peak memory, step time, and activation memory = peak minus
the bytes of parameters, gradients and AdamW state (computed from the model: 2 + 2 + 4 bytes per parameter under
bf16-true, the router in fp32), each relative to ``none``. Then the best setting (most activation memory saved among
those under +10% step time; else the fastest of those saving >= 40%) runs 8 x 4096 tokens per step to show it fits.

Gradient check: the first optimizer step's (finalised) gradients of every setting against those of ``none`` (same
seed, same batch): the largest relative L2 difference over the parameters, and how many are bit-equal. A setting
fails above ``--grad-tol`` (bf16 rounding and the order of CUDA's atomic adds differ run to run; a wrong gradient is
off by O(1)); ``--repeat-none`` runs ``none`` twice to show that run-to-run floor.

Run (repository root):
    python -m bench memory --out bench/results/memory_h200.json          # H200: about 5 minutes
    python -m bench memory --device cpu --small --out /tmp/memory.json   # smoke test of the whole script
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/memory.py ...` runs `python -m bench memory ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import time
from pathlib import Path
from typing import Any, Optional

import torch

from bench import train_step as ts
from bench.core.schema import save as save_result
from bench.deepseek_v3_step import Budget

GIB = 1024**3
# The default settings, by label. A label reads "<recompute> [+offload[<modules>]] [[grads freed]]": <recompute> is
# "none", "full", "full@N" (full recomputation of the first N blocks only) or kinds joined by "+", which may start
# with "full" or "full@N" ("full@4+norm+moe_act"); "offload[...]" alone means no recomputation. --only takes any
# label of that form, not only these.
SETTINGS = [
    "none",
    "none [grads freed]",
    "full",
    "full@4",
    "moe_act",
    "experts",
    "norm+moe_act+attn_core",
    "norm+experts+attn_core",
    "offload[experts]",
    "offload[moe]",
    "norm+moe_act+attn_core +offload[experts]",
    "norm+moe_act+attn_core +offload[moe,attention]",
    "full@2+norm+moe_act+attn_core +offload[experts]",
]


def parse_setting(label: str) -> tuple[Any, Optional[int], Optional[list[str]]]:
    """label -> (activation_checkpointing, recompute_num_layers, ActivationOffload modules or None)."""
    text = label.replace("[grads freed]", "").replace("[repeat]", "").strip()
    offload = None
    if "offload[" in text:
        head, _, rest = text.partition("offload[")
        mods, _, tail = rest.partition("]")
        if tail.strip():
            raise ValueError(f"setting {label!r}: nothing may follow offload[...]")
        offload = [m.strip() for m in mods.split(",") if m.strip()]
        text = head.strip().rstrip("+").strip()
    if text in ("", "none"):
        return "none", None, offload
    kinds, layers = [], None
    for item in text.split("+"):
        item = item.strip()
        if item.startswith("full@"):
            kinds.append("full")
            layers = int(item.removeprefix("full@"))
        else:
            kinds.append(item)
    return (kinds[0] if kinds == ["full"] else kinds), layers, offload


def state_bytes(cfg: Any, precision: str) -> int:
    """Parameters + gradients + AdamW moments, from the plan's per-component counts (world of one)."""
    from lightning_moe.plan import memory_plan

    return sum(r.weight_bytes + r.grad_bytes + r.optim_bytes for r in memory_plan(cfg, precision))


def split_labels(text: str) -> list[str]:
    """Split a comma list of labels at the commas outside brackets ("offload[moe,attention]" is one label)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [x.strip() for x in out + [cur] if x.strip()]


def first_step_gradients(into: dict[str, torch.Tensor]) -> Any:
    """A callback: the first optimizer step's gradients (after the strategy finalised them), copied to host memory
    into ``into`` by parameter name (the full-recomputation wrapper's prefix removed), so the GPU peak is untouched."""
    import lightning as L
    from torch.distributed.tensor import DTensor

    class FirstStepGradients(L.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if into:
                return
            for name, p in pl_module.named_parameters():
                if p.grad is not None:
                    g = p.grad
                    # one process: the local shard is the whole tensor (full_tensor would allocate on the GPU)
                    g = g.to_local() if isinstance(g, DTensor) and g.device_mesh.size() == 1 else g
                    g = g.full_tensor() if isinstance(g, DTensor) else g
                    into[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().to("cpu", copy=True)

    return FirstStepGradients()


def compare_gradients(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                      device: torch.device) -> dict[str, Any]:
    """Largest relative L2 difference over the parameters (computed on ``device``, one parameter at a time) and the
    number of bit-equal ones."""
    if got.keys() != ref.keys():
        return {"grad_error": f"parameter names differ: {sorted(set(got) ^ set(ref))[:4]}"}
    worst, worst_name, equal = 0.0, None, 0
    for name, r in ref.items():
        a, b = got[name].to(device), r.to(device)
        equal += bool(torch.equal(a, b))
        rel = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
        if rel > worst or worst_name is None:
            worst, worst_name = rel, name
    return {"grad_rel_diff_max": worst, "grad_worst_param": worst_name, "grad_bit_equal": equal,
            "grad_params": len(ref)}


def run_setting(label: str, cfg: Any, batch: int, args: argparse.Namespace, device: torch.device,
                grads: Optional[dict[str, torch.Tensor]] = None) -> dict[str, Any]:
    """One setting through the Trainer; ``grads``: filled with the first step's gradients (host copies)."""
    from lightning_moe import MoEParallelStrategy
    from lightning_moe.callbacks import ActivationOffload

    ac, num_layers, offload = parse_setting(label)

    callbacks = (ActivationOffload(offload),) if offload else ()
    if grads is not None:
        callbacks += (first_step_gradients(grads),)
    # Gradients stay allocated through the forward (free_grads_after_step=False) so that peak minus parameters,
    # gradients and optimizer state is the activation memory; the "[grads freed]" setting shows the strategy's
    # default, which frees them after each optimizer step and so lowers the peak by up to their size.
    strategy = MoEParallelStrategy(activation_checkpointing=ac, recompute_num_layers=num_layers, compile=args.compile,
                                   free_grads_after_step=label.endswith("[grads freed]"))
    r = ts.run_ours(label, cfg, args.seq_len, batch, args, args.lr, device, None, timed=True, strategy=strategy,
                    extra_callbacks=callbacks)
    r.update(setting=label, activation_checkpointing=ac, recompute_num_layers=num_layers, offload=offload)
    return r


def summarise(runs: list[dict[str, Any]], state: int) -> None:
    base = next((r for r in runs if r["setting"] == "none" and r.get("peak_gib")), None)
    for r in runs:
        if r.get("peak_gib") is not None:
            r["activation_gib"] = r["peak_gib"] - state / GIB
        if base is not None and "activation_gib" in r and r.get("step_time_median_s"):
            r["activation_vs_none"] = r["activation_gib"] / base["activation_gib"]
            r["step_time_vs_none"] = r["step_time_median_s"] / base["step_time_median_s"]


def _ran(r: dict[str, Any]) -> bool:
    return not r.get("error") and not r.get("skipped") and bool(r.get("finite", False))


def _grads_ok(r: dict[str, Any], tol: float) -> bool:
    """No gradient check (the baseline, the doubled batch, --no-grad-check) counts as passed."""
    return not r.get("grad_error") and r.get("grad_rel_diff_max", 0.0) <= tol


def best(runs: list[dict[str, Any]], grad_tol: float = float("inf")) -> Optional[dict[str, Any]]:
    # a few steps of warmup-spiked loss are not a failure here: finite losses and no error suffice
    ok = [r for r in runs if _ran(r) and _grads_ok(r, grad_tol) and "activation_vs_none" in r
          and r["setting"] not in ("none", "none [repeat]")]
    cheap = [r for r in ok if r["step_time_vs_none"] < 1.10]
    if cheap:
        return min(cheap, key=lambda r: r["activation_vs_none"])
    saving = [r for r in ok if r["activation_vs_none"] <= 0.60]
    return min(saving, key=lambda r: r["step_time_vs_none"]) if saving else None


def table(runs: list[dict[str, Any]], grad_tol: float = float("inf")) -> str:
    head = (f"{'setting':<48}{'batch':>6}{'peak GiB':>10}{'act GiB':>9}{'act/none':>9}{'step s':>8}{'time/none':>10}"
            f"{'grad rel':>10}{'bit-eq':>9}  ok")
    lines = [head, "-" * len(head)]

    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for r in runs:
        if r.get("skipped"):
            lines.append(f"{r['setting']:<48}{r['batch_size']:>6}  {r['skipped']}")
            continue
        bit_eq = f"{r['grad_bit_equal']}/{r['grad_params']}" if "grad_params" in r else "-"
        status = ("ok" if _grads_ok(r, grad_tol) else f"GRADIENTS DIFFER {r.get('grad_error', '')}") if _ran(r) \
            else r.get("error", "FAIL")[:60]
        lines.append(f"{r['setting']:<48}{r['batch_size']:>6}{f(r.get('peak_gib'), '.2f'):>10}"
                     f"{f(r.get('activation_gib'), '.2f'):>9}{f(r.get('activation_vs_none'), '.2f'):>9}"
                     f"{f(r.get('step_time_median_s'), '.3f'):>8}{f(r.get('step_time_vs_none'), '.3f'):>10}"
                     f"{f(r.get('grad_rel_diff_max'), '.1e'):>10}{bit_eq:>9}  {status}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="train_step.py's small model (CPU smoke test)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", default=None, help="comma list of setting labels to run (default: all; see SETTINGS "
                   "for the label grammar, e.g. 'full@4,norm+moe_act+attn_core +offload[experts,attention]')")
    p.add_argument("--compile", action="store_true", help="every setting with MoEParallelStrategy(compile=True)")
    p.add_argument("--precision", choices=["bf16-true", "32-true"], default=None,
                   help="default: bf16-true on cuda, 32-true on cpu (bf16-true there runs the GPU's recompute path)")
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds for the whole call (0: none): a setting "
                   "starts only when the slowest run so far still fits; the rest are listed as skipped")
    p.add_argument("--no-grad-check", action="store_true", help="skip the first-step gradient check against none")
    p.add_argument("--grad-tol", type=float, default=1e-2, help="largest relative L2 gradient difference to none")
    p.add_argument("--repeat-none", action="store_true", help="run none twice: the run-to-run gradient floor")
    p.add_argument("--out", default="bench/results/memory.json")
    args = p.parse_args(argv)
    # the attributes run_ours and qwen_config read
    args.seq_len = 128 if args.small else 4096
    args.batch_size, args.layers, args.lr = 4, (2 if args.small else 8), 3e-4
    args.precision = args.precision or ("bf16-true" if args.device == "cuda" else "32-true")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but CUDA is not available; use --device cpu")
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    t0 = time.perf_counter()
    cfg = ts.qwen_config(args)
    state = state_bytes(cfg, args.precision)
    wanted = None if args.only is None else set(split_labels(args.only))
    report: dict[str, Any] = {"args": vars(args), "env": ts.environment(device), "state_gib": state / GIB,
                              "runs": []}
    runs = report["runs"]

    def save() -> None:
        summarise(runs, state)
        report["total_wall_s"] = time.perf_counter() - t0
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        save_result(args.out, report, "memory")

    # "none" first (the baseline of every ratio), then the chosen defaults in their order, then the other labels
    labels = SETTINGS if wanted is None else ["none", *(x for x in SETTINGS[1:] if x in wanted),
                                              *sorted(wanted - set(SETTINGS))]
    if args.repeat_none:
        labels.insert(1, "none [repeat]")
    for label in labels:
        parse_setting(label)  # a malformed label fails here, before any run
    budget = Budget(args.time_limit, start=t0, reserve_s=10.0)
    base_grads: Optional[dict[str, torch.Tensor]] = None

    def run(label: str, batch: int, check: bool) -> Optional[dict[str, Any]]:
        nonlocal base_grads
        why = budget.refusal(f"{label!r} at batch {batch}")
        if why is not None:
            ts.log(f"\n{why}")
            runs.append({"setting": label, "batch_size": batch, "skipped": why})
            return None
        started = time.perf_counter()
        grads: Optional[dict[str, torch.Tensor]] = {} if check else None
        r = run_setting(label, cfg, batch, args, device, grads)
        budget.ran(time.perf_counter() - started)
        if grads and base_grads is None and label == "none":
            base_grads = grads
        elif grads and base_grads is not None:
            r.update(compare_gradients(grads, base_grads, device))
            ts.log(f"[{label}] first-step gradients vs none: max relative L2 difference "
                   f"{r.get('grad_rel_diff_max', float('nan')):.2e} ({r.get('grad_worst_param')}), "
                   f"{r.get('grad_bit_equal')}/{r.get('grad_params')} bit-equal {r.get('grad_error', '')}")
        runs.append(r)
        save()
        return r

    for label in labels:
        run(label, args.batch_size, check=not args.no_grad_check)
    b = best(runs, args.grad_tol)
    if b is None and device.type == "cpu":  # no memory statistics on the CPU: exercise the last path all the same
        b = next((r for r in reversed(runs) if not r.get("skipped")), None)
    report["best"] = b["setting"] if b else None
    if b is not None:
        r = run(b["setting"], 2 * args.batch_size, check=False)
        if r is not None:
            r["fits_8x4096" if not args.small else "fits_double_batch"] = _ran(r)
    save()
    print("\n" + "=" * 100)
    print(f"parameters + gradients + AdamW state: {state / GIB:.2f} GiB ({args.precision}); "
          f"activation = peak - that; batch x {args.seq_len} tokens")
    print(table(runs, args.grad_tol))
    print(f"best: {report['best']}; total wall time {report['total_wall_s']:.0f}s; results in {args.out}")
    done = [r for r in runs if not r.get("skipped")]
    return 0 if all(_ran(r) and _grads_ok(r, args.grad_tol) for r in done) else 1
