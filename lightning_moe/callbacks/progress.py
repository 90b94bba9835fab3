"""The progress bar ``lightning-moe`` uses when ``rich`` is installed: Lightning's RichProgressBar, readable for
step-based runs.

* ``Epoch 0`` instead of ``Epoch 0/-2`` when the epochs are unbounded (``max_steps`` runs leave ``max_epochs=-1``;
  Lightning issue 21925, fixed after Lightning 2.6).
* Short names for the throughput, whole tokens per second (``tok/s: 7100``), and no ``v_num``: the metrics column of
  an 80-character console then holds them instead of cutting ``train/tokens_per_sec`` off. Loggers get the full
  names; only the bar's text changes.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["MoEProgressBar", "BAR_NAMES"]

#: logged name -> the progress bar's name for it
BAR_NAMES = {"train/tokens_per_sec": "tok/s"}


class MoEProgressBar(RichProgressBar):
    """RichProgressBar without the negative epoch total and with short throughput names (see the module docstring)."""

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        for name, short in BAR_NAMES.items():
            if name in items:
                items[short] = f"{float(items.pop(name)):.0f}"
        return items

    def _get_train_description(self, current_epoch: int) -> str:
        # RichProgressBar builds the text here and only knows max_epochs=None as unbounded; -1 means the same
        text = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            text = text.replace(f"Epoch {current_epoch}/{self.trainer.max_epochs - 1}", f"Epoch {current_epoch}")
        return text
