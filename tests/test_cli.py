"""The command line (``lightning_moe.cli.main``, in-process) and the README / CI contract."""

from __future__ import annotations

import csv
import glob
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml


from lightning_moe.config import ModelConfig, preset_names
from _cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny.yaml")


_run = run_cli


def test_fit_tiny_config_short_run(tmp_path):
    code = _run([
        "fit", "--config", TINY,
        "--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
        f"--trainer.default_root_dir={tmp_path}", "--data.max_tokens=200000", "--trainer.enable_progress_bar=false",
    ])
    assert code == 0
    # it really trained: a checkpoint at step 3 that loads without running code, and logged validation losses
    ckpts = glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)
    assert len(ckpts) == 1 and "step=3" in ckpts[0], ckpts
    ckpt = torch.load(ckpts[0], weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 3
    assert ModelConfig.from_dict(ckpt["hyper_parameters"]["config"]) == ModelConfig.from_preset("tiny")
    metrics = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    assert len(metrics) == 1
    with open(metrics[0]) as f:
        vals = [float(r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")]
    # the sanity-check baseline (num_sanity_val_steps=-1 in tiny.yaml) and the validation at step 3
    assert len(vals) == 2 and all(math.isfinite(v) for v in vals), vals
    assert abs(vals[0] - math.log(260)) < 1.0  # a fresh byte-level model is near uniform
    assert vals[1] < vals[0]  # lr 3e-3 for 3 steps lowers it


def test_print_config(capsys):
    code = _run(["fit", "--config", TINY, "--model.lr=0.01", "--print_config"])
    assert code == 0
    out = capsys.readouterr().out
    assert "model:" in out and "data:" in out
    cfg = yaml.safe_load(out)
    assert cfg["model"]["config"] == "tiny"
    assert cfg["model"]["lr"] == pytest.approx(0.01)  # the override, not the file's 3e-3
    assert cfg["data"]["seq_len"] == 256
    assert cfg["trainer"]["max_steps"] == 300


def test_plan_deepseek_v3(capsys):
    code = _run(["plan", "--preset", "deepseek_v3"])
    assert code == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.strip()]
    total = [l for l in lines if l.split()[0] == "total"]
    assert len(total) == 1, out
    assert "671" in total[0]
    # the header line repeats the count, and the weight bytes are 4 bytes per parameter (bf16-mixed: fp32 master)
    assert "671" in lines[0] and "37.5" in lines[0]
    tib = 671.03e9 * 4 / 2**40
    assert f"{tib:.1f} TiB" in total[0]
    # one row per component, and the rows add up to the total
    comps = {l.split()[0] for l in lines[3:-1]}
    assert {"embedding", "attention", "routed_experts", "router"} <= comps


def test_plan_unknown_preset(capsys):
    code = _run(["plan", "--preset", "deepseek_v9"])
    assert code != 0
    err = capsys.readouterr().err
    assert "deepseek_v9" in err
    for name in preset_names():
        assert name in err


def test_fit_unknown_preset_exits_nonzero(tmp_path):
    # a real process: the exit code and the message a user sees
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_moe.cli", "fit", "--config", TINY, "--model.config=deepseek_v9",
         "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    msg = proc.stdout + proc.stderr
    assert "deepseek_v9" in msg
    for name in preset_names():
        assert name in msg, msg[-2000:]
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


def test_seq_len_longer_than_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"seq_len=512.*max_seq_len=256"):
        _run(["fit", "--config", TINY, "--data.seq_len=512", "--trainer.max_steps=1",
              f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"])


# ---- README / CI contract ---------------------------------------------------------------------------------------------


def _first_code_block(text: str) -> list[str]:
    m = re.search(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    if m is None:
        pytest.fail("README.md has no fenced code block; its first one must hold the run and test commands")
    lines = []
    for line in m.group(1).splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def _ci_test_command() -> str:
    run = (ROOT / ".ci" / "run").read_text()
    cmds = [l.strip() for l in run.splitlines()
            if "pytest" in l and not l.strip().startswith(("#", "echo"))]
    assert len(cmds) == 1, f".ci/run should hold one test command line, found {cmds}"
    return cmds[0]


def test_readme_commands_match_ci():
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.fail("README.md does not exist: its first code block must hold exactly two command lines, the "
                    "second equal to the test command in .ci/run")
    cmds = _first_code_block(readme.read_text())
    assert len(cmds) == 2, f"README.md's first code block should hold exactly two command lines, found {cmds}"
    assert cmds[1] == _ci_test_command(), (
        f"README's test command {cmds[1]!r} differs from .ci/run's {_ci_test_command()!r}")
