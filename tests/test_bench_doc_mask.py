"""bench/doc_mask.py on a CPU: the whole script with small models (the SDPA reference standing in for the CUDA
kernels), and in process its run order and the attention-work fraction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _lane as lane
from _bench import load_bench

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "doc_mask.py"


@lane.job
def _smoke(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "dm.json"
    env = dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return lane.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--impls", "sdpa", "--steps",
                     "2", "--warmup", "0", "--max-tokens", "200000", "--out", str(out)],
                    cwd=REPO, env=env, timeout=600), out


def test_smoke_run_of_the_whole_script():
    proc, out = lane.result(_smoke)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    runs = {(r["case"], r["kernel"]): r for r in report["runs"]}
    assert set(runs) == {(c, k) for c in ("qwen@4096", "qwen@16384", "dsv3@4096") for k in ("causal", "sdpa")}
    for (case, kernel), r in runs.items():
        assert "error" not in r and r["tokens_per_s"] > 0, (case, kernel, r.get("error"))
    assert [(q["case"], q["same_first_batch"]) for q in report["ratios"]] == [
        ("qwen@4096", True), ("qwen@16384", True), ("dsv3@4096", True)]
    assert "document mask / causal tokens/s" in out.with_suffix(".log").read_text()
    fractions = [w["fraction"] for w in report["work_fraction"]]
    assert all(0 < f <= 1 for f in fractions) and fractions == sorted(fractions, reverse=True)


def test_plan_gives_every_target_a_number_first():
    dm = load_bench("doc_mask")
    order = dm.plan(["qwen@4096", "qwen@16384", "dsv3@4096"], ["varlen", "flex"])
    assert order[:6] == [("qwen@4096", "causal"), ("qwen@4096", "varlen"), ("qwen@16384", "causal"),
                         ("qwen@16384", "varlen"), ("dsv3@4096", "causal"), ("dsv3@4096", "flex")]
    assert order[6:] == [("qwen@4096", "flex"), ("qwen@16384", "flex")]  # varlen cannot run MLA's head dims


def test_work_fraction_counts_documents():
    """At 4096 tokens the embedded corpus's documents leave about 0.91 of the causal attention work (the issue's
    figure); a window of one document leaves all of it."""
    dm = load_bench("doc_mask")
    w = dm.work_fraction(4096, max_tokens=2_000_000)
    assert 0.85 < w["fraction"] < 0.95 and w["docs_per_window"] > 1
