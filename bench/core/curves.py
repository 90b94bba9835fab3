"""Loss curves of convergence runs (``bench/low_precision.py``, ``bench/precision_seeds.py``): a moving average and a
PNG through matplotlib (the ``bench`` extra), or the curves' data as CSV where matplotlib is missing."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from bench.core.text import log

BASE = "baseline"  # the run the others are compared with (bench/low_precision.py's name for it)


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


def save_curves(runs: list[dict[str, Any]], out: Path, smooth: int, title: str) -> Optional[Path]:
    runs = [r for r in runs if r.get("losses")]
    if not runs:
        return None
    stem = out.with_name(out.stem + "_curves")
    plt, path = pyplot_or_csv(stem, ["run", "step", "loss"],
                              ((r["model"], i + 1, v) for r in runs for i, v in enumerate(r["losses"])))
    if plt is None:
        return path
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    base = _moving_average(runs[0]["losses"], smooth) if runs[0]["recipe"] == BASE else None
    for r in runs:
        steps = range(1, len(r["losses"]) + 1)
        ma = _moving_average(r["losses"], smooth)
        line, = ax.plot(steps, ma, lw=1.4, label=f"{r['recipe']} (moving mean of {smooth})")
        ax.plot(steps, r["losses"], lw=0.5, alpha=0.3, color=line.get_color())
        if base is not None and r["recipe"] != BASE:
            n = min(len(ma), len(base))
            ax2.plot(range(1, n + 1), [100 * (a - b) / b for a, b in zip(ma[:n], base[:n])], lw=1.2,
                     color=line.get_color(), label=r["recipe"])
    ax.set_title(f"train loss ({title})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set_title(f"moving mean vs {BASE}, %")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("relative difference (%)")
    if ax2.lines[1:]:
        ax2.legend()
    path = stem.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"curves: {path}")
    return path


def reference_runs(path: Path, report: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The baseline run and the noise runs (``baseline_seed*``) of an earlier convergence report written with the same
    preset, steps and settings as ``report``, e.g. to run one more recipe against them in a short GPU call. Each is
    marked with where it came from; the comparison still checks that the inits and first batches match."""
    data = json.loads(Path(path).read_text())
    prior = data.get("convergence", data)
    if not isinstance(prior, dict) or "runs" not in prior:
        raise SystemExit(f"--conv-reference {path}: no convergence report in it")
    for key in ("preset", "steps", "smooth", "settings"):
        if prior.get(key) != report.get(key):
            raise SystemExit(f"--conv-reference {path}: its {key} is {prior.get(key)!r}, this run's "
                             f"{report.get(key)!r}; run it with the same settings")
    base = [r for r in prior["runs"] if r.get("recipe") == BASE and r.get("losses")]
    if not base:
        raise SystemExit(f"--conv-reference {path}: no baseline run with losses in it")
    noise = [r for r in prior["runs"] if str(r.get("recipe", "")).startswith(f"{BASE}_seed") and r.get("losses")]
    return ({**base[0], "from": str(path)}, [{**r, "from": str(path)} for r in noise])
