"""How a convergence call of the low-precision bench splits its --time-limit (bench/lowp_time_shares.py): shares by
measured step times once runs finish, and each run's max_time leaving its measured time outside the steps."""

from __future__ import annotations

import pytest

from bench.lowp_time_shares import (
    MARGIN_S, QUANTIZED_RUN_COST, expected_outside_s, first_margin_s, first_step_s, time_shares,
)


def test_time_shares_follow_measured_step_times_once_runs_finish() -> None:
    arms = ["baseline", "fp8_rowwise", "baseline", "fp8_rowwise"]
    # nothing measured: the constant cost ratio
    first = time_shares(600.0, arms, 300, [])
    assert first == pytest.approx(600.0 / (2 + 2 * QUANTIZED_RUN_COST))
    # a baseline measured at 0.1 s/step (30 s outside the steps), the FP8 kind not yet: scaled by the ratio
    base = {"arm": "baseline", "step_times_s": [5.0] + [0.1] * 299, "wall_s": 5.0 + 29.9 + 30.0}
    fp8_expected = 300 * 0.1 * QUANTIZED_RUN_COST + 30.0
    share = time_shares(500.0, arms[1:], 300, [base])
    assert share == pytest.approx(500.0 * fp8_expected / (2 * fp8_expected + 60.0), rel=1e-6)
    # both kinds measured: FP8 barely slower than bf16 gets barely more time, so the baselines are not starved
    fp8 = {"arm": "fp8_rowwise", "step_times_s": [9.0] + [0.12] * 299, "wall_s": 9.0 + 35.88 + 30.0}
    base_share = time_shares(300.0, arms[2:], 300, [base, fp8])
    assert base_share == pytest.approx(300.0 * 60.0 / (60.0 + 66.0), rel=1e-6)
    assert base_share > 300.0 / (1 + QUANTIZED_RUN_COST)  # more than the constant ratio would give
    # the 'repeat' and 'auto' arms run bf16 programs: they take the baseline's measured cost
    assert time_shares(300.0, ["repeat", "baseline"], 300, [base, fp8]) == pytest.approx(150.0)


def test_a_short_calls_first_run_gets_its_model_build_before_the_split() -> None:
    """Nothing measured yet: each run's time outside its steps comes off the top, the rest goes by the cost ratio
    (a 149 s call once gave its bench8 baseline 42 s, of which the 60 s margin left 1 s of training)."""
    arms = ["baseline", "fp8_rowwise:sr_w"]
    share = time_shares(149.0, arms, 300, [], outside_s=60.0)
    assert share == pytest.approx(60.0 + 29.0 / (1 + QUANTIZED_RUN_COST))
    assert share - 60.0 > 1.0  # some training, in proportion, rather than the 1 s floor
    assert time_shares(100.0, arms, 300, [], outside_s=60.0) == pytest.approx(60.0)  # nothing left to split
    # without it (outside_s=0) the split is the plain ratio, as before
    assert time_shares(149.0, arms, 300, []) == pytest.approx(149.0 / (1 + QUANTIZED_RUN_COST))


def test_a_runs_training_time_leaves_its_measured_time_outside_the_steps() -> None:
    """max_time = share - what the run spends outside its steps: the fixed margin only before a run has finished,
    then the measured time (its kind's, else the other kind's), so truncated runs do not overrun the call."""
    assert expected_outside_s("fp8_rowwise", [], 15.0) == 15.0
    base = {"arm": "baseline", "step_times_s": [5.0] + [0.1] * 299, "wall_s": 5.0 + 29.9 + 60.0}
    assert expected_outside_s("baseline", [base], 15.0) == pytest.approx(60.0)
    assert expected_outside_s("fp8_rowwise:sr_w", [base], 15.0) == pytest.approx(60.0)  # the same model build
    fp8 = {"arm": "fp8_rowwise", "step_times_s": [9.0] + [0.12] * 299, "wall_s": 9.0 + 35.88 + 70.0}
    assert expected_outside_s("fp8_rowwise", [base, fp8], 15.0) == pytest.approx(70.0)
    assert expected_outside_s("repeat", [base, fp8], 15.0) == pytest.approx(60.0)
    fast = {"arm": "baseline", "step_times_s": [0.1] * 300, "wall_s": 31.0}  # never below the margin
    assert expected_outside_s("baseline", [fast], 15.0) == 15.0
    # before anything is measured: bench8 at full size on a GPU takes about a minute outside its steps
    assert first_margin_s("bench8", False, "cuda") >= 40.0 > MARGIN_S["cuda"] == first_margin_s("tiny", False, "cuda")
    assert first_margin_s("bench8", True, "cuda") == MARGIN_S["cuda"] and first_margin_s("bench8", False, "cpu") == 3.0


def test_the_first_run_of_each_kind_gets_its_first_steps_compile() -> None:
    """A process's first quantizing run spends its first step compiling and autotuning (on bench8 about 75 s on a fresh
    machine): without an allowance the first run of a call was the one cut short while later runs left time unused."""
    first = {True: 75.0, False: 12.0}
    arms = ["fp8_rowwise:sr_w", "fp8_rowwise:sr_w", "baseline", "fp8_rowwise:sr_w"]
    # nothing measured: four model builds, one quantizing and one bf16 compile come off the top
    share = time_shares(546.0, arms, 300, [], outside_s=60.0, first_s=first)
    rest = 546.0 - 4 * 60.0 - 75.0 - 12.0
    w = 3 * QUANTIZED_RUN_COST + 1
    assert share == pytest.approx(60.0 + 75.0 + rest * QUANTIZED_RUN_COST / w)
    assert share > time_shares(546.0, arms, 300, [], outside_s=60.0)
    # a bf16 first in line gets the bf16 compile only
    assert time_shares(546.0, arms[2:], 300, [], outside_s=60.0, first_s=first) == pytest.approx(
        60.0 + 12.0 + (546.0 - 120.0 - 87.0) / (1 + QUANTIZED_RUN_COST))
    # a baseline has run (its kind paid), the quantizing kind not yet: its first run carries the 75 s in its weight
    base = {"arm": "baseline", "step_times_s": [12.0] + [0.1] * 299, "wall_s": 12.0 + 29.9 + 30.0}
    fp8_w = 300 * 0.1 * QUANTIZED_RUN_COST + 30.0
    got = time_shares(400.0, ["fp8_rowwise", "fp8_rowwise"], 300, [base], outside_s=60.0, first_s=first)
    assert got == pytest.approx(400.0 * (fp8_w + 75.0) / (2 * fp8_w + 75.0))
    # once a quantizing run has run in the process, nobody gets the allowance
    fp8 = {"arm": "fp8_rowwise", "step_times_s": [75.0] + [0.2] * 299, "wall_s": 75.0 + 59.8 + 30.0}
    assert time_shares(400.0, ["fp8_rowwise", "baseline"], 300, [base, fp8], first_s=first) == pytest.approx(
        400.0 * 90.0 / (90.0 + 60.0))
    # only bench8 at full size on a GPU compiles for that long
    assert first_step_s("bench8", False, "cuda")[True] >= 60.0
    assert first_step_s("tiny", False, "cuda") == first_step_s("bench8", True, "cuda") == {True: 0.0, False: 0.0}
    assert first_step_s("bench8", False, "cpu") == {True: 0.0, False: 0.0}
