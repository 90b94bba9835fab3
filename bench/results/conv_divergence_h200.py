"""Pooled reading of every recorded bench8 convergence run (issue 23; CPU, reads JSON, runs nothing).

Each run is paired with the bf16 baseline of its init (same init, same batches). Two kinds of pairs:
- "bf16 again": the bf16 program run again (``repeat``) or with a callback that converted nothing (``auto``): their
  difference is the GPU's run-to-run nondeterminism grown by the trajectory, no precision change;
- every FP8 arm with round-to-nearest weights (all recipes and scopes pooled: each one was within its own spread of
  the others);
- FP8 with stochastically rounded weights (``:sr_w``) and ``noise`` (bf16 plus FP8-sized zero-mean noise, no
  rounding), each a kind of its own: the two candidate readings of the FP8 penalty (issue 23).
For each pair: the first step whose loss differs, the relative difference of the 20-step moving mean at a few steps,
and the mean over kinds with its standard error. Plot: every pair thin, the kind's mean thick.
With ``--min-steps`` under 300 (the default off bench8's depth), a run cut short by its time share counts at the steps
both runs of its pair reached (``n`` says how many pairs each step has), and each arm and init keeps its longest run.

    python bench/results/conv_divergence_h200.py --out bench/results/conv_divergence_h200.png
    # the 4-layer full-width stand-in on the H100 (bench8 with --conv-model num_layers=4)
    python bench/results/conv_divergence_h200.py --layers 4 --glob 'bench/results/low_precision_conv_l4*_h100.json' \
        --out bench/results/conv_divergence_l4_h100.png
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import statistics as st
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
# run_key: older reports name a run's arm only in its label
from bench.core.curves import _moving_average, run_key  # noqa: E402
STEPS = (1, 5, 10, 20, 30, 50, 75, 100, 150, 200, 250, 300)


def load(pattern: str, layers: int = 8, min_steps: int = 300) -> dict[tuple[str, int], list[list[float]]]:
    """(arm, seed) -> distinct loss curves (at least ``min_steps`` long) of the runs each report ran itself (lr 1e-4,
    fp32 masters), at bench8's shape or, with ``layers``, bench8 rebuilt at that depth and nothing else changed."""
    runs: dict[tuple[str, int], list[list[float]]] = {}
    overrides = None if layers == 8 else [f"num_layers={layers}"]
    for path in sorted(glob.glob(pattern)):
        conv = json.loads(Path(path).read_text())
        conv = conv.get("convergence", conv)
        s = conv.get("settings", {})
        if "runs" not in conv or s.get("lr") != 1e-4 or s.get("master") != "fp32" or conv.get("steps") != 300:
            continue
        if s.get("seq_len") != 4096 or s.get("model_overrides") != overrides \
                or not s.get("source", "").startswith("bench/train_step.py qwen_config (8 layers)"):
            continue  # another shape (--small, other --conv-model): not these pairs
        for r in conv["runs"]:
            losses = r.get("losses")
            if not losses or r.get("from") or len(losses) < min_steps:
                continue
            key = run_key(r)
            if losses not in runs.setdefault(key, []):
                runs[key].append(losses)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--glob", default=str(HERE / "low_precision_conv_*_h200.json"))
    p.add_argument("--out", default=None, help="PNG of the differences over the steps")
    p.add_argument("--layers", type=int, default=8, help="bench8 rebuilt at this depth (--conv-model num_layers=N)")
    p.add_argument("--min-steps", type=int, default=None, help="shortest run kept (default: 300 at 8 layers, all "
                   "300 steps; 20 otherwise, where the time shares cut runs short)")
    a = p.parse_args()
    min_steps = a.min_steps or (300 if a.layers == 8 else 20)
    runs = load(a.glob, a.layers, min_steps)
    if min_steps < 300:  # a shorter run of a pair is a truncated try of the same pair: keep the longest only
        runs = {key: [max(curves, key=len)] for key, curves in runs.items()}
    kinds: dict[str, list[list[float]]] = {"bf16 again": [], "fp8": [], "fp8 sr_w": [], "noise": []}
    print(f"{'arm':36s} seed first-diff " + " ".join(f"{s:>6d}" for s in STEPS))
    for (arm, seed), curves in sorted(runs.items()):
        if arm == "baseline" or ("baseline", seed) not in runs:
            continue
        base = max(runs[("baseline", seed)], key=len)
        bm = _moving_average(base, 20)
        kind = ("fp8 sr_w" if ":sr_w" in arm else "fp8") if arm.startswith("fp8") else \
            "bf16 again" if arm in ("repeat", "auto") else "noise" if arm == "noise" else None
        if kind is None:
            continue
        for losses in curves:
            lm = _moving_average(losses, 20)
            rel = [100 * (q - b) / b for q, b in zip(lm, bm)]
            kinds[kind].append(rel)
            first = next((i + 1 for i, (x, y) in enumerate(zip(losses, base)) if x != y), None)
            print(f"{arm[:36]:36s} {seed:4d} {first!s:>10} "
                  + " ".join(f"{rel[s - 1]:+6.2f}" if s <= len(rel) else f"{'':>6s}" for s in STEPS))
    print("\npooled: mean (standard error) of the relative difference of the 20-step moving mean, %")
    for kind, rows in kinds.items():
        if not rows:
            continue
        cells = []
        for s in STEPS:
            v = [r[s - 1] for r in rows if len(r) >= s]
            se = f"{st.stdev(v) / math.sqrt(len(v)):.2f}" if len(v) > 1 else "-"
            n = f" n={len(v)}" if len(v) != len(rows) else ""
            cells.append(f"{st.mean(v):+.2f} ({se}){n}" if v else "-")
        print(f"{kind:12s} n={len(rows):2d}  " + "  ".join(f"{s}: {c}" for s, c in zip(STEPS, cells)))
    if a.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.5))
        for kind, colour in (("bf16 again", "black"), ("fp8", "tab:orange"), ("fp8 sr_w", "tab:blue"),
                             ("noise", "tab:green")):
            rows = kinds[kind]
            if not rows:
                continue
            for r in rows:
                ax.plot(range(1, len(r) + 1), r, color=colour, alpha=0.18, lw=0.7)
            # the mean over the same pairs at every step (those that reach step 300), so no pair leaving moves it
            full = [r for r in rows if len(r) >= 300] or rows
            span = min(len(r) for r in full)
            mean = [st.mean(r[i] for r in full) for i in range(span)]
            ax.plot(range(1, span + 1), mean, color=colour, lw=2.2,
                    label=f"{kind}: mean of the {len(full)} pairs to step {span} (thin: all {len(rows)})")
        ax.axhspan(-1, 1, color="0.85", zorder=0, label="target +-1%")
        ax.axhline(0, color="0.4", lw=0.6)
        ax.set(xlabel="optimizer step", ylabel="vs bf16 baseline of the same init (%)",
               title=f"bench8{'' if a.layers == 8 else f' at {a.layers} layers'}: 20-step moving mean of the "
                     "train loss, each pair vs its baseline")
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        fig.savefig(a.out, dpi=110)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
