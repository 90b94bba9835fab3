"""One-process Trainer runs in tests: fit, record every step's training loss, and release the strategy's process
group (a one-process group left behind would leak into later tests)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch


def fit_recording_losses(trainer: L.Trainer, module: L.LightningModule, datamodule: Any) -> list[float]:
    """``trainer.fit``; returns ``module.last_train_loss`` after every training batch."""
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *_: Any) -> None:
            losses.append(float(pl_module.last_train_loss))

    trainer.callbacks.append(Record())
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return losses
