"""Checkpoints survive failures and report damage: atomic saves (a failure during a save leaves the previous
checkpoint loadable), checksums that name a damaged file, and a checkpoint of another model refused before any
step with the mismatching names and shapes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from parallel_harness import GLOBAL_BATCH, FixedData, small_config

from lightning_moe import MoELanguageModel, MoEParallelStrategy
from lightning_moe.checkpoint.files import CorruptCheckpointError, SafeCheckpointIO


def _corrupt(path: Path, offset: int = 4096, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    offset = min(offset, len(data) - n)
    data[offset:offset + n] = os.urandom(n)
    path.write_bytes(bytes(data))


def test_safe_checkpoint_io_is_atomic_and_detects_damage(tmp_path, monkeypatch):
    io = SafeCheckpointIO()
    path = tmp_path / "a.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(4096.0)}, "step": 1}, path)
    assert io.load_checkpoint(path)["step"] == 1

    # an exception in the middle of the next save leaves the previous checkpoint complete and loadable
    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="injected"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(4096)}, "step": 2}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["step"] == 1
    assert not (tmp_path / "a.ckpt.tmp").exists()

    # random bytes in the file: the load names it
    _corrupt(path)
    with pytest.raises(CorruptCheckpointError, match="a.ckpt is damaged"):
        io.load_checkpoint(path)
    # a truncated file without a sidecar is still a clear error
    (tmp_path / "a.ckpt.crc32").unlink()
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CorruptCheckpointError, match="cannot be read as a checkpoint"):
        io.load_checkpoint(path)
    with pytest.raises(IsADirectoryError, match="distributed checkpoint"):
        io.load_checkpoint(tmp_path)


def _trainer(devices: int, strategy: Any, steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)


def _distributed(rank: int, world_size: int, tmp: str) -> dict:
    out: dict[str, Any] = {}
    model = MoELanguageModel(small_config(), warmup_steps=0)
    trainer = _trainer(2, MoEParallelStrategy(ep=2), 1)
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH))
    path = Path(tmp) / "dist.ckpt"
    trainer.save_checkpoint(path)
    out["files"] = sorted(p.name for p in path.iterdir())
    # a failing save (injected after the tensors were written) leaves the previous checkpoint intact
    from lightning_moe.strategies import moe_parallel

    real = moe_parallel.write_dir_checksums

    def failing(*args: Any, **kwargs: Any) -> None:
        raise OSError("killed during save (injected)")

    moe_parallel.write_dir_checksums = failing
    try:
        trainer.save_checkpoint(path)
    except OSError as e:
        out["save_error"] = str(e)
    finally:
        moe_parallel.write_dir_checksums = real
    dist.barrier()
    model2 = MoELanguageModel(small_config(), warmup_steps=0)
    trainer2 = _trainer(2, MoEParallelStrategy(ep=2), 2)
    trainer2.fit(model2, datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH * 2), ckpt_path=str(path))
    out["resumed_steps"] = model2.global_step
    # random bytes in one shard: the resume names the file
    if rank == 0:
        _corrupt(path / "__1_0.distcp", offset=200)
    dist.barrier()
    try:
        _trainer(2, MoEParallelStrategy(ep=2), 2).fit(
            MoELanguageModel(small_config(), warmup_steps=0),
            datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH * 2), ckpt_path=str(path))
        out["corrupt"] = "loaded"
    except CorruptCheckpointError as e:
        out["corrupt"] = str(e)
    dist.barrier()
    # a checkpoint of another model shape: refused before any step, naming keys and shapes
    other = Path(tmp) / "other.ckpt"
    wide = MoELanguageModel(small_config(num_experts=8), warmup_steps=0)
    t = _trainer(2, MoEParallelStrategy(ep=2), 1)
    t.fit(wide, datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH))
    t.save_checkpoint(other)
    narrow = MoELanguageModel(small_config(), warmup_steps=0)
    try:
        _trainer(2, MoEParallelStrategy(ep=2), 2).fit(
            narrow, datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH * 2), ckpt_path=str(other))
        out["mismatch"] = ("loaded", narrow.global_step)
    except ValueError as e:
        out["mismatch"] = (str(e), narrow.global_step)
    return out


@pytest.mark.timeout(600)
def test_distributed_checkpoints_are_atomic_checksummed_and_shape_checked(tmp_path):
    out = run_distributed(_distributed, 2, str(tmp_path))
    assert "checksums.json" in out["files"] and "meta.pt" in out["files"] and "__1_0.distcp" in out["files"]
    assert "injected" in out["save_error"]
    assert out["resumed_steps"] == 2, "the previous checkpoint must still load after a failed save"
    assert "__1_0.distcp" in out["corrupt"] and "damaged" in out["corrupt"], out["corrupt"]
    msg, steps = out["mismatch"]
    assert "written for another model" in msg and "router.weight: checkpoint [8, 64] vs model [4, 64]" in msg, msg
    assert steps == 0


def test_single_device_checkpoint_of_another_model_is_refused(tmp_path):
    model = MoELanguageModel(small_config(num_experts=8), warmup_steps=0)
    trainer = _trainer(1, "auto", 1)
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH))
    path = tmp_path / "wide.ckpt"
    trainer.save_checkpoint(path)
    narrow = MoELanguageModel(small_config(), warmup_steps=0)
    with pytest.raises(ValueError, match=r"router.weight: checkpoint \[8, 64\] vs model \[4, 64\]"):
        _trainer(1, "auto", 2).fit(narrow, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH * 2), ckpt_path=str(path))
    assert narrow.global_step == 0


def test_final_checkpoint_and_a_new_lr_on_resume(tmp_path):
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    def trainer(steps: int, *callbacks: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         use_distributed_sampler=False, default_root_dir=str(tmp_path),
                         callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3,
                                                    save_top_k=-1), *callbacks])

    model = MoELanguageModel(small_config(), lr=1e-3, warmup_steps=0, max_steps=20)
    trainer(5).fit(model, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH * 5))
    files = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.suffix == ".ckpt")
    assert any("step=3" in f for f in files) and "last.ckpt" in files, files
    last = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 5
    five = tmp_path / "five.ckpt"
    five.write_bytes((tmp_path / "ck" / "last.ckpt").read_bytes())

    class LR(Callback):
        lr = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if self.lr is None:  # the first step after the resume
                self.lr = trainer.optimizers[0].param_groups[0]["lr"]

    from lightning_moe.module import warmup_cosine

    for new_lr, want_base in ((1e-3, 1e-3), (5e-5, 5e-5)):
        rec = LR()
        resumed = MoELanguageModel(small_config(), lr=new_lr, warmup_steps=0, max_steps=20)
        trainer(8, rec).fit(resumed, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH * 8),
                            ckpt_path=str(five))
        # the schedule's position (step 5 of 20) continues with the base LR given now
        assert rec.lr == pytest.approx(want_base * warmup_cosine(5, 0, 20, 0.1)), (new_lr, rec.lr)


def _model_checkpoint_dirs(rank: int, world_size: int, tmp: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    cb = ModelCheckpoint(dirpath=tmp, filename="{step}", every_n_train_steps=1, save_top_k=2, monitor="train_loss",
                         mode="min", save_last=True)
    model = MoELanguageModel(small_config(), lr=1e-2, warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEParallelStrategy(ep=2), max_steps=4, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[cb])
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH * 4))
    dist.barrier()
    from lightning_moe.checkpoint import VERSIONS_DIR, resolve

    return {"entries": sorted(p.name for p in Path(tmp).iterdir()), "best": sorted(Path(p).name for p in cb.best_k_models),
            "dirs": all((Path(tmp) / n).is_dir() for n in ("last.ckpt",)),
            "versions": sorted(p.name for p in (Path(tmp) / VERSIONS_DIR).iterdir()),
            "linked": sorted(resolve(p).name for p in Path(tmp).iterdir() if p.name.endswith(".ckpt"))}


def test_model_checkpoint_top_k_and_last_with_distributed_checkpoints(tmp_path):
    out = run_distributed(_model_checkpoint_dirs, 2, str(tmp_path))
    ckpts = [e for e in out["entries"] if e.endswith(".ckpt")]
    # top-2 of 4 steps kept (the others removed, directories included) plus last; no temporary leftovers
    assert sorted(ckpts) == sorted(out["best"] + ["last.ckpt"]), out
    assert len(out["best"]) == 2 and out["dirs"]
    assert not any(e.endswith((".tmp", ".old")) for e in out["entries"]), out
    # each kept checkpoint is a link to its one version; the removed ones took their versions with them
    assert out["versions"] == out["linked"] and len(out["versions"]) == 3, out


def _async(rank: int, world_size: int, tmp: str) -> dict:
    from lightning.pytorch.callbacks import Callback

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 2:
                trainer.save_checkpoint(f"{tmp}/async.ckpt")
                self.visible_right_after = Path(f"{tmp}/async.ckpt").exists()

    def run(steps: int, ckpt: Any = None, async_save: bool = True, callbacks: Any = ()) -> Any:
        torch.manual_seed(0 if ckpt is None else 1)
        model = MoELanguageModel(small_config(), lr=1e-2, warmup_steps=1, max_steps=4)
        losses: list[float] = []

        class Rec(Callback):
            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                losses.append(float(pl_module.step_result.loss))

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEParallelStrategy(ep=2, async_save=async_save),
                            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                            use_distributed_sampler=False, callbacks=[Rec(), *callbacks])
        # one batch per epoch, the same every epoch: a resume reads what the uninterrupted run read
        trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH), ckpt_path=ckpt)
        return losses

    cb = SaveAt()
    ref = run(4, callbacks=[cb])
    out = {"visible_right_after": cb.visible_right_after,
           "files": sorted(p.name for p in Path(f"{tmp}/async.ckpt").iterdir()),
           "leftovers": sorted(p.name for p in Path(tmp).iterdir() if p.name.endswith((".tmp", ".old")))}
    out["ref"], out["resumed"] = ref, run(4, ckpt=f"{tmp}/async.ckpt", async_save=False)
    return out


def test_async_save_becomes_visible_atomically_and_resumes_exactly(tmp_path):
    out = run_distributed(_async, 2, str(tmp_path))
    assert out["visible_right_after"] is False, "the checkpoint must appear only once completely written"
    assert "checksums.json" in out["files"] and "meta.pt" in out["files"] and not out["leftovers"], out
    ref, resumed = out["ref"], out["resumed"]
    assert len(resumed) == 2 and resumed == pytest.approx(ref[2:], rel=1e-5), (ref, resumed)
