"""Loss curves of convergence runs (``bench/low_precision.py``, ``bench/precision_seeds.py``): a moving average and a
PNG through matplotlib (the ``bench`` extra), or the curves' data as CSV where matplotlib is missing; a run's final
loss and its comparison with the baseline from the same init and batches."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from bench.core.text import fmt_cell, log

BASE = "baseline"  # the run the others are compared with (bench/low_precision.py's name for it)
NOISE = "noise"  # the bf16 program with zero-mean noise of FP8's size on the GEMMs a forced recipe converts
REPEAT = "repeat"  # the baseline's program again from the same init: the spread kernel nondeterminism alone makes


def _moving_average(v: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x
        if i >= n:
            acc -= v[i - n]
        out.append(acc / min(i + 1, n))
    return out


def pyplot_or_csv(stem: Path, header: list[str], rows: Iterable[Sequence[Any]]) -> tuple[Any, Optional[Path]]:
    """matplotlib's pyplot (Agg backend) and None; where matplotlib is missing, None and ``stem``.csv holding the
    rows (the curves' data, for ``--plot-from`` or a spreadsheet)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = stem.with_suffix(".csv")
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(rows)
        log(f"curves: {path} (matplotlib not importable: pip install 'lightning_moe[bench]' for a PNG)")
        return None, path
    return plt, None


def paired_curves(runs: list[dict[str, Any]], smooth: int, key: str = "losses") -> dict[str, list[list[float]]]:
    """Per arm, for each init seed that has a baseline, the moving mean's relative difference (%) to the baseline of
    the same seed, step by step (over the steps both ran); under ``BASE`` the other seeds' baselines against the first
    run's (the noise). ``key="hp_losses"``: the runs' high-precision losses (``--conv-hp-loss``) against the
    baselines' losses, for the runs that have them."""
    mas = [_moving_average(r["losses"], smooth) for r in runs]
    first = mas[0] if runs and run_arm(runs[0]) == BASE else None
    bases = {r.get("seed"): ma for r, ma in zip(runs, mas) if run_arm(r) == BASE}
    out: dict[str, list[list[float]]] = {}
    for i, (r, ma) in enumerate(zip(runs, mas)):
        base = first if run_arm(r) == BASE else bases.get(r.get("seed"))
        if base is None or (i == 0 and first is not None):
            continue
        if key != "losses":
            if run_arm(r) == BASE or not r.get(key):
                continue
            ma = _moving_average(r[key], smooth)
        out.setdefault(run_arm(r), []).append([100 * (a - b) / b for a, b in zip(ma, base)])
    return out


def tightest_target(summary: list[dict[str, Any]]) -> Optional[float]:
    """The smallest target of a report's comparisons (the band the curves' plot draws), None when none has one."""
    return min((s["target"] for s in summary if s.get("target") is not None), default=None)


def _mean_curve(curves: list[list[float]]) -> list[float]:
    n = min(len(c) for c in curves)
    return [sum(c[i] for c in curves) / len(curves) for i in range(n)]


def save_curves(runs: list[dict[str, Any]], out: Path, smooth: int, title: str,
                target: Optional[float] = None) -> Optional[Path]:
    """Two panels: the loss (moving mean) of every run, one colour per recipe and a line per init seed; and each
    recipe's paired difference to the baseline of the same seed, a thin line per seed and their mean thick, with the
    +-``target`` band (a fraction). One legend entry per recipe, outside the axes, so that many runs stay readable."""
    runs = [r for r in runs if r.get("losses")]
    if not runs:
        return None
    stem = out.with_name(out.stem + "_curves")
    plt, path = pyplot_or_csv(stem, ["run", "step", "loss"],
                              ((r["model"], i + 1, v) for r in runs for i, v in enumerate(r["losses"])))
    if plt is None:
        return path
    arms = list(dict.fromkeys(run_arm(r) for r in runs))
    cmap = plt.get_cmap("tab10" if len(arms) <= 10 else "tab20")
    color = {a: ("k" if a == BASE else cmap(i % cmap.N)) for i, a in enumerate(arms)}
    seeds = {a: sorted({r.get("seed", 0) for r in runs if run_arm(r) == a}) for a in arms}
    # the legend's column grows with the longest entry (recipe:modifier names), so no label is cut at the edge
    longest = max([len(f"{a} (seeds {','.join(map(str, seeds[a]))})") for a in arms] + [48])
    legend_in, plots_in = 0.075 * longest, 11.2
    right = plots_in / (plots_in + legend_in)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(plots_in + legend_in, 4.8))
    for r in runs:
        a = run_arm(r)
        ax.plot(range(1, len(r["losses"]) + 1), _moving_average(r["losses"], smooth), lw=1.0, color=color[a],
                alpha=0.8, label=None)
        if r.get("hp_losses"):  # --conv-hp-loss: the same weights in high precision, dashed
            ax.plot(range(1, len(r["hp_losses"]) + 1), _moving_average(r["hp_losses"], smooth), lw=1.0, ls="--",
                    color=color[a], alpha=0.8)
    pairs = paired_curves(runs, smooth)
    for a, curves in paired_curves(runs, smooth, "hp_losses").items():
        for c in curves:
            ax2.plot(range(1, len(c) + 1), c, lw=1.0, ls="--", alpha=0.6, color=color[a])
    for a in arms:
        for c in pairs.get(a, []):
            ax2.plot(range(1, len(c) + 1), c, lw=0.6, alpha=0.35, color=color[a])
        if pairs.get(a):
            m = _mean_curve(pairs[a])
            ax2.plot(range(1, len(m) + 1), m, lw=2.0, color=color[a])
    if target is not None:
        ax2.axhspan(-100 * target, 100 * target, color="0.85", zorder=0, label=f"target +-{100 * target:g}%")
    ax2.axhline(0, color="k", lw=0.6)
    ax.set_title(f"train loss ({title}), moving mean of {smooth}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax2.set_title(f"vs {BASE} of the same init (%): thin per seed, thick the mean")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("relative difference of the moving mean (%)")
    def label(a: str) -> str:
        s_ = f"seed{'s' if len(seeds[a]) > 1 else ''} {','.join(map(str, seeds[a]))}"
        return f"{a}: other inits vs seed {runs[0].get('seed', 0)}" if a == BASE else f"{a} ({s_})"

    handles = [plt.Line2D([], [], color=color[a], lw=2.0, label=label(a)) for a in arms]
    if any(r.get("hp_losses") for r in runs):
        handles.append(plt.Line2D([], [], color="0.4", lw=1.0, ls="--",
                                  label="dashed: the same weights' high-precision forward"))
    handles += [h for h in ax2.get_legend_handles_labels()[0] if h.get_label().startswith("target")]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(right, 0.5), fontsize=8, frameon=False)
    path = stem.with_suffix(".png")
    fig.tight_layout(rect=(0, 0, right, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"curves: {path}")
    return path


def run_arm(r: dict[str, Any]) -> str:
    """The recipe a convergence run trained with: ``BASE`` for the baseline of any init seed (older reports name the
    baseline of another init ``baseline_seedN`` and carry no ``arm``)."""
    arm = str(r.get("arm") or r.get("recipe", ""))
    return BASE if arm.startswith(f"{BASE}_seed") else arm


def run_key(r: dict[str, Any]) -> tuple[str, int]:
    """(recipe, init seed) of a convergence run: what identifies it across reports."""
    return run_arm(r), int(r.get("seed", 0))


def run_label(arm: str, seed: int, first_seed: int) -> str:
    """A run's name in tables and plots: the recipe, with ``_seedN`` when its init is not the first seed's."""
    return arm if seed == first_seed else f"{arm}_seed{seed}"


def reference_runs(paths: Sequence[Path], report: dict[str, Any]) -> list[dict[str, Any]]:
    """The finished runs (any recipe, any init seed) of earlier convergence reports written with the same preset,
    steps and settings as ``report``, each marked with where it came from; the first report's run wins where two
    hold the same (recipe, seed). A call then runs only what they lack (a short GPU call, or none: a merge); the
    comparisons still check that inits and first batches match."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        prior = data.get("convergence", data)
        if not isinstance(prior, dict) or "runs" not in prior:
            raise SystemExit(f"--conv-reference {path}: no convergence report in it")
        for key in ("preset", "steps", "smooth", "settings"):
            if prior.get(key) != report.get(key):
                raise SystemExit(f"--conv-reference {path}: its {key} is {prior.get(key)!r}, this run's "
                                 f"{report.get(key)!r}; run it with the same settings")
        for r in prior["runs"]:
            if r.get("losses") and not r.get("truncated"):
                out.setdefault(run_key(r), {"from": str(path), **r, "arm": run_arm(r)})
    if not any(arm == BASE for arm, _ in out):
        raise SystemExit(f"--conv-reference {', '.join(map(str, paths))}: no finished baseline run in it")
    return list(out.values())


def smoothed(losses: list[float], n: int) -> float:
    """The final loss of a run: the mean of its last ``n`` finite losses (NaN when there are none)."""
    tail = [v for v in losses[-n:] if v == v]
    return sum(tail) / len(tail) if tail else float("nan")


def compare(base: dict[str, Any], r: dict[str, Any], steps: int, smooth: int, target: Optional[float],
            noise: bool, **fields: Any) -> dict[str, Any]:
    """Run ``r`` against the baseline ``base``: their final losses (``smooth`` steps) over the steps both have,
    the relative difference, whether the inits and first batches match, and ``ok`` (within ``target``, same init and
    data, all ``steps`` run). ``noise``: ``r`` is the baseline from another init, the spread the others are read
    against (no target, ``ok`` None). ``fields`` go into the result as they are."""
    s: dict[str, Any] = {**fields, "recipe": r["recipe"], "steps": steps, "target": target}
    if r.get("skipped") or base.get("skipped"):
        s["note"] = "skipped (time limit)"
        return s
    n = min(len(base["losses"]), len(r["losses"]))
    s["compared_steps"] = n
    if n == 0:
        s["note"] = r.get("error") or base.get("error") or "no losses"
        return s
    b, q = smoothed(base["losses"][:n], smooth), smoothed(r["losses"][:n], smooth)
    s.update({"baseline_final": b, "final": q, "rel_diff": (q - b) / b,
              "same_init": r.get("init_checksum") == base.get("init_checksum"),
              "same_data": r.get("first_batch_checksum") == base.get("first_batch_checksum"),
              "seconds": r.get("wall_s"), "mean_step_s": r.get("mean_step_s")})
    hp = r.get("hp_losses") or []
    if len(hp) >= n:  # --conv-hp-loss: the same weights' high-precision loss, step by step
        h = smoothed(hp[:n], smooth)
        s.update({"final_hp": h, "rel_diff_hp": (h - b) / b, "forward_cost": (q - h) / h})
    if noise:
        s["note"] = "the baseline from another init: the noise"
        s["ok"] = None
    elif n < steps:
        s["note"] = f"compared at step {n} of {steps} (truncated)"
        s["ok"] = None
    else:
        s["ok"] = target is not None and abs(s["rel_diff"]) <= target and s["same_init"] and s["same_data"]
    if r.get("error"):
        s["error"] = r["error"]
    return s


def paired_stats(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per recipe, over init seeds: the relative differences of its final loss to the baseline of the same seed
    (the ``compare`` entries), their mean, sample sd, min and max; ``ok`` when the mean is within the recipe's
    target and every pair ran all steps from the same init and data. The baselines of other seeds against the first
    (the noise) get the same statistics under ``BASE``, with no target."""
    out = []
    for arm in dict.fromkeys(s["arm"] for s in summary if "arm" in s):
        pairs = [s for s in summary if s.get("arm") == arm]
        d = {str(s["seed"]): s["rel_diff"] for s in pairs if s.get("rel_diff") is not None}  # JSON keys
        v = list(d.values())
        mean = sum(v) / len(v) if v else None
        target = pairs[0]["target"]
        complete = all(s.get("compared_steps") == s["steps"] and (arm == BASE or (s.get("same_init") and
                                                                               s.get("same_data")))
                       for s in pairs)
        extra = {}
        for key in ("rel_diff_hp", "forward_cost"):  # --conv-hp-loss runs
            hv = [s[key] for s in pairs if s.get(key) is not None]
            if hv:
                extra[f"{key}_mean"] = sum(hv) / len(hv)
        out.append({**extra, "arm": arm, "n": len(v), "rel_diff_by_seed": d, "mean": mean,
                    "sd": statistics.stdev(v) if len(v) > 1 else None, "min": min(v) if v else None,
                    "max": max(v) if v else None, "target": target,
                    "ok": None if target is None or mean is None else (abs(mean) <= target and complete)})
    return out


def _hp_note(s: dict[str, Any]) -> str:
    if s.get("rel_diff_hp") is None:
        return ""
    return (f"high-precision forward of its weights {100 * s['rel_diff_hp']:+.2f}% vs {BASE}, the quantized "
            f"forward's own cost {100 * s['forward_cost']:+.2f}%")


def convergence_table(report: dict[str, Any]) -> str:
    """The baseline's final loss, then each ``compare`` summary of ``report["summary"]`` on a line."""
    st = report["settings"]
    w = max([15] + [len(str(s["recipe"])) for s in report["summary"]])  # the recipe column (recipe:modifier names)
    lines = [f"convergence: {report['preset']}, {report['steps']} steps, precision {st['precision']}"
             + (f", lr {st['lr']:g}" if "lr" in st else "") + (f", master {st['master']}" if st.get("master") else "")
             + f", final = mean train loss of the last {report['smooth']} steps",
             f"{'recipe':{w}s} {'steps':>6s} {'final':>8s} {'baseline':>9s} {'rel diff':>9s} {'target':>7s} "
             f"{'ok':>5s} {'s/step':>7s} {'wall s':>7s}  note"]
    base = report["runs"][0] if report["runs"] else {}
    lines.append(f"{base.get('recipe', BASE):{w}s} {len(base.get('losses', [])):6d} "
                 f"{fmt_cell(smoothed(base.get('losses', []), report['smooth']), '8.4f')} "
                 f"{'':9s} {'':9s} {'':7s} {'':5s} {fmt_cell(base.get('mean_step_s'), '7.3f')} "
                 f"{fmt_cell(base.get('wall_s'), '7.0f')}  {base.get('skipped') or base.get('error') or ''}")
    for s in report["summary"]:
        rd = s.get("rel_diff")
        lines.append(f"{s['recipe']:{w}s} {s.get('compared_steps', 0):6d} {fmt_cell(s.get('final'), '8.4f')} "
                     f"{fmt_cell(s.get('baseline_final'), '9.4f')} "
                     f"{'-' if rd is None else format(100 * rd, '+8.2f') + '%':>9s} "
                     f"{'' if s['target'] is None else format(100 * s['target'], '6.0f') + '%':>7s} "
                     f"{str(s.get('ok', '-')):>5s} {fmt_cell(s.get('mean_step_s'), '7.3f')} "
                     f"{fmt_cell(s.get('seconds'), '7.0f')}  {s.get('note', '')} {s.get('error', '')}"
                     f"{_hp_note(s)}"
                     f"{'' if s.get('same_init', True) or s['target'] is None else ' DIFFERENT INIT'}"
                     f"{'' if s.get('same_data', True) else ' DIFFERENT DATA'}")
    if any(p["n"] > 1 for p in report.get("paired", [])):
        lines.append(f"over init seeds (each recipe vs the baseline of its seed; {BASE}: the other inits vs the "
                     "first):")
        lines.append(f"  {'recipe':{w}s} {'n':>2s} {'mean':>8s} {'sd':>7s} {'min':>8s} {'max':>8s} "
                     f"{'target':>7s} {'ok':>5s}")
        for p in report["paired"]:
            pct = [("-" if p[k] is None else format(100 * p[k], ".2f" if k == "sd" else "+.2f") + "%")
                   for k in ("mean", "sd", "min", "max")]
            hp = (f"  high-precision forward {100 * p['rel_diff_hp_mean']:+.2f}%, quantized forward's cost "
                  f"{100 * p['forward_cost_mean']:+.2f}%" if p.get("rel_diff_hp_mean") is not None else "")
            lines.append(f"  {p['arm']:{w}s} {p['n']:2d} {pct[0]:>8s} {pct[1]:>7s} {pct[2]:>8s} {pct[3]:>8s} "
                         f"{'' if p['target'] is None else format(100 * p['target'], '6.0f') + '%':>7s} "
                         f"{str(p['ok']):>5s}{hp}")
    return "\n".join(lines)
