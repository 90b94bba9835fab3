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


def test_merge_resumes_a_cut_sweep_and_remeasures_a_kind(bench, tmp_path):
    """A sweep cut by its time limit resumes from its table: what it measured is kept (not timed again), the rest is
    measured; --remeasure drops one kind's entries and measures them again."""
    full = _run(bench, tmp_path / "full")
    cut_dir = tmp_path / "cut"
    cut = _run(bench, cut_dir, "--presets", "tiny", "--m-max", "128")  # a complete table of fewer Ms ...
    cut["entries"] = [e for e in cut["entries"] if e["kind"] == "grouped"]  # ... pretend the dense ones were cut
    (cut_dir / "cpu.json").write_text(json.dumps(cut))
    resumed = _run(bench, tmp_path / "resumed", "--merge", str(cut_dir / "cpu.json"))
    grouped = [e for e in resumed["entries"] if e["kind"] == "grouped"]
    dense = [e for e in resumed["entries"] if e["kind"] == "dense"]
    assert grouped == cut["entries"]  # kept as they were: the two-M grid of the cut run
    assert dense and all(list(e["ratios"]) == [str(m) for m in full["m_grid"]] for e in dense)  # measured now
    assert resumed["complete"] is True and resumed["not_run"] == []
    assert resumed["merged_from"]["entries_kept"] == len(grouped)
    assert [h["command"] for h in resumed["merged_from"]["history"]] == [cut["command"]]
    again = _run(bench, tmp_path / "again", "--merge", str(tmp_path / "resumed" / "cpu.json"), "--remeasure", "grouped")
    assert all(list(e["ratios"]) == [str(m) for m in full["m_grid"]] for e in again["entries"])
    # a merge of a merged table keeps every earlier sweep's command, oldest first
    assert [h["command"] for h in again["merged_from"]["history"]] == [cut["command"], resumed["command"]]
    with pytest.raises(SystemExit, match="--remeasure"):
        bench.parse_args(["--device", "cpu", "--remeasure", "grouped"])


def test_remeasure_of_some_recipes_keeps_the_others(bench, tmp_path):
    """--remeasure dense --recipes fp8_rowwise times the dense shapes again with rowwise only: the other recipes'
    dense entries and the grouped ones stay as they were, and the table is still complete."""
    prior_dir = tmp_path / "prior"
    prior = _run(bench, prior_dir, "--m-max", "128")
    merged = _run(bench, tmp_path / "merged", "--merge", str(prior_dir / "cpu.json"), "--remeasure", "dense",
                  "--recipes", "fp8_rowwise")
    by_key = lambda t: {(e["kind"], e["N"], e["K"], e["recipe"]): e for e in t["entries"]}  # noqa: E731
    before, after = by_key(prior), by_key(merged)
    assert set(before) == set(after)
    for k, e in after.items():
        remeasured = k[0] == "dense" and k[3] == "fp8_rowwise"
        assert list(e["ratios"]) == [str(m) for m in merged["m_grid"]] if remeasured else e == before[k], k
    assert merged["complete"] is True and merged["recipes"] == ["fp8_rowwise"]


def test_a_cut_shape_is_partial_and_measured_again(bench, tmp_path):
    """The time limit cuts a shape after its first M: its entries are marked partial, not_run names the shape and its
    recipes, and a merged sweep measures the cut recipes in full while keeping the complete entries."""
    prior_dir = tmp_path / "prior"
    prior = _run(bench, prior_dir)
    dense = [e for e in prior["entries"] if e["kind"] == "dense"]
    cut = dense[0]
    cut_key = (cut["kind"], cut["N"], cut["K"], cut["groups"])
    for e in prior["entries"]:
        if (e["kind"], e["N"], e["K"], e["groups"]) == cut_key:
            e["partial"] = True
            e["ratios"] = {"64": e["ratios"]["64"]}
        elif e["kind"] == "dense" and e["recipe"] == "fp8_blockwise":
            e["ratios"] = {"64": 123.0}  # a marker: kept entries are not timed again
    recipes = sorted(e["recipe"] for e in prior["entries"] if (e["kind"], e["N"], e["K"], e["groups"]) == cut_key)
    prior["not_run"] = []
    (prior_dir / "cpu.json").write_text(json.dumps(prior))
    resumed = _run(bench, tmp_path / "resumed", "--merge", str(prior_dir / "cpu.json"))
    again = [e for e in resumed["entries"] if (e["kind"], e["N"], e["K"], e["groups"]) == cut_key]
    assert sorted(e["recipe"] for e in again) == recipes
    assert all(not e.get("partial") and len(e["ratios"]) == len(resumed["m_grid"]) for e in again)
    kept = [e for e in resumed["entries"] if e["kind"] == "dense" and e["recipe"] == "fp8_blockwise"
            and (e["kind"], e["N"], e["K"], e["groups"]) != cut_key]
    assert kept and all(e["ratios"] == {"64": 123.0} for e in kept)
    assert resumed["complete"] is True
    # not_run of a table a sweep of fewer recipes wrote: the missing recipes per shape, complete false
    no_blockwise = [e for e in resumed["entries"] if e["recipe"] != "fp8_blockwise"]
    fewer = bench.not_run(bench.shapes(["tiny"], True), no_blockwise, "eager",
                          lambda g: [r for r in bench.RECIPES_BY_KIND[g.kind] if bench.fits(r, g)])
    assert fewer and all(n["recipes"] == ["fp8_blockwise"] and not n["partial"] for n in fewer)


def test_compiled_entries_are_looked_up_only_for_compiled_gemms():
    """A dense GEMM in a compiled region is looked up among compiled entries only (torchao under inductor costs
    differently from our eager kernels); without one it stays in high precision."""
    from lightning_moe.lowp.crossover import Gemm

    entry = {"kind": "dense", "N": 64, "K": 32, "groups": 1, "recipe": "fp8_rowwise", "ratios": {"64": 1.5}}
    table = CrossoverTable({"schema": SCHEMA, "entries": [entry]})
    eager, comp = Gemm("a", "dense", 64, 32), Gemm("a", "dense", 64, 32, mode="compiled")
    assert table.choose(eager, 64, ["fp8_rowwise"])[0] == "fp8_rowwise"
    assert table.choose(comp, 64, ["fp8_rowwise"]) == (None, None, "shape not in table")
    table = CrossoverTable({"schema": SCHEMA, "entries": [entry, {**entry, "mode": "compiled", "ratios": {"64": 0.9}}]})
    assert table.choose(comp, 64, ["fp8_rowwise"]) == (None, 0.9, "below crossover")
    with pytest.raises(ValueError, match="mode"):
        CrossoverTable({"schema": SCHEMA, "entries": [{**entry, "mode": "graph"}]})
