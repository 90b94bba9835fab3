"""bench/fp8_crossover.py on CPU (emulated numerics, the tiny preset): it writes a valid crossover table (schema,
monotone power-of-two M grid, crossovers consistent with the measured ratios) that the callback's loader accepts; a
time limit that leaves no time still writes a valid, incomplete table."""

from __future__ import annotations

import json

import pytest

from lightning_moe.lowp.crossover import SCHEMA, CrossoverTable, crossover_m

pytest.importorskip("torchao.float8", reason="the fp8 dense linears use torchao (the ao extra)")



@pytest.fixture(scope="module")
def bench():
    import bench.fp8_crossover as mod

    return mod


def _run(bench, tmp_path, *extra):
    assert bench.main(["--device", "cpu", "--emulate", "--small", "--out-dir", str(tmp_path), *extra]) == 0
    return json.loads((tmp_path / "cpu.json").read_text())


def test_small_sweep_writes_a_valid_table(bench, tmp_path, capsys):
    t = _run(bench, tmp_path)
    assert t["schema"] == SCHEMA and t["arch"] == "cpu" and t["emulate"] is True and t["complete"] is True
    assert t["command"].startswith("python -m bench fp8_crossover --device cpu") and t["torch"] and t["date"]
    grid = t["m_grid"]
    assert grid == sorted(grid) and grid[0] == 64 and grid[-1] == 256
    assert all(b == 2 * a for a, b in zip(grid, grid[1:]))
    kinds = {(e["kind"], e["recipe"]) for e in t["entries"]}
    # tiny: 128-wide attention -> blockwise too; the grouped GEMMs have no tensorwise variant
    assert {("dense", "fp8_tensorwise"), ("dense", "fp8_rowwise"), ("dense", "fp8_blockwise"),
            ("grouped", "fp8_rowwise")} <= kinds and ("grouped", "fp8_tensorwise") not in kinds
    for e in t["entries"]:
        assert [int(m) for m in e["ratios"]] == grid, e  # every M ran, in grid order
        for m, r in e["ratios"].items():
            assert r > 0 and r == pytest.approx(e["bf16_ms"][m] / e["fp8_ms"][m], rel=1e-2)
        assert e["crossover_m"] == crossover_m({int(k): v for k, v in e["ratios"].items()})
        assert e["names"] and all(n.startswith("tiny:") for n in e["names"])
        if e["kind"] == "grouped":
            assert e["groups"] == 8 and set(e["groups_at"]) == set(e["ratios"])
    # the output layer and the router never appear (always high precision)
    assert not any("output" in n for e in t["entries"] for n in e["names"])
    table = CrossoverTable.load(tmp_path / "cpu.json")
    assert table.arch == "cpu" and "fp8_rowwise" in table.recipes
    assert "wrote" in capsys.readouterr().out


def test_time_limit_writes_a_valid_incomplete_table(bench, tmp_path):
    t = _run(bench, tmp_path, "--time-limit", "0.01")
    assert t["complete"] is False and t["entries"] == [] and len(t["not_run"]) > 0
    CrossoverTable(t)  # still loads


def test_crossover_is_the_start_of_the_paying_tail():
    assert crossover_m({64: 0.5, 128: 1.1, 256: 0.98, 512: 1.2, 1024: 1.3}) == 512  # a dip above moves it up
    assert crossover_m({64: 1.2, 128: 1.1}) == 64
    assert crossover_m({64: 1.2, 128: 0.9}) is None
    assert crossover_m({64: 0.9, 128: 0.95}, min_speedup=0.9) == 64
