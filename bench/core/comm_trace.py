"""What a profiled multi-GPU step's trace says about communication: every GPU kernel of torch.profiler's Chrome
trace, the NCCL all-to-all (and all NCCL) time per step, and the part of it that no compute kernel overlaps
("exposed": the union of the communication kernels' intervals minus its intersection with the union of every
other kernel's, on any stream), averaged over the ranks. Used by ``python -m bench scale``."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any, Optional

# kernel names (Chrome trace, "cat": "kernel"): NCCL collectives, and among them the all-to-all (grouped send/recv)
NCCL_KERNEL = re.compile(r"nccl", re.IGNORECASE)
A2A_KERNEL = re.compile(r"sendrecv|alltoall|all_to_all", re.IGNORECASE)


def trace_kernels(trace: Path) -> list[tuple[str, str, float, float]]:
    """(name, stream, start_us, end_us) of every GPU kernel of a Chrome trace (torch.profiler's export)."""
    data = json.loads(Path(trace).read_text())
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    out = []
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel":
            start = float(e["ts"])
            out.append((str(e.get("name", "")), str((e.get("args") or {}).get("stream", e.get("tid"))), start,
                        start + float(e.get("dur", 0.0))))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        elif e > s:
            merged.append((s, e))
    return merged


def _length(merged: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of disjoint sorted intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_exposure(kernels: list[tuple[str, str, float, float]], steps: int) -> dict[str, Any]:
    """All-to-all (and all NCCL) kernel time per step and the part of it no compute kernel overlaps; see the module
    docstring (and ``bench/scale.py``'s)."""
    comm = [k for k in kernels if NCCL_KERNEL.search(k[0])]
    comm_streams = {k[1] for k in comm}
    # every other kernel: one on a communication kernel's own stream cannot run beside it, so the stream need not be
    # looked at (and NCCL may run a collective on the compute stream)
    compute = _union([(s, e) for name, _, s, e in kernels if not NCCL_KERNEL.search(name)])
    out: dict[str, Any] = {"profiled_steps": steps, "kernels": len(kernels), "comm_kernels": len(comm),
                           "comm_streams": sorted(comm_streams), "compute_ms_per_step": _length(compute) / 1e3 / steps}
    for key, sel in (("a2a", [k for k in comm if A2A_KERNEL.search(k[0])]), ("nccl", comm)):
        busy = _union([(s, e) for _, _, s, e in sel])
        total = _length(busy)
        exposed = total - _overlap(busy, compute)
        out[key] = {"kernels": len(sel), "ms_per_step": total / 1e3 / steps,
                    "exposed_ms_per_step": exposed / 1e3 / steps, "exposed_share": exposed / total if total else None}
    by_name: dict[str, float] = {}
    for name, _, s, e in comm:
        short = name.split("(")[0]
        by_name[short] = by_name.get(short, 0.0) + (e - s) / 1e3 / steps
    out["comm_ms_per_step_by_kernel"] = by_name
    if not kernels:
        out["note"] = "no GPU kernel in the trace (a CPU run): nothing to measure"
    return out


def analyse_trace(trace: Path, steps: int) -> dict[str, Any]:
    return {"trace": str(trace), **comm_exposure(trace_kernels(trace), max(steps, 1))}


def profile_summary(profiles: list[dict[str, Any]], step_time_s: Optional[float]) -> dict[str, Any]:
    """Rank means of the all-to-all figures (None where no rank saw an all-to-all kernel); every rank's analysis
    kept; ``error`` when a rank's trace could not be written or read."""
    out: dict[str, Any] = {"by_rank": profiles}
    errors = [f"rank {i}: {p['error']}" for i, p in enumerate(profiles) if p.get("error")]
    if errors:
        out["error"] = "; ".join(errors)
    seen = [p for p in profiles if p.get("a2a", {}).get("kernels")]

    def mean(key: str, field: str) -> Optional[float]:
        vals = [p[key][field] for p in seen if p[key][field] is not None]
        return statistics.fmean(vals) if vals else None

    out.update(a2a_ms_per_step=mean("a2a", "ms_per_step"), a2a_exposed_ms_per_step=mean("a2a", "exposed_ms_per_step"),
               a2a_exposed_share=mean("a2a", "exposed_share"), nccl_exposed_share=mean("nccl", "exposed_share"),
               a2a_exposed_share_max=max((p["a2a"]["exposed_share"] for p in seen), default=None))
    exposed = out["a2a_exposed_ms_per_step"]
    out["a2a_exposed_step_share"] = exposed / (1e3 * step_time_s) if exposed is not None and step_time_s else None
    if not seen and not errors:
        out["note"] = "no all-to-all kernel in any rank's trace" + (
            " (a CPU run has no GPU kernels)" if all(p.get("kernels") == 0 for p in profiles) else "")
    return out
