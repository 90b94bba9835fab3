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
    suite's ``--time-limit``) fit stops after the first step that ends past it; ``stopped_after`` says when.
    ``marks``: when the fit reached each of its stages (``perf_counter()`` values; :func:`fit_phases` turns them into
    durations), and ``between_s`` the time between one step's end and the next one's start (data loading, the
    trainer's own bookkeeping): where a run's time outside its steps goes."""

    def __init__(self, device: torch.device, warmup: int = 0, deadline: Optional[float] = None) -> None:
        self.device, self.warmup, self.deadline = device, warmup, deadline
        self.losses: list[float] = []
        self.times: list[float] = []
        self.first_batch_checksum: Optional[int] = None
        self.stopped_after: Optional[int] = None
        self.marks: dict[str, float] = {}
        self.between_s = 0.0
        self._t0 = 0.0

    def _mark(self, stage: str) -> None:
        self.marks.setdefault(stage, time.perf_counter())

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:  # before configure_model (the build)
        self._mark("setup")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:  # model built and on the device, optimizers made
        self._mark("fit_start")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first_batch_checksum is None:
            self.first_batch_checksum = int(batch["input_ids"].sum())
        sync(self.device)
        self._t0 = time.perf_counter()
        if "last_batch_end" in self.marks:
            self.between_s += self._t0 - self.marks["last_batch_end"]
        self.marks.setdefault("first_batch_start", self._t0)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sync(self.device)
        now = time.perf_counter()
        self.times.append(now - self._t0)
        v = trainer.callback_metrics.get("train_loss")
        self.losses.append(float("nan") if v is None else float(v))
        if self.deadline is not None and time.perf_counter() > self.deadline and not trainer.should_stop:
            self.stopped_after = trainer.global_step
            log(f"  --time-limit: stopping after {trainer.global_step} steps")
            trainer.should_stop = True
        self.marks["last_batch_end"] = now  # this hook's own work counts as time between the steps

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._mark("train_end")

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:  # after the strategy's teardown
        self._mark("fit_end")

    def timed(self, end: Optional[int] = None) -> list[float]:
        """The step times after the warmup (up to step ``end``)."""
        return self.times[:end][self.warmup:]


def fit_phases(rec: StepTimer, start: float, returned: float) -> dict[str, float]:
    """Seconds of each stage of a timed Lightning fit from ``start`` (``perf_counter()`` before the Trainer was made)
    to ``returned`` (after ``fit``): ``before_fit`` (Trainer, data module), ``build`` (the model built, initialised
    and set up with its optimizers), ``to_first_step`` (data loaders, sanity checks), ``steps`` (sum of the step
    times), ``between_steps``, ``after_last_step`` (the fit loop's end), ``strategy_teardown`` (e.g. Lightning moving
    a CUDA model to the CPU), ``after_fit`` (the remaining hooks). A stage whose marks were not reached is left out (a
    fit that failed); the stages present add up to ``returned - start`` when all were reached."""
    m = rec.marks
    t = {"start": start, **m, "returned": returned}
    stages = [("before_fit", "start", "setup"), ("build", "setup", "fit_start"),
              ("to_first_step", "fit_start", "first_batch_start"), ("after_last_step", "last_batch_end", "train_end"),
              ("strategy_teardown", "train_end", "fit_end"), ("after_fit", "fit_end", "returned")]
    out = {name: t[b] - t[a] for name, a, b in stages if a in t and b in t}
    if "first_batch_start" in m and "last_batch_end" in m:
        out["steps"], out["between_steps"] = float(sum(rec.times)), rec.between_s
    return out


def phases_line(phases: dict[str, float]) -> str:
    """One log line of :func:`fit_phases`' stages other than the steps, the largest first (those that round to 0.1 s or more)."""
    rest = sorted(((k, v) for k, v in phases.items() if k != "steps" and v >= 0.05), key=lambda kv: -kv[1])
    return "  outside the steps: " + ", ".join(f"{k} {v:.1f} s" for k, v in rest)


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
