"""bench/train_step.py's CPU smoke run: both models train (ours through Lightning, transformers in a plain loop)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import _lane as lane

REPO = Path(__file__).resolve().parent.parent


@lane.job
def _smoke(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "ts.json"
    env = dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return lane.run([sys.executable, str(REPO / "bench" / "train_step.py"), "--device", "cpu", "--small",
                     "--skip-tiny", "--steps", "3", "--warmup", "1", "--ours-variants", "chunked",
                     "--hf-impls", "default", "--out", str(out)], cwd=REPO, env=env, timeout=300), out


def test_smoke_run_trains_both_models():
    pytest.importorskip("transformers", reason="the transformers peer of the benchmark")
    proc, out = lane.result(_smoke)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = [r for r in json.loads(out.read_text())["runs"] if r.get("impl") != "config"]
    impls = [r["impl"] for r in runs]
    assert any(i.startswith("lightning_moe") for i in impls) and any(i.startswith("hf") for i in impls), impls
    for r in runs:
        assert r.get("ok") and not r.get("error"), r
