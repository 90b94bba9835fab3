"""How a convergence call of ``bench/low_precision.py`` splits its ``--time-limit`` among its runs under
``--conv-share proportional`` (the default, ``in-order``, gives each run all that is left): each run's share
of what is left goes by its expected cost (measured once runs of its kind have finished), and Lightning's
``max_time`` for it leaves free the time the run spends outside its steps."""

from __future__ import annotations

from typing import Any

from bench.core.curves import BASE, REPEAT
from lightning_moe.callbacks.low_precision import AUTO

QUANTIZED_RUN_COST = 2.5  # a forced or emulated recipe's run relative to the baseline's, until measured
MARGIN_S = {"cuda": 15.0, "cpu": 3.0}  # per run: model build, data setup and teardown, until measured
# bench8 at full size on a GPU spends 40-76 s outside its steps (H200 runs of issue 23: building 5.6 B parameters with
# fp32 masters, teardown), which the fixed margin let the first run of a call overrun
BENCH8_MARGIN_S = 60.0
# the first step of a process's first run of a kind compiles its Triton kernels (and, quantizing, autotunes torchao's):
# on a fresh GPU machine bench8's took 45-88 s quantizing (blockwise 146-212 s) and 9-14 s in bf16, 6-20 s once cached
# (issue 23's runs, ``step_times_s``); inside max_time, so the first run of a call stopped at step 69-124 of 300
BENCH8_FIRST_STEP_S = {True: 75.0, False: 12.0}  # quantizing, bf16 program


def _bench8_on_gpu(preset: str, small: bool, device_type: str) -> bool:
    return preset == "bench8" and not small and device_type == "cuda"


def first_margin_s(preset: str, small: bool, device_type: str) -> float:
    """What a call's first run must leave outside Lightning's ``max_time`` before any run has been measured."""
    return BENCH8_MARGIN_S if _bench8_on_gpu(preset, small, device_type) else MARGIN_S[device_type]


def first_step_s(preset: str, small: bool, device_type: str) -> dict[bool, float]:
    """Extra seconds the first run of each kind (quantizing: True, a bf16 program: False) in a process spends in its
    first step: bench8 at full size on a GPU; nothing elsewhere (the CPU shapes' first steps take under a second)."""
    return dict(BENCH8_FIRST_STEP_S) if _bench8_on_gpu(preset, small, device_type) else {True: 0.0, False: 0.0}


def _quantizes(arm: str) -> bool:
    return arm not in (BASE, REPEAT, AUTO)


def _first_step_extra(arms: list[str], done: list[dict[str, Any]], first_s: dict[bool, float] | None) -> list[float]:
    """Per arm: the first step's compile time if it is the first run of its kind in the process, else 0."""
    if not first_s:
        return [0.0] * len(arms)
    paid = {_quantizes(r["arm"]) for r in done if r.get("step_times_s")}
    extra = []
    for a in arms:
        q = _quantizes(a)
        extra.append(0.0 if q in paid else first_s[q])
        paid.add(q)
    return extra


def _measured_cost(done: list[dict[str, Any]], quantizing: bool) -> tuple[float, float] | None:
    """(median step time, mean time outside the steps: model build, teardown) of the finished runs of one kind
    (quantizing or a bf16 program); None before one has finished."""
    rs = [r for r in done if _quantizes(r["arm"]) == quantizing and len(r.get("step_times_s") or []) > 1]
    if not rs:
        return None
    step = sorted(t for r in rs for t in r["step_times_s"][1:])  # the first step carries the compiles
    outside = [max(0.0, r.get("wall_s", 0.0) - sum(r["step_times_s"])) for r in rs]
    return step[len(step) // 2], sum(outside) / len(outside)


def time_shares(left_s: float, arms: list[str], steps: int, done: list[dict[str, Any]],
                outside_s: float = 0.0, first_s: dict[bool, float] | None = None) -> float:
    """Seconds of ``left_s`` for the next of the runs ``arms`` (in order), in proportion to what each is expected to
    take: ``steps`` x its kind's measured median step time plus its measured time outside the steps, once a run of
    that kind has finished (a kind not yet measured: the other kind's step time scaled by ``QUANTIZED_RUN_COST``).
    Nothing measured: each run first gets ``outside_s`` (what it will spend outside its steps) and the rest is split by
    that constant ratio, so a short call does not give its first run a share smaller than its model build (it once
    left a bench8 baseline 1 s of training). So a recipe barely slower than bf16 does not leave the baselines short
    while its own runs end early. ``first_s`` (``first_step_s``): the first run of each kind not yet run in the
    process also gets its first step's compile time, so that run is not the one cut short."""
    cost = {q: _measured_cost(done, q) for q in (False, True)}
    extra = _first_step_extra(arms, done, first_s)
    if cost[False] is None and cost[True] is None:
        w = [QUANTIZED_RUN_COST if _quantizes(a) else 1.0 for a in arms]
        rest = max(0.0, left_s - len(arms) * outside_s - sum(extra))
        return outside_s + extra[0] + rest * w[0] / sum(w)
    w = []
    for a, e in zip(arms, extra):
        q = _quantizes(a)
        if cost[q] is not None:
            step_s, out_s = cost[q]
        else:
            step_s, out_s = cost[not q]
            step_s *= QUANTIZED_RUN_COST if q else 1.0 / QUANTIZED_RUN_COST
        w.append(steps * step_s + out_s + e)
    return left_s * w[0] / sum(w)


def expected_outside_s(arm: str, done: list[dict[str, Any]], default_s: float) -> float:
    """Seconds a run of ``arm`` is expected to spend outside its training steps (model build, teardown, the fit's
    setup), which its share must leave free of Lightning's ``max_time``: its kind's measured mean once a run of that
    kind finished, else the other kind's (building the model costs both the same), never less than ``default_s``
    (nothing measured: ``default_s``). (A fixed
    margin let each truncated bench8 run overrun its share by the ~45 s its 5.6 B-parameter build takes beyond it.)"""
    q = _quantizes(arm)
    cost = _measured_cost(done, q) or _measured_cost(done, not q)
    return max(default_s, cost[1]) if cost is not None else default_s
