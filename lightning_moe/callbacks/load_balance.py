"""LoadBalanceMonitor: routing health of every MoE layer in any Lightning logger (plus W&B / TensorBoard heatmaps
and a JSONL file of raw counts).

Each finalised optimizer step's routing records (the module's ``step_result``, a
:class:`~lightning_moe.step.StepResult` whose ``routing`` holds one :class:`~lightning_moe.moe.record.RoutingRecord`
per MoE layer, the typed record the model's forward produced; already summed over every rank routing distinct tokens and over the step's micro-batches, identical on every rank) are added
to window sums kept on the device: no host sync on steps that do not log. Every ``log_every_n_steps`` optimizer steps
rank 0 moves the window to the host once, computes the metrics (:mod:`lightning_moe.callbacks.routing_metrics`) and
hands them to every logger; no collective is issued.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import uuid
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_moe.callbacks.routing_metrics import SCALARS, load_heatmap, pack_step, window_metrics
from lightning_moe.flags import check_flags

__all__ = ["LoadBalanceMonitor"]

HEATMAP_KEY = "moe/load_heatmap"
# bins of one W&B histogram (wandb.Histogram allows at most 512)
_WANDB_MAX_BINS = 512


def _local(t: Tensor) -> Tensor:
    """The expert bias is a plain (replicated) buffer; never gather it here (rank 0 alone calls this)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        assert all(isinstance(p, Replicate) for p in t.placements), t.placements
        return t.to_local()
    return t


