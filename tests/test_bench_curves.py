"""bench/core/curves.py: the paired differences the convergence plot draws (per recipe, each run against the baseline
of its own init seed; the other inits' baselines against the first run), the target band it shades, and the plot
itself with many runs."""

from __future__ import annotations

import importlib.util

import pytest

from bench.core.curves import paired_curves, save_curves, tightest_target


def _run(arm: str, seed: int, losses: list[float]) -> dict:
    return {"model": f"m-{arm}-{seed}", "recipe": arm if seed == 0 else f"{arm}_seed{seed}", "arm": arm, "seed": seed,
            "losses": losses}


RUNS = [_run("baseline", 0, [4.0, 2.0]), _run("fp8", 0, [4.4, 2.2]), _run("baseline", 1, [5.0, 2.5]),
        _run("fp8", 1, [4.5, 2.25]), _run("repeat", 1, [5.0, 2.5])]


def test_each_run_is_paired_with_the_baseline_of_its_own_seed():
    c = paired_curves(RUNS, smooth=1)
    assert set(c) == {"baseline", "fp8", "repeat"}
    assert c["fp8"] == [pytest.approx([10.0, 10.0]), pytest.approx([-10.0, -10.0])]  # seed 0: +10%, seed 1: -10%
    assert c["repeat"] == [pytest.approx([0.0, 0.0])]
    assert c["baseline"] == [pytest.approx([25.0, 25.0])]  # the other init against the first run (the noise)
    # a moving mean of 2: step 2 averages both steps of each run
    assert paired_curves(RUNS, smooth=2)["fp8"][0] == pytest.approx([10.0, 10.0])


def test_a_run_without_a_baseline_of_its_seed_is_left_out():
    c = paired_curves([RUNS[0], _run("fp8", 7, [1.0, 1.0])], smooth=1)
    assert c == {}


def test_the_band_is_the_tightest_target():
    assert tightest_target([{"target": 0.03}, {"target": None}, {"target": 0.01}, {}]) == 0.01
    assert tightest_target([{"target": None}]) is None


def test_the_plot_is_written_with_many_runs(tmp_path):
    """A PNG with matplotlib (the bench extra); without it, the curves' data as CSV, one row per run and step."""
    runs = [_run(f"arm{i}", s, [4.0 - 0.01 * i - 0.1 * k for k in range(30)]) for i in range(12) for s in (0, 1)]
    runs = [_run("baseline", s, [4.0 - 0.1 * k for k in range(30)]) for s in (0, 1)] + runs
    path = save_curves(runs, tmp_path / "conv.json", 5, "test", 0.01)
    if importlib.util.find_spec("matplotlib") is not None:
        assert path == tmp_path / "conv_curves.png" and path.stat().st_size > 10_000
    else:
        assert path == tmp_path / "conv_curves.csv" and len(path.read_text().splitlines()) == 1 + 26 * 30
