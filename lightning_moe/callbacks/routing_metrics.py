"""Routing-health numbers of a window of optimizer steps, computed on the host from the window's summed counts.

Legend: L MoE layers, E experts, C = E + 5 columns of a packed window row (see :data:`SCALARS`).
Pure functions (no Lightning, no logger): :class:`~lightning_moe.callbacks.LoadBalanceMonitor` calls them on log
steps, tests call them on numbers they build themselves.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_moe.moe.record import ROUTING_SCALARS

__all__ = ["SCALARS", "pack_step", "window_metrics", "load_heatmap"]

#: the per-layer scalars packed after the E expert counts (RoutingRecord's): num_dropped, num_tokens, aux_loss, z_loss,
#: entropy; summed over the window (losses: over micro-batches; entropy: over valid tokens)
SCALARS = ROUTING_SCALARS


def pack_step(routing: dict) -> Tensor:
    """One step's :class:`~lightning_moe.moe.record.RoutingRecord` of every layer as a [L, C] fp32 tensor on their device (no host sync)."""
    rows = [torch.cat([r.tokens_per_expert.reshape(-1).float(), torch.stack([getattr(r, s).float() for s in SCALARS])])
            for r in routing.values()]
    return torch.stack(rows)


def _layer_metrics(counts_E: Tensor, scalars: dict[str, float], micro_batches: int,
                   bias_E: Optional[Tensor], per_expert: bool) -> dict[str, float]:
    E = counts_E.numel()
    kept = float(counts_E.sum())
    dropped = scalars["num_dropped"]
    m: dict[str, float] = {
        "dead_experts": float((counts_E == 0).sum()),
        "dropped_fraction": dropped / (kept + dropped) if kept + dropped > 0 else 0.0,
        "aux_loss": scalars["aux_loss"] / max(micro_batches, 1),
        "z_loss": scalars["z_loss"] / max(micro_batches, 1),
    }
    if kept > 0:
        mean = kept / E
        m["max_load_ratio"] = float(counts_E.max()) / mean
        m["min_load_ratio"] = float(counts_E.min()) / mean
        m["load_cv"] = float(counts_E.std(unbiased=False)) / mean
    if scalars["num_tokens"] > 0 and math.isfinite(scalars["entropy"]):
        m["router_entropy"] = scalars["entropy"] / scalars["num_tokens"]
    if bias_E is not None:
        m["expert_bias_mean"] = float(bias_E.mean())
        m["expert_bias_max_abs"] = float(bias_E.abs().max())
    if per_expert and kept > 0:
        for j, f in enumerate((counts_E / kept).tolist()):
            m[f"expert{j}/load_fraction"] = f
    return m


def window_metrics(layer_ids: Sequence[int], window_LC: Tensor, micro_batches: int, window_steps: int,
                   bias_LE: Optional[Tensor] = None, per_expert: bool = False) -> dict[str, float]:
    """``moe/layer{i}/...`` and model-wide ``moe/...`` metrics of a window (host tensors, float64 preferred).

    ``window_LC``: per layer the kept assignments per expert and the :data:`SCALARS`, summed over the window's
    steps and every rank; ``micro_batches``: micro-batches in the window (the losses are means per micro-batch);
    ``bias_LE``: the current expert biases (None without expert bias).
    """
    assert window_LC.dim() == 2 and window_LC.shape[0] == len(layer_ids), (window_LC.shape, layer_ids)
    E = window_LC.shape[1] - len(SCALARS)
    out: dict[str, float] = {}
    per_layer: dict[int, dict[str, float]] = {}
    for row, idx in enumerate(layer_ids):
        scalars = dict(zip(SCALARS, window_LC[row, E:].tolist()))
        bias = bias_LE[row] if bias_LE is not None else None
        per_layer[idx] = m = _layer_metrics(window_LC[row, :E], scalars, micro_batches, bias, per_expert)
        out.update({f"moe/layer{idx}/{k}": v for k, v in m.items()})
    ratios = {idx: m["max_load_ratio"] for idx, m in per_layer.items() if "max_load_ratio" in m}
    if ratios:
        worst = max(ratios, key=ratios.__getitem__)
        out["moe/max_load_ratio"] = ratios[worst]
        out["moe/worst_layer"] = float(worst)
        out["moe/load_cv_mean"] = sum(m["load_cv"] for m in per_layer.values() if "load_cv" in m) / len(ratios)
    entropies = [m["router_entropy"] for m in per_layer.values() if "router_entropy" in m]
    if entropies:
        out["moe/router_entropy_mean"] = sum(entropies) / len(entropies)
    kept, dropped = float(window_LC[:, :E].sum()), float(window_LC[:, E].sum())
    out["moe/dropped_fraction"] = dropped / (kept + dropped) if kept + dropped > 0 else 0.0
    out["moe/dead_experts"] = sum(m["dead_experts"] for m in per_layer.values())
    out["moe/window_steps"] = float(window_steps)
    return out


# ---- heatmap --------------------------------------------------------------------------------------------------------

#: colour stops of a diverging map over log2(load / mean load) in [-RANGE, RANGE]: blue (cold), white, red (hot)
HEATMAP_LOG2_RANGE = 2.0
_STOPS = torch.tensor([[33.0, 102, 172], [247, 247, 247], [178, 24, 43]])


def load_heatmap(counts_LE: Tensor, min_width: int = 512, min_height: int = 128) -> Tensor:
    """An RGB uint8 image [H, W, 3] of the layers x experts load (row i = i-th MoE layer, top to bottom; column j =
    expert j). Colour: log2(count / the layer's mean count) from -2 (blue, a quarter of the mean) through white
    (balanced) to +2 (red, four times the mean), clipped; dead experts (no token) are black. Cells are enlarged to
    integer sizes so the image is at least about ``min_width`` x ``min_height`` pixels. No matplotlib needed."""
    counts_LE = counts_LE.double()
    L, E = counts_LE.shape
    mean_L1 = counts_LE.mean(dim=1, keepdim=True).clamp(min=1e-12)
    t = (torch.log2(counts_LE.clamp(min=1e-12) / mean_L1).clamp(-HEATMAP_LOG2_RANGE, HEATMAP_LOG2_RANGE)
         / HEATMAP_LOG2_RANGE + 1) / 2  # 0 .. 1, 0.5 = balanced
    lo_LE = t < 0.5
    w = torch.where(lo_LE, t * 2, t * 2 - 1).unsqueeze(-1)  # position within the half
    lo = lo_LE.unsqueeze(-1)
    stops = _STOPS.double()
    rgb = torch.where(lo, stops[0] + w * (stops[1] - stops[0]), stops[1] + w * (stops[2] - stops[1]))
    rgb[counts_LE == 0] = 0.0
    cell_w, cell_h = -(-min_width // E), -(-min_height // L)
    img = rgb.round().to(torch.uint8).repeat_interleave(cell_h, dim=0).repeat_interleave(cell_w, dim=1)
    return img.contiguous()