class LoadBalanceMonitor(L.Callback):
    """Logs the routing health of every MoE layer of a :class:`~lightning_moe.MoELanguageModel`.

    Every ``log_every_n_steps`` optimizer steps (when ``global_step + 1`` is a multiple, like Lightning's own
    ``log_every_n_steps``), over the window of optimizer steps since the last log and over every rank that routes
    distinct tokens, logged once from rank 0 through every logger's ``log_metrics`` at the step Lightning logs that
    step's ``train_loss`` at:

    - ``moe/layer{i}/max_load_ratio``, ``min_load_ratio`` (busiest / idlest expert's kept assignments over the mean),
      ``load_cv`` (coefficient of variation of the per-expert counts), ``dead_experts`` (experts with no token in the
      window), ``dropped_fraction`` (assignments dropped by capacity over all assignments; 0 when dropless),
      ``router_entropy`` (mean over valid tokens of the entropy, in nats, of the router's score distribution over all
      E experts: softmax scores, or for sigmoid scoring the scores normalised to sum to 1; ``log E`` is uniform),
      ``aux_loss`` and ``z_loss`` (means per micro-batch, coefficients applied), ``expert_bias_mean`` and
      ``expert_bias_max_abs`` (current values, with expert bias), and with ``per_expert_metrics`` one
      ``expert{j}/load_fraction`` scalar per expert;
    - ``moe/max_load_ratio`` and ``moe/worst_layer`` (the layer with the largest max/mean), ``moe/load_cv_mean``,
      ``moe/router_entropy_mean``, ``moe/dead_experts`` (over all layers), ``moe/dropped_fraction``,
      ``moe/window_steps``.

    With a ``WandbLogger`` and ``heatmap``: ``moe/load_heatmap``, a layers x experts ``wandb.Image`` (see
    :func:`~lightning_moe.callbacks.routing_metrics.load_heatmap`; needs ``pillow``), and with ``histograms`` one
    ``moe/layer{i}/load`` ``wandb.Histogram`` per layer whose bin j holds expert j's share of the layer's load (W&B's
    histogram panel then shows every expert's load over time). With a ``TensorBoardLogger``: the heatmap through
    ``add_image``. Other loggers (CSV, ...) get the scalars.

    ``jsonl_path``: rank 0 appends one line per layer and log step with the raw window sums (counts summed over the
    window and every rank): ``{"run", "step", "layer", "tokens_per_expert": [...], "num_tokens", "num_dropped",
    "aux_loss", "z_loss", "entropy", "expert_bias": [...] | null, "window_steps", "micro_batches"}`` (losses: means
    per micro-batch; entropy: mean per token). The file is opened in append mode (a resumed run continues it) and
    flushed at every log step; ``run`` (:attr:`run_id`: the start time of the ``fit`` and a random suffix) tells the
    lines of one ``fit`` from those of another written to the same file.

    Skipped optimizer steps (``MoELanguageModel(skip_empty_steps=True)``) are left out of the window. With
    ``log_on_train_end`` the steps since the last log are logged when training ends (``moe/window_steps`` says how
    many). The window is not saved in checkpoints: after a resume it starts empty. Attached to a module that is not
    a ``MoELanguageModel`` it raises at setup; on a model without MoE layers it warns and does nothing.

    Args:
        log_every_n_steps: optimizer steps per window (>= 1).
        heatmap: the layers x experts load image (W&B and TensorBoard).
        histograms: the per-layer W&B histograms.
        jsonl_path: a file for the raw counts (parent folders are created), or None.
        per_expert_metrics: also one scalar per layer and expert (E can be 256: off by default).
        log_on_train_end: log the last, partial window when training ends.
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        heatmap: bool = True,
        jsonl_path: Optional[Union[str, os.PathLike]] = None,
        histograms: bool = True,
        per_expert_metrics: bool = False,
        log_on_train_end: bool = True,
    ) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"LoadBalanceMonitor(log_every_n_steps=...) must be an integer >= 1 (optimizer steps per "
                             f"logged window), got {log_every_n_steps!r}")
        check_flags("LoadBalanceMonitor", heatmap=heatmap, histograms=histograms,
                    per_expert_metrics=per_expert_metrics, log_on_train_end=log_on_train_end)
        if jsonl_path is not None and not isinstance(jsonl_path, (str, os.PathLike)):
            raise ValueError(f"LoadBalanceMonitor(jsonl_path=...) must be a file path or None, got {jsonl_path!r}")
        if jsonl_path is not None and os.path.isdir(jsonl_path):
            raise ValueError(f"LoadBalanceMonitor(jsonl_path={str(jsonl_path)!r}) is a directory: give a file path, "
                             "e.g. .../routing.jsonl")
        self.log_every_n_steps = log_every_n_steps
        self.heatmap = heatmap
        self.histograms = histograms
        self.jsonl_path = os.fspath(jsonl_path) if jsonl_path is not None else None
        self.per_expert_metrics = per_expert_metrics
        self.log_on_train_end = log_on_train_end
        self.last_metrics: dict[str, float] = {}  # the last logged scalars (rank 0)
        self._layer_ids: list[int] = []
        self._window_LC: Optional[Tensor] = None  # float64 sums on the device
        self._window_steps = 0
        self._window_micro_batches = 0
        self._window_end = -1  # the step index of the window's last step
        self._last_result: Any = None
        self._warned_pillow = False
        self.run_id: Optional[str] = None  # set when training starts; the "run" of the JSONL lines

    # ---- Lightning hooks ------------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning_moe.module import MoELanguageModel  # lazily: lightning_moe.cli imports both

        if not isinstance(pl_module, MoELanguageModel):
            raise ValueError(f"LoadBalanceMonitor reads the routing statistics of a lightning_moe.MoELanguageModel, "
                             f"not of a {type(pl_module).__name__}: remove it from the trainer's callbacks")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        model = pl_module.model
        self._layer_ids = [int(i) for i, blk in model.layers.items() if blk.is_moe]
        self._reset_window()
        if not self._layer_ids:
            rank_zero_warn("LoadBalanceMonitor: the model has no MoE layer; nothing will be logged")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # runs after the gradient finalisation, so the module's step_result is this step's global result
        result = pl_module.step_result
        if not trainer.is_global_zero or not self._layer_ids or result is None or result is self._last_result:
            return
        self._last_result = result
        if result.skipped or not result.routing:
            return
        assert sorted(result.routing) == self._layer_ids, (sorted(result.routing), self._layer_ids)
        step_LC = pack_step({i: result.routing[i] for i in self._layer_ids}).double()
        if self._window_LC is None:
            self._window_LC = step_LC
        else:
            self._window_LC.add_(step_LC)
        self._window_steps += 1
        self._window_micro_batches += result.num_micro_batches
        self._window_end = step = trainer.global_step  # this step's index; Lightning logs its train_loss there
        if (step + 1) % self.log_every_n_steps == 0:
            self._log_window(trainer, pl_module, step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.log_on_train_end and trainer.is_global_zero and self._window_steps > 0:
            self._log_window(trainer, pl_module, self._window_end)

    # ---- logging (rank 0, log steps only) ---------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._window_LC = None
        self._window_steps = self._window_micro_batches = 0

    def _biases(self, pl_module: L.LightningModule) -> Optional[Tensor]:
        biases = [pl_module.model.layers[str(i)].moe.router.expert_bias for i in self._layer_ids]
        if any(b is None for b in biases):
            return None
        return torch.stack([_local(b).detach().double() for b in biases])

    def _log_window(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        assert self._window_LC is not None
        window_LC, bias_LE = self._window_LC, self._biases(pl_module)
        E = window_LC.shape[1] - len(SCALARS)
        # the one host transfer of a log step
        packed = window_LC if bias_LE is None else torch.cat([window_LC, bias_LE.to(window_LC.device)], dim=1)
        packed = packed.cpu()
        window_LC, bias_LE = packed[:, :E + len(SCALARS)], (None if bias_LE is None else packed[:, E + len(SCALARS):])
        steps, micro_batches = self._window_steps, self._window_micro_batches
        self._reset_window()

        metrics = window_metrics(self._layer_ids, window_LC, micro_batches, steps, bias_LE, self.per_expert_metrics)
        self.last_metrics = metrics
        counts_LE = window_LC[:, :E]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_metrics({**metrics, **self._wandb_media(counts_LE)}, step=step)  # one W&B step for all
                continue
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger) and self.heatmap:
                logger.experiment.add_image(HEATMAP_KEY, load_heatmap(counts_LE).numpy(), global_step=step,
                                            dataformats="HWC")
        if self.jsonl_path is not None:
            self._write_jsonl(step, window_LC, bias_LE, metrics, steps, micro_batches)

    def _wandb_media(self, counts_LE: Tensor) -> dict[str, Any]:
        import wandb

        media: dict[str, Any] = {}
        if self.heatmap:
            if importlib.util.find_spec("PIL") is not None:
                layers = ", ".join(map(str, self._layer_ids))
                media[HEATMAP_KEY] = wandb.Image(
                    load_heatmap(counts_LE).numpy(),
                    caption=f"rows: MoE layers {layers} (top to bottom); columns: experts 0..{counts_LE.shape[1] - 1}; "
                            "colour: log2(load / mean load), blue -2 .. white 0 .. red +2; black: no token")
            elif not self._warned_pillow:
                self._warned_pillow = True
                rank_zero_warn("LoadBalanceMonitor: the W&B load heatmap needs pillow (`pip install pillow`, or "
                               "`pip install lightning_moe[wandb]`); logging the scalars and histograms without it")
        if self.histograms:
            for idx, c_E in zip(self._layer_ids, counts_LE):
                frac_E = (c_E / c_E.sum().clamp(min=1)).numpy()
                E = frac_E.shape[0]
                # bin j = expert j; beyond W&B's bin limit, the distribution of the experts' shares instead
                hist = (wandb.Histogram(np_histogram=(frac_E, list(range(E + 1)))) if E <= _WANDB_MAX_BINS
                        else wandb.Histogram(frac_E, num_bins=64))
                media[f"moe/layer{idx}/load"] = hist
        return media

    def _write_jsonl(self, step: int, window_LC: Tensor, bias_LE: Optional[Tensor], metrics: dict[str, float],
                     steps: int, micro_batches: int) -> None:
        assert self.jsonl_path is not None
        E = window_LC.shape[1] - len(SCALARS)
        parent = os.path.dirname(os.path.abspath(self.jsonl_path))
        os.makedirs(parent, exist_ok=True)
        with open(self.jsonl_path, "a", encoding="utf-8") as f:
            for row, idx in enumerate(self._layer_ids):
                s = dict(zip(SCALARS, window_LC[row, E:].tolist()))
                layer = f"moe/layer{idx}/"
                line = {
                    "run": self.run_id,
                    "step": step,
                    "layer": idx,
                    "tokens_per_expert": [int(round(c)) for c in window_LC[row, :E].tolist()],
                    "num_tokens": int(round(s["num_tokens"])),
                    "num_dropped": int(round(s["num_dropped"])),
                    "aux_loss": metrics[layer + "aux_loss"],
                    "z_loss": metrics[layer + "z_loss"],
                    "entropy": metrics.get(layer + "router_entropy"),
                    "expert_bias": bias_LE[row].tolist() if bias_LE is not None else None,
                    "window_steps": steps,
                    "micro_batches": micro_batches,
                }
                f.write(json.dumps(line) + "\n")
            f.flush()
