"""The FP8 crossover table: where, per GEMM shape and recipe, FP8 forward + backward (quantization included) is at
least as fast as bf16. Written by ``bench/fp8_crossover.py`` on one GPU, shipped per architecture as
``lightning_moe/lowp/crossover/<arch>.json`` (``sm90`` for H100 / H200), read by
:class:`~lightning_moe.callbacks.LowPrecisionTraining` (``recipe="auto"``) once, when the model is built.

Schema (``SCHEMA`` = 1)::

    {"schema": 1, "arch": "sm90", "gpu": "...", "torch": "...", "torchao": "...", "date": "...", "command": "...",
     "m_grid": [64, 128, ..., 16384],
     "entries": [{"kind": "dense" | "grouped", "N": int, "K": int, "groups": int, "recipe": str,
                  "names": [...],                    # which preset GEMMs have this shape (for the reader)
                  "ratios": {"<M>": bf16_ms / fp8_ms, ...},   # measured Ms only
                  "groups_at": {"<M>": int},          # grouped: experts actually run at M (capped by memory)
                  "crossover_m": int | null,
                  "mode": "eager" | "compiled"}]}     # how the GEMM ran (absent: eager)

``M`` is the rows of one GEMM: tokens of the micro-batch for a dense linear, rows *per expert* for a grouped one
(``N`` output, ``K`` contraction: gate / up ``N=F, K=D``, down ``N=D, K=F``). ``crossover_m`` is the smallest
measured M from which every larger measured M has a ratio of at least ``min_speedup`` (1.0 when written): a noisy
dip above it moves the crossover up, never down, so a table decision does not lose speed at the measured shapes.

``mode``: a dense linear inside a region that ``MoEParallelStrategy(compile=...)`` compiles runs torchao's
``Float8Linear`` under inductor (which fuses its quantization into the neighbouring kernels), anywhere else our
eager FP8 linear; the two cost differently, so a GEMM is looked up only among entries measured the way it will run
(:attr:`Gemm.mode`). A compiled GEMM whose shape has no compiled entry stays in high precision.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

__all__ = ["SCHEMA", "KINDS", "MODES", "Gemm", "CrossoverTable", "crossover_m", "device_arch", "model_gemms",
           "shipped_table_path", "BENCH_COMMAND"]

SCHEMA = 1
KINDS = ("dense", "grouped")
MODES = ("eager", "compiled")
BENCH_COMMAND = "python -m bench fp8_crossover --time-limit 540"


@dataclass(frozen=True)
class Gemm:
    """One GEMM of a model: ``name`` the module (dense) or ``<experts>.w1_w3`` / ``<experts>.w2`` (grouped), the
    local (per-rank) N / K, the local experts it is grouped over (1 for dense), and whether it runs in a compiled
    region (``mode``: the table entries it is looked up among)."""

    name: str
    kind: str
    N: int
    K: int
    groups: int = 1
    mode: str = "eager"


def device_arch(device: Union[str, torch.device, None] = None) -> str:
    """``sm<major><minor>`` of a CUDA device (``sm90`` for H100 / H200), ``cpu`` otherwise."""
    device = torch.device("cuda" if device is None and torch.cuda.is_available() else (device or "cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def shipped_table_path(arch: str) -> Path:
    """Where the package keeps the table of ``arch`` (it may not exist)."""
    return Path(str(resources.files("lightning_moe.lowp"))) / "crossover" / f"{arch}.json"


def crossover_m(ratios: dict[int, float], min_speedup: float = 1.0) -> Optional[int]:
    """Smallest measured M from which every larger measured M has ratio >= ``min_speedup`` (None: never)."""
    best = None
    for m in sorted(ratios, reverse=True):
        if ratios[m] < min_speedup:
            break
        best = m
    return best


def model_gemms(model: nn.Module, *, ep: int = 1, etp: int = 1,
                compiled: Optional[Callable[[str], bool]] = None) -> list[Gemm]:
    """Every nn.Linear (dense, its global shape) and every grouped-GEMM experts module (two grouped GEMMs: gate /
    up and down, local shapes under ``ep`` / ``etp``) of ``model``; names are module names. ``compiled(name)``: the
    dense linear runs inside a compiled region (mode "compiled"; the experts always run eagerly)."""
    from lightning_moe.moe.experts import GroupedExperts

    out: list[Gemm] = []
    for name, m in model.named_modules():
        if isinstance(m, GroupedExperts):
            E, F, D = m.w1.shape
            e, f = max(1, E // ep), max(1, F // etp)
            out += [Gemm(f"{name}.w1_w3", "grouped", f, D, e), Gemm(f"{name}.w2", "grouped", D, f, e)]
        elif isinstance(m, nn.Linear):
            mode = "compiled" if compiled is not None and compiled(name) else "eager"
            out.append(Gemm(name, "dense", m.out_features, m.in_features, mode=mode))
    return out


class CrossoverTable:
    """A loaded table (see the module docstring) and its lookups."""

    def __init__(self, data: dict[str, Any], source: str = "<dict>") -> None:
        if data.get("schema") != SCHEMA or not isinstance(data.get("entries"), list):
            raise ValueError(f"{source}: not an FP8 crossover table of schema {SCHEMA} (remake it with "
                             f"`{BENCH_COMMAND}`)")
        self.data, self.source = data, source
        self._by_shape: dict[tuple[str, int, int, str], list[dict[str, Any]]] = {}
        for e in data["entries"]:
            if e["kind"] not in KINDS:
                raise ValueError(f"{source}: entry kind {e['kind']!r} is not one of {KINDS}")
            mode = e.get("mode", "eager")
            if mode not in MODES:
                raise ValueError(f"{source}: entry mode {mode!r} is not one of {MODES}")
            self._by_shape.setdefault((e["kind"], int(e["N"]), int(e["K"]), mode), []).append(e)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "CrossoverTable":
        path = Path(path)
        return cls(json.loads(path.read_text()), str(path))

    @property
    def arch(self) -> str:
        return str(self.data.get("arch"))

    @property
    def recipes(self) -> list[str]:
        return sorted({e["recipe"] for e in self.data["entries"]})

    def entry(self, gemm: Gemm, recipe: str) -> Optional[dict[str, Any]]:
        """The entry of ``gemm``'s shape for ``recipe``: exact (kind, N, K, mode); among several, the one measured
        over the closest number of groups (log scale). None when the shape was not measured (that way)."""
        cands = [e for e in self._by_shape.get((gemm.kind, gemm.N, gemm.K, gemm.mode), []) if e["recipe"] == recipe]
        if not cands:
            return None
        return min(cands, key=lambda e: abs(math.log(max(1, int(e["groups"]))) - math.log(max(1, gemm.groups))))

    @staticmethod
    def ratio_at(entry: dict[str, Any], m: float) -> Optional[float]:
        """Measured ratio at the largest measured M <= ``m`` (the smallest measured M when ``m`` is below the grid):
        a step function, so the expectation never rests on an M larger than the one the model runs."""
        ratios = {int(k): float(v) for k, v in entry["ratios"].items()}
        if not ratios:
            return None
        below = [k for k in ratios if k <= m]
        return ratios[max(below)] if below else ratios[min(ratios)]

    def choose(self, gemm: Gemm, m: float, recipes: list[str],
               min_speedup: float = 1.0) -> tuple[Optional[str], Optional[float], str]:
        """(recipe or None for bf16, expected ratio, why) for ``gemm`` run with ``m`` rows: the recipe with the best
        expected ratio among those whose crossover (at ``min_speedup``) is <= ``m``."""
        paying: list[tuple[float, str]] = []
        best_ratio: Optional[float] = None
        for recipe in recipes:
            e = self.entry(gemm, recipe)
            if e is None:
                continue
            r = self.ratio_at(e, m)
            if r is None:
                continue
            best_ratio = r if best_ratio is None else max(best_ratio, r)
            cm = crossover_m({int(k): float(v) for k, v in e["ratios"].items()}, min_speedup)
            if cm is not None and m >= cm:  # then r, measured at an M in [cm, m], is >= min_speedup
                paying.append((r, recipe))
        if best_ratio is None:
            return None, None, "shape not in table"
        if paying:
            r, recipe = max(paying)
            return recipe, r, "table"
        return None, best_ratio, "below crossover"
