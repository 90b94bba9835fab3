"""Timing of the suites: one Lightning callback for training steps, a stopwatch for plain loops, and a CUDA-event
timer for kernels and layers.

A training step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` with a device synchronisation at
both ends (forward + backward + optimizer step, the batch already on the device); the first ``warmup`` steps are
recorded but left out of the timed ones. Kernels are timed with CUDA events around each call (perf_counter on CPU),
the median reported.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Optional

import lightning as L
import torch

from bench.core.device import allocated_gib, peak_gib, sync
from bench.core.text import log


class StepTimer(L.Callback):
    """``train_loss`` of every optimizer step, the wall time of every batch and the first batch's token checksum
    (two runs that saw the same data have the same one). With ``deadline`` (a ``time.perf_counter()`` value, the
    suite's ``--time-limit``) fit stops after the first step that ends past it; ``stopped_after`` says when."""

    def __init__(self, device: torch.device, warmup: int = 0, deadline: Optional[float] = None) -> None:
        self.device, self.warmup, self.deadline = device, warmup, deadline
        self.losses: list[float] = []
        self.times: list[float] = []
        self.first_batch_checksum: Optional[int] = None
        self.stopped_after: Optional[int] = None
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first_batch_checksum is None:
            self.first_batch_checksum = int(batch["input_ids"].sum())
        sync(self.device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sync(self.device)
        self.times.append(time.perf_counter() - self._t0)
        v = trainer.callback_metrics.get("train_loss")
        self.losses.append(float("nan") if v is None else float(v))
        if self.deadline is not None and time.perf_counter() > self.deadline and not trainer.should_stop:
            self.stopped_after = trainer.global_step
            log(f"  --time-limit: stopping after {trainer.global_step} steps")
            trainer.should_stop = True

    def timed(self, end: Optional[int] = None) -> list[float]:
        """The step times after the warmup (up to step ``end``)."""
        return self.times[:end][self.warmup:]


class Stopwatch:
    """``with Stopwatch(device) as w: ...`` then ``w.seconds``: wall time with a device synchronisation at both ends
    (a plain training loop's step, timed as ``StepTimer`` times a Lightning one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        sync(self.device)
        self.seconds = time.perf_counter() - self._t0


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> dict[str, Any]:
    """Median (and min / mean) ms of ``step`` after ``warmup`` untimed calls: CUDA events around each call on CUDA,
    perf_counter on CPU; peak memory over the whole run."""
    base = allocated_gib(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    sync(device)
    times: list[float] = []
    if device.type == "cuda":
        events = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            events.append((s, e))
        sync(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = peak_gib(device)
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_mean": sum(times) / len(times),
            "iters": iters, "warmup": warmup, "times_ms": times, "peak_gib": peak,
            "allocated_before_gib": base,
            "peak_above_start_gib": None if peak is None or base is None else peak - base}


def loss_checks(losses: list[float]) -> dict[str, Any]:
    """Finite, and the mean of the last 5 (fewer for short runs) below the first."""
    if not losses:
        return {"finite": False, "falling": False, "ok": False, "note": "no losses recorded"}
    finite = all(math.isfinite(x) for x in losses)
    tail = losses[-min(5, max(1, len(losses) - 1)) :]
    tail_mean = sum(tail) / len(tail)
    falling = finite and len(losses) > 1 and tail_mean < losses[0]
    return {"finite": finite, "falling": falling, "tail_mean": tail_mean, "ok": bool(finite and falling)}
