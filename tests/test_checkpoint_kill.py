"""Saves are atomic under SIGKILL: a save killed at any of its filesystem steps leaves the previous checkpoint or the
new one at the path, complete and checksummed, and a fresh process resumes from it exactly.

The writers (tests/_kill_save.py, a process of their own) save after step 2 over a checkpoint of step 1, killed just
before their 1st, 2nd, ... filesystem step until one completes, for a directory (sync and async), a directory
written before versions existed, and a single file. This process (fresh with respect to every killed writer) reads
every result; the runs just before and just after the switch to the new checkpoint are resumed by a Trainer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import _lane as lane
from _dist import run_distributed
from parallel_harness import GLOBAL_BATCH, FixedData, small_config

from lightning_moe import MoELanguageModel, MoEParallelStrategy
from lightning_moe.checkpoint import META_FILE, VERSIONS_DIR, SafeCheckpointIO, resolve
from lightning_moe.checkpoint.files import verify_dir_checksums
from lightning_moe.generation import load_for_generation

HERE = Path(__file__).parent


@lane.job
def _kill_writer(out: Path, env: dict) -> dict[str, Any]:
    env = {**env, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])}
    done = lane.run([sys.executable, str(HERE / "_kill_save.py"), str(out)], env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["record"] = torch.load(manifest["record"], weights_only=True)
    return manifest


@pytest.fixture(scope="module")
def kills() -> dict[str, Any]:
    return lane.result(_kill_writer)


def _read(scenario: str, path: str) -> tuple[int, dict[str, torch.Tensor]]:
    """(global step, weights) of the checkpoint at ``path``, verified by its checksums on the way."""
    if scenario == "file":
        ckpt = SafeCheckpointIO().load_checkpoint(path)  # CRC32 sidecar verified
        return ckpt["global_step"], {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    target = resolve(path)
    # a version (never a staging directory), or the plain directory a legacy save has not yet moved aside
    assert target.is_dir() and (target.parent.name == VERSIONS_DIR and target.name.count(".") == 1
                                or scenario == "legacy" and target == Path(path)), f"{path} resolves to {target}"
    verify_dir_checksums(target)  # CorruptCheckpointError naming any damaged, missing or unexpected file
    step = torch.load(target / META_FILE, weights_only=True)["global_step"]
    model, _ = load_for_generation(path)
    return step, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _which(step: int, weights: dict[str, torch.Tensor], states: dict[int, dict[str, torch.Tensor]]) -> int:
    want = states[step]
    assert set(weights) == set(want)
    differ = [k for k in want if not torch.equal(weights[k].float(), want[k].float())]
    assert not differ, f"the checkpoint says step {step} but its weights differ from step {step}'s: {differ[:5]}"
    return step


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", ["sync", "async", "legacy", "file"])
def test_a_killed_save_leaves_the_old_or_the_new_checkpoint(kills, scenario):
    states = kills["record"]["states"]
    assert any(not torch.equal(states[1][k], states[2][k]) for k in states[1])  # old and new can be told apart
    runs = kills["scenarios"][scenario]["runs"]
    assert len(runs) >= (5 if scenario == "file" else 15), runs  # the steps of the save were really counted
    found = [_which(*_read(scenario, r["path"]), states) for r in runs]
    # old until the one step that publishes the new checkpoint, new from then on; the completed save is new
    switch = found.index(2)
    assert found == [1] * switch + [2] * (len(found) - switch), found
    assert 0 < switch and runs[-1]["outcome"] == "done" and runs[-2]["outcome"] == "killed"
    last = Path(runs[-1]["path"])
    if scenario == "file":
        assert sorted(p.name for p in last.parent.iterdir()) == ["ckpt", "ckpt.crc32"]
    else:  # the completed save left the link and its one version, nothing of the previous one or of staging
        assert last.is_symlink() and [p.name for p in (last.parent / VERSIONS_DIR).iterdir()] == [resolve(last).name]


def _resume(rank: int, world_size: int, paths: list[str]) -> list[list[float]]:
    out = []
    for path in paths:
        torch.manual_seed(1)  # other initial weights: the checkpoint has to replace them
        model = MoELanguageModel(small_config(), lr=1e-2, warmup_steps=1, max_steps=4)
        losses: list[float] = []

        class Rec(L.Callback):
            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                losses.append(float(pl_module.step_result.loss))

        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEParallelStrategy(), max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                            callbacks=[Rec()])
        trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH), ckpt_path=path)
        out.append(losses)
    return out


@pytest.mark.timeout(900)
def test_a_fresh_process_resumes_exactly_on_either_side_of_the_switch(kills):
    """For every scenario the last kill that left the old checkpoint and the first that left the new one: a Trainer
    resumes from the path and continues like the uninterrupted run (steps 2-3 from the old, step 3 from the new)."""
    paths, want = [], []
    for scenario, info in kills["scenarios"].items():
        steps = [_read(scenario, r["path"])[0] for r in info["runs"]]
        switch = steps.index(2)
        paths += [info["runs"][switch - 1]["path"], info["runs"][switch]["path"]]
        want += [kills["record"]["losses"][1:3], kills["record"]["losses"][2:3]]
    got = run_distributed(_resume, 1, paths, timeout=600)
    for path, g, w in zip(paths, got, want):
        assert g == pytest.approx(w, rel=1e-6), (path, g, w)
