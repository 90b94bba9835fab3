"""The benchmark package's result schema (a round trip, its checks, every recorded result file converts), the
RESULTS.md table generation (markers replaced, prose untouched) and the runner's command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.core import schema
from bench.suites import SUITES

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def _report() -> dict:
    """A train_step-shaped report: one run that trained, one that failed, one skipped."""
    return {"env": {"torch": "x"}, "args": {"steps": 3},
            "runs": [{"model": "m", "impl": "ours", "tokens_per_s": 1234.5, "mfu": 0.5, "ok": True, "losses": [1.0]},
                     {"model": "m", "impl": "hf", "tokens_per_s": None, "ok": False, "error": "boom"},
                     {"model": "m", "impl": "other", "skipped": "time limit"}]}


def test_schema_round_trip(tmp_path):
    path = schema.save(tmp_path / "r.json", _report(), "train_step")
    doc = schema.load(path, "train_step")
    assert doc["schema"] == schema.SCHEMA_VERSION and doc["suite"] == "train_step"
    assert [(r["impl"], r["status"], r["note"]) for r in doc["rows"]] == [
        ("ours", "ok", ""), ("hf", "error", "boom"), ("other", "skipped", "time limit")]
    assert doc["rows"][0]["metrics"] == {"tokens_per_s": 1234.5, "mfu": 0.5}  # numbers only: no lists, no flags
    assert doc["runs"] == _report()["runs"]  # the suite's own detail is kept beside the rows
    with pytest.raises(ValueError, match="holds suite 'train_step'"):
        schema.load(path, "moe_layer")


def test_schema_rejects_bad_rows(tmp_path):
    with pytest.raises(ValueError, match="status 'fine'"):
        schema.make_row("s", "c", "i", {}, "fine")
    with pytest.raises(ValueError, match="numbers or None"):
        schema.make_row("s", "c", "i", {"x": "fast"}, "ok")
    doc = schema.finish(_report(), "train_step")
    doc["rows"][0]["status"] = "great"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="status 'great'"):
        schema.load(tmp_path / "bad.json")
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps(_report()))
    with pytest.raises(ValueError, match="name its suite"):
        schema.load(legacy)


SUITE_OF = {"ck": "checkpoint", "parallel": "parallel_check", "precision_mixed": "precision_step"}


def _suite_of(name: str) -> str:
    for prefix, suite in SUITE_OF.items():
        if name.startswith(prefix + "_"):
            return suite
    return max((s for s in SUITES if name.startswith(s)), key=len)


def test_every_recorded_result_file_gives_rows():
    files = sorted(RESULTS.glob("*.json"))
    assert len(files) > 30
    for f in files:
        doc = schema.load(f, _suite_of(f.name))
        assert doc["rows"], f.name
    ts = schema.load(RESULTS / "train_step_h200_final.json", "train_step")
    raw = json.loads((RESULTS / "train_step_h200_final.json").read_text())["runs"]
    assert [r["metrics"]["tokens_per_s"] for r in ts["rows"]] == [r["tokens_per_s"] for r in raw]


PROSE_A = "# Title\n\nSome prose with a | pipe.\n\n"
PROSE_B = "\nMore prose <!-- a comment --> after.\n"


def test_results_tables_replace_only_what_is_between_markers(tmp_path):
    schema.save(tmp_path / "res" / "ts.json", _report(), "train_step")
    marker = "<!-- bench:train_step res/ts.json tokens_per_s:,.0f mfu:.1% -->"
    md = tmp_path / "RESULTS.md"
    md.write_text(f"{PROSE_A}{marker}\n| stale | table |\n<!-- /bench -->{PROSE_B}")
    assert report.main(["--file", str(md), "--check"]) == 1
    assert report.main(["--file", str(md)]) == 0
    text = md.read_text()
    assert text.startswith(PROSE_A + marker + "\n") and text.endswith("<!-- /bench -->" + PROSE_B)
    table = text[len(PROSE_A + marker + "\n"):-len("<!-- /bench -->" + PROSE_B)].strip().splitlines()
    assert [c.strip() for c in table[0].split("|")[1:-1]] == ["case", "impl", "tokens_per_s", "mfu", "status"]
    assert [c.strip() for c in table[2].split("|")[1:-1]] == ["m", "ours", "1,234", "50.0%", "ok"]
    assert [c.strip() for c in table[3].split("|")[1:-1]] == ["m", "hf", "-", "-", "error: boom"]
    assert len(table) == 5 and "stale" not in text
    assert report.main(["--file", str(md), "--check"]) == 0  # regenerating changes nothing more
    md.write_text(marker.replace("res/ts.json", "res/none.json") + "\n<!-- /bench -->\n")
    with pytest.raises(ValueError, match="no result file"):
        report.main(["--file", str(md)])


def test_bench_results_md_is_up_to_date():
    assert report.main(["--check"]) == 0


def test_runner_lists_suites_and_old_command_lines_still_run():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    listed = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()] == list(SUITES)
    bad = subprocess.run([sys.executable, "-m", "bench", "no_such_suite"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "unknown suite 'no_such_suite'" in bad.stderr
    # `python bench/<suite>.py` from another folder: re-executed as the runner's suite (its --help)
    old = subprocess.run([sys.executable, str(REPO / "bench" / "parallel_check.py"), "--help"], cwd="/",
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert old.returncode == 0 and "--layout" in old.stdout, old.stderr[-2000:]
