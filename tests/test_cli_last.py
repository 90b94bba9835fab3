"""`generate` and `export` take `last` as the checkpoint (the newest checkpoint of the run, as `test --ckpt_path last`
resolves it) and refuse a checkpoint that is not there in one line, exit 2: never a freshly initialised model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_moe.config import ModelConfig
from lightning_moe.export import export_main
from lightning_moe.generation import generate_main
from lightning_moe.models.transformer import MoETransformer


def _save(path: Path, seed: int, mtime: float) -> None:
    cfg = ModelConfig.from_preset("tiny", num_layers=1)
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    model.init_weights()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                "hyper_parameters": {"config": cfg.to_dict()}}, path)
    os.utime(path, (mtime, mtime))


@pytest.fixture
def run(tmp_path):
    """A run folder with an older `last.ckpt` and a newer `epoch=0-step=4.ckpt` of other weights."""
    root = tmp_path / "run"
    _save(root / "checkpoints" / "last.ckpt", seed=0, mtime=1_000_000)
    _save(root / "checkpoints" / "epoch=0-step=4.ckpt", seed=1, mtime=2_000_000)
    return root


def _one_error_line(err: str, prog: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"lightning-moe {prog}: error:"), err
    return lines[0]


def test_generate_last_is_the_newest_checkpoint_of_the_run(run, capsys, monkeypatch):
    newest, older = run / "checkpoints" / "epoch=0-step=4.ckpt", run / "checkpoints" / "last.ckpt"
    prompt = ["--prompt", "def main(", "--max_new_tokens", "12", "--temperature", "1.0", "--seed", "3"]
    outs = {}
    for name, args in {"newest": ["--ckpt_path", str(newest)], "older": ["--ckpt_path", str(older)],
                       "last": ["--ckpt_path", "last", "--default_root_dir", str(run)]}.items():
        assert generate_main(args + prompt) == 0, name
        outs[name] = capsys.readouterr()
    assert outs["newest"].out != outs["older"].out  # the two checkpoints tell apart
    assert outs["last"].out == outs["newest"].out
    assert f"--ckpt_path last -> {newest}" in outs["last"].err
    monkeypatch.chdir(run)  # without --default_root_dir: the current directory
    assert generate_main(["--ckpt_path", "last"] + prompt) == 0
    assert capsys.readouterr().out == outs["newest"].out


def test_generate_without_a_checkpoint_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert generate_main(["--ckpt_path", "last", "--default_root_dir", str(empty), "--prompt", "a"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"--ckpt_path last: no checkpoint under {empty}" in _one_error_line(captured.err, "generate")


def test_export_last_and_a_missing_checkpoint(run, tmp_path, capsys):
    from safetensors.torch import load_file

    newest, older = run / "checkpoints" / "epoch=0-step=4.ckpt", run / "checkpoints" / "last.ckpt"
    assert export_main(["last", str(tmp_path / "from_last"), "--default_root_dir", str(run)]) == 0
    assert f"last -> {newest}" in capsys.readouterr().err
    assert export_main([str(newest), str(tmp_path / "from_newest")]) == 0
    assert export_main([str(older), str(tmp_path / "from_older")]) == 0
    capsys.readouterr()

    def weights(name):
        (file,) = (tmp_path / name).glob("*.safetensors")
        return load_file(file)

    last, want, other = weights("from_last"), weights("from_newest"), weights("from_older")
    assert set(last) == set(want) and all(torch.equal(last[k], want[k]) for k in want)
    assert any(not torch.equal(other[k], want[k]) for k in want)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_main(["last", str(tmp_path / "x"), "--default_root_dir", str(empty)]) == 2
    assert "no checkpoint under" in _one_error_line(capsys.readouterr().err, "export")
    assert export_main([str(tmp_path / "missing.ckpt"), str(tmp_path / "y")]) == 2
    assert "does not exist" in _one_error_line(capsys.readouterr().err, "export")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
