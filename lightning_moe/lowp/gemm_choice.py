"""Per-GEMM precision choice (``LowPrecisionTraining(recipe="auto")``): for every GEMM of the model, FP8 where the
crossover table (:mod:`lightning_moe.lowp.crossover`) says it pays at the expected M, bf16 elsewhere; decided once at
model build (DESIGN invariant 13), with explicit overrides (``keep_bf16`` wins over ``force``, ``force`` over the
table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_moe.lowp.crossover import CrossoverTable, Gemm

__all__ = ["GemmDecision", "decide", "decision_table", "FORCE_DEFAULT_RECIPE"]

FORCE_DEFAULT_RECIPE = "fp8_rowwise"  # a forced GEMM whose shape the table lacks


@dataclass(frozen=True)
class GemmDecision:
    """What one GEMM runs in: ``recipe`` None = the run's precision (no conversion, no cast); ``m`` the rows it is
    expected to see; ``ratio`` the table's expected bf16_time / fp8_time at ``m`` (None where not measured)."""

    gemm: Gemm
    m: Optional[float]
    recipe: Optional[str]
    ratio: Optional[float]
    why: str  # "table", "below crossover", "shape not in table", "no table", "forced", "kept", "dims"


def decide(gemms: Sequence[Gemm], table: Optional[CrossoverTable], m_of: Callable[[Gemm], Optional[float]], *,
           recipes: Sequence[str], kept: Callable[[str], bool], forced: Callable[[str], bool],
           fits: Callable[[str, Gemm], bool], min_speedup: float = 1.0) -> list[GemmDecision]:
    """One decision per GEMM. ``m_of`` gives the expected rows; ``fits(recipe, gemm)`` whether the recipe's alignment
    allows the shape. A forced GEMM takes the recipe with the best measured ratio at its M (fitting its dims),
    else :data:`FORCE_DEFAULT_RECIPE`."""
    out = []
    for g in gemms:
        m = m_of(g)
        if kept(g.name):
            out.append(GemmDecision(g, m, None, None, "kept"))
            continue
        if forced(g.name):
            ranked = []
            if table is not None and m is not None:
                for r in recipes:
                    e = table.entry(g, r)
                    ratio = None if e is None else table.ratio_at(e, m)
                    if ratio is not None and fits(r, g):
                        ranked.append((ratio, r))
            if ranked:
                ratio, recipe = max(ranked)
                out.append(GemmDecision(g, m, recipe, ratio, "forced"))
            elif fits(FORCE_DEFAULT_RECIPE, g):
                out.append(GemmDecision(g, m, FORCE_DEFAULT_RECIPE, None, "forced"))
            else:
                out.append(GemmDecision(g, m, None, None, "dims"))
            continue
        if table is None:
            out.append(GemmDecision(g, m, None, None, "no table"))
            continue
        assert m is not None, "the caller resolves M whenever a table is used"
        recipe, ratio, why = table.choose(g, m, [r for r in recipes if fits(r, g)], min_speedup)
        out.append(GemmDecision(g, m, recipe, ratio, why))
    return out


def _pattern(name: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)


def decision_table(decisions: Sequence[GemmDecision]) -> str:
    """Compact text: one row per (module pattern with layer indices as ``*``, shape, M, choice, ratio, why)."""
    rows: dict[tuple, int] = {}
    for d in decisions:
        g = d.gemm
        key = (_pattern(g.name), g.kind, g.N, g.K, g.groups, d.m, d.recipe or "bf16",
               None if d.ratio is None else round(d.ratio, 2), d.why)
        rows[key] = rows.get(key, 0) + 1
    lines = [f"{'module':40s} {'kind':7s} {'N':>6s} {'K':>6s} {'E':>4s} {'M':>7s} {'choice':15s} {'ratio':>6s} "
             f"{'count':>5s}  why"]
    for (pat, kind, n, k, e, m, choice, ratio, why), count in rows.items():
        lines.append(f"{pat:40s} {kind:7s} {n:6d} {k:6d} {e:4d} {'-' if m is None else format(m, '7.0f'):>7s} "
                     f"{choice:15s} {'-' if ratio is None else format(ratio, '6.2f'):>6s} {count:5d}  {why}")
    return "\n".join(lines)
