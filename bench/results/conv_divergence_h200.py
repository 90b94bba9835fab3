"""Pooled reading of every recorded bench8 convergence run on the H200 (issue 23; CPU, reads JSON, runs nothing).

Each run is paired with the bf16 baseline of its init (same init, same batches). Two kinds of pairs:
- "bf16 again": the bf16 program run again (``repeat``) or with a callback that converted nothing (``auto``): their
  difference is the GPU's run-to-run nondeterminism grown by the trajectory, no precision change;
- every FP8 arm with round-to-nearest weights (all recipes and scopes pooled: each one was within its own spread of
  the others);
- FP8 with stochastically rounded weights (``:sr_w``) and ``noise`` (bf16 plus FP8-sized zero-mean noise, no
  rounding), each a kind of its own: the two candidate readings of the FP8 penalty (issue 23).
For each pair: the first step whose loss differs, the relative difference of the 20-step moving mean at a few steps,
and the mean over kinds with its standard error. Plot: every pair thin, the kind's mean thick.

    python bench/results/conv_divergence_h200.py --out bench/results/conv_divergence_h200.png
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


def load(pattern: str) -> dict[tuple[str, int], list[list[float]]]:
    """(arm, seed) -> distinct complete loss curves of the runs each report ran itself (lr 1e-4, fp32 masters)."""
    runs: dict[tuple[str, int], list[list[float]]] = {}
    for path in sorted(glob.glob(pattern)):
        conv = json.loads(Path(path).read_text())
        conv = conv.get("convergence", conv)
        s = conv.get("settings", {})
        if "runs" not in conv or s.get("lr") != 1e-4 or s.get("master") != "fp32" or conv.get("steps") != 300:
            continue
        if s.get("seq_len") != 4096 or "model_overrides" in s or not s.get("source", "").endswith("(8 layers)"):
            continue  # another shape (--small, --conv-model): not bench8's pairs
        for r in conv["runs"]:
            losses = r.get("losses")
            if not losses or r.get("from") or len(losses) < 300:
                continue
            key = run_key(r)
            if losses not in runs.setdefault(key, []):
                runs[key].append(losses)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--glob", default=str(HERE / "low_precision_conv_*_h200.json"))
    p.add_argument("--out", default=None, help="PNG of the differences over the steps")
    a = p.parse_args()
    runs = load(a.glob)
    kinds: dict[str, list[list[float]]] = {"bf16 again": [], "fp8": [], "fp8 sr_w": [], "noise": []}
    print(f"{'arm':36s} seed first-diff " + " ".join(f"{s:>6d}" for s in STEPS))
    for (arm, seed), curves in sorted(runs.items()):
        if arm == "baseline" or ("baseline", seed) not in runs:
            continue
        base = runs[("baseline", seed)][0]
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
            print(f"{arm[:36]:36s} {seed:4d} {first!s:>10} " + " ".join(f"{rel[s - 1]:+6.2f}" for s in STEPS))
    print("\npooled: mean (standard error) of the relative difference of the 20-step moving mean, %")
    for kind, rows in kinds.items():
        if not rows:
            continue
        cells = []
        for s in STEPS:
            v = [r[s - 1] for r in rows]
            se = f"{st.stdev(v) / math.sqrt(len(v)):.2f}" if len(v) > 1 else "-"
            cells.append(f"{st.mean(v):+.2f} ({se})")
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
                ax.plot(range(1, 301), r[:300], color=colour, alpha=0.18, lw=0.7)
            mean = [st.mean(r[i] for r in rows) for i in range(300)]
            ax.plot(range(1, 301), mean, color=colour, lw=2.2, label=f"{kind}: mean of {len(rows)} pairs")
        ax.axhspan(-1, 1, color="0.85", zorder=0, label="target +-1%")
        ax.axhline(0, color="0.4", lw=0.6)
        ax.set(xlabel="optimizer step", ylabel="vs bf16 baseline of the same init (%)",
               title="bench8 on one H200: 20-step moving mean of the train loss, each pair vs its baseline")
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        fig.savefig(a.out, dpi=110)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
