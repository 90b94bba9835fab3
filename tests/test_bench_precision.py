"""bench/precision_seeds.py's CPU smoke run (2 seeds x the four modes, 10 steps): every run trains, the pairs share
their first batch, and the table carries every per-seed number and the paired statistics."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_seed_study_smoke_run(tmp_path):
    pytest.importorskip("torchao", reason="the bf16 stochastic-rounding mode")
    out = tmp_path / "seeds.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "precision_seeds.py"), "--device", "cpu", "--threads",
                           "1", "--seeds", "2", "--steps", "10", "--last", "3", "--small", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    modes = ["32-true", "bf16-true", "bf16-master", "bf16-sr"]
    assert [(r["seed"], r["mode"]) for r in report["runs"]] == [(s, m) for s in (0, 1) for m in modes]
    for r in report["runs"]:
        assert r["ok"] and len(r["losses"]) == 10 and r["final"] == pytest.approx(sum(r["losses"][-3:]) / 3), r["mode"]
    summary = report["summary"]
    assert summary["same_batches_per_seed"] and summary["complete_seeds"] == [0, 1]
    # the bf16 modes really ran in bf16 (and the seeds differ: another init and other batches)
    assert {r["mode"]: r["param_dtype"] for r in report["runs"] if r["seed"] == 0}["bf16-master"] == "bfloat16"
    ref = summary["modes"]["32-true"]["final_by_seed"]
    assert ref["0"] != ref["1"]
    for m in modes[1:]:
        st = summary["modes"][m]
        diffs = [st["rel_diff_by_seed"][k] for k in ("0", "1")]
        assert diffs == [summary["modes"][m]["final_by_seed"][k] / ref[k] - 1 for k in ("0", "1")]
        assert st["rel_diff_mean"] == pytest.approx(sum(diffs) / 2)
    assert set(report["summary"]["target"]) >= {"within_1_percent", "smaller_than_bf16_true", "met"}
    md = out.with_suffix(".md").read_text()
    assert md.count("\n| ") == 5 and "bf16-master" in md and "paired diff" in md
