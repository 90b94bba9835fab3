"""bench/precision_seeds.py's CPU smoke run (2 seeds x the four modes, 10 steps): every run trains, the pairs share
their first batch, and the table carries every per-seed number and the paired statistics."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _lane as lane

REPO = Path(__file__).resolve().parent.parent


@lane.job
def _seed_study(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "seeds.json"
    env = dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return lane.run([sys.executable, str(REPO / "bench" / "precision_seeds.py"), "--device", "cpu", "--threads",
                     "1", "--seeds", "2", "--steps", "10", "--last", "3", "--small", "--out", str(out)],
                    cwd=REPO, env=env, timeout=600), out


def test_seed_study_smoke_run():
    pytest.importorskip("torchao", reason="the bf16 stochastic-rounding mode")
    proc, out = lane.result(_seed_study)
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


@lane.job
def _precision_step(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "ps.json"
    env = dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return lane.run([sys.executable, str(REPO / "bench" / "precision_step.py"), "--smoke", "--out", str(out)],
                    cwd=REPO, env=env, timeout=600), out


def test_precision_step_smoke_run(tmp_path):
    """bench/precision_step.py on CPU: the three runs from one init, each with its optimizer step against its bound,
    and the three comparisons in the report."""
    proc, out = lane.result(_precision_step)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    runs = {r["run"]: r for r in report["runs"]}
    assert list(runs) == ["bf16-true", "bf16-master", "bf16-mixed"]
    assert {r["param_dtype"] for r in runs.values()} == {"bfloat16", "float32"}  # bf16-mixed keeps fp32 parameters
    assert len({r["first_batch_checksum"] for r in runs.values()}) == 1
    first = {name: r["losses"][0] for name, r in runs.items()}
    assert first["bf16-true"] == first["bf16-master"]  # the same (rounded) init: the same first loss
    for r in runs.values():
        o = r["optimizer_step"]
        assert r["ok"] and r["tokens_per_s"] > 0 and o["ratio_to_bound"] > 0, r
    per_param = {name: r["optimizer_step"]["bytes"]["total"] / r["params"] for name, r in runs.items()}
    # bf16 AdamW moves 14 bytes a bf16 parameter, the masters 28, fp32 AdamW 28 (the routers are fp32 in all three)
    assert 14 < per_param["bf16-true"] < 15 and per_param["bf16-master"] == per_param["bf16-mixed"] == 28
    c = report["comparison"]
    assert set(c) == {"speed", "optimizer", "convergence"}
    assert c["speed"]["tokens_per_s_ratio"] == runs["bf16-master"]["tokens_per_s"] / runs["bf16-true"]["tokens_per_s"]
    assert c["convergence"]["steps"] == 6 and c["convergence"]["same_batches"]
    text = out.with_suffix(".log").read_text()
    assert "tokens/s bf16-master / bf16-true" in text and "optimizer step" in text and "final loss" in text
    # --merge: the runs split over two reports (two calls) give the one call's comparison
    parts = []
    for i, names in enumerate((["bf16-true", "bf16-master"], ["bf16-mixed"])):
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({**report, "runs": [runs[n] for n in names]}))
    merged_out = tmp_path / "merged.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "bench", "precision_step", "--smoke", "--merge",
                           *map(str, parts), "--out", str(merged_out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    merged = json.loads(merged_out.read_text())
    assert merged["comparison"] == report["comparison"] and [r["run"] for r in merged["runs"]] == list(runs)


def test_optimizer_bytes_of_master_weights():
    """28 bytes a bf16 parameter with an fp32 master: grad 2 + master, exp_avg, exp_avg_sq 12 read; the same 12 and
    the parameter's 2 written (the parameter itself is not read)."""
    import torch


    from lightning_moe.optim import MasterAdamW

    from bench import deepseek_v3_step as ds
    bf16 = torch.nn.Parameter(torch.randn(10, 3).bfloat16())
    fp32 = torch.nn.Parameter(torch.randn(7))
    opt = MasterAdamW([bf16, fp32], fused=False)
    for p in (bf16, fp32):
        p.grad = torch.ones_like(p)
    opt.step()
    moved = ds.optimizer_bytes(opt)
    assert moved["read"] == 30 * 14 + 7 * 16 and moved["written"] == 30 * 14 + 7 * 12


def test_seed_study_merge_of_reports(tmp_path):
    """--merge puts seeds run in separate calls into one table, the same as one call's."""

    from bench import precision_seeds as ps
    runs = []
    for seed in (0, 1):
        for mode, final in (("32-true", 2.0 + seed), ("bf16-true", 2.1 + seed), ("bf16-master", 2.01 + seed)):
            runs.append({"seed": seed, "mode": mode, "final": final, "losses": [final] * 3, "first_batch_checksum": seed})
    base = {"settings": {"source": "tiny.yaml", "batch_size": 8, "seq_len": 256}, "env": {},
            "args": {"steps": 3, "last": 3, "device": "cpu"}}
    for seed in (0, 1):
        (tmp_path / f"{seed}.json").write_text(json.dumps({**base, "runs": [r for r in runs if r["seed"] == seed]}))
    out = tmp_path / "merged.json"
    assert ps.main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())["summary"]
    direct = json.loads(json.dumps(ps.summarize(runs, ["32-true", "bf16-true", "bf16-master"])))
    assert merged == direct and merged["complete_seeds"] == [0, 1]
    assert merged["modes"]["bf16-master"]["rel_diff_mean"] == pytest.approx((0.01 / 2 + 0.01 / 3) / 2)
    assert merged["target"]["met"] is True
