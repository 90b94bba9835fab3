"""MoELanguageModel: the LightningModule (build, configure_model, steps, optimizers).

Loss normalisation (DESIGN invariant 4): every micro-batch backpropagates the *sum* of its token losses plus its
global valid-token count times its MoE losses; before the optimizer step the gradients are multiplied by
``accumulate_grad_batches / N`` (N = valid tokens of the whole optimizer step over all data-parallel ranks and
micro-batches; Lightning has already divided by accumulate_grad_batches). The step's objective is therefore

    sum(token losses) / N  +  sum_mb (n_mb / N) * sum_layers (aux_mb + z_mb)

which is the plain mean token loss plus the MoE losses (a token-weighted mean over micro-batches, equal to the
plain mean when micro-batches hold equal token counts) and does not depend on the layout.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_moe.config import ModelConfig, resolve_model_config
from lightning_moe.models.transformer import MoETransformer
from lightning_moe.parallel.grads import scale_grads_

IGNORE_INDEX = -100


def _load_unsharded_init(model: MoETransformer, config: ModelConfig, seed: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.device("meta"):
        full = MoETransformer(config)
    full.to_empty(device="cpu")
    torch.manual_seed(seed)
    full.init_weights()
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))


def _resolve_config(config: Union[ModelConfig, str, dict]) -> ModelConfig:
    """A ModelConfig, a preset name, or a dict of fields with an optional "preset" key (see resolve_model_config)."""
    return resolve_model_config(config)


def shift_labels(input_ids_BS: Tensor, attention_mask_BS: Optional[Tensor] = None) -> Tensor:
    """Hugging Face convention: labels are the inputs shifted left by one; the last position and padding are -100."""
    labels = torch.full_like(input_ids_BS, IGNORE_INDEX)
    labels[:, :-1] = input_ids_BS[:, 1:]
    if attention_mask_BS is not None:
        labels[:, :-1] = labels[:, :-1].masked_fill(attention_mask_BS[:, 1:] == 0, IGNORE_INDEX)
    return labels


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class MoELanguageModel(L.LightningModule):
    """A decoder MoE language model for Lightning.

    Args:
        config: a ModelConfig, a preset name (``ModelConfig.from_preset``) or a dict of ModelConfig fields with an
            optional ``"preset"`` key: ``{"preset": "qwen3_moe_30b_a3b", "num_layers": 2, "moe": {"top_k": 4}}``.
        lr, min_lr_ratio, warmup_steps, max_steps: AdamW with linear warmup then cosine decay to
            ``lr * min_lr_ratio`` at ``max_steps`` (None = the trainer's estimated stepping batches).
        weight_decay: applied to matrices only (not to norms, biases, embeddings; the router bias is a buffer).
        betas, eps: AdamW.
        fused: fused AdamW (None = on when the parameters live on CUDA).
    """

    def __init__(
        self,
        config: Union[ModelConfig, str, dict] = "tiny",
        lr: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        max_steps: Optional[int] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.config = _resolve_config(config)
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        # configs are stored as plain dicts so weights_only checkpoint loading accepts them
        self.save_hyperparameters(
            {"config": self.config.to_dict(), "lr": lr, "min_lr_ratio": min_lr_ratio, "warmup_steps": warmup_steps,
             "max_steps": max_steps, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps, "fused": fused}
        )
        self.model: Optional[MoETransformer] = None
        self._step_loss_sum: Optional[Tensor] = None
        self._step_tokens: Optional[Tensor] = None
        self._val_sums: Optional[Tensor] = None
        self._last_step_time: Optional[float] = None

    # ---- model construction -------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Builds the model on the meta device, materialises it on the strategy's device and initialises it;
        a parallel strategy then attaches its layout. Idempotent, as Lightning requires."""
        if self.model is not None:
            return
        with torch.device("meta"):
            model = MoETransformer(self.config)
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        strategy = self._trainer.strategy if self._trainer is not None else None
        parallelize_fn = getattr(strategy, "parallelize_model", None)
        if parallelize_fn is not None:
            # parallel layouts shard on meta, then materialise only the local shards
            model = parallelize_fn(model)
        model.to_empty(device=device)
        if strategy is not None and strategy.world_size > 1:
            # one initialisation for the whole world: replicated plain tensors (e.g. the router under tp without
            # FSDP) must agree across ranks, whatever each process's RNG state was
            torch.manual_seed(strategy.broadcast(torch.initial_seed() % 2**63))
        model.init_weights()
        if device.type == "cpu" and any(isinstance(p, DTensor) for p in model.parameters()):
            # CPU meshes have no DTensor RNG tracker: every rank would draw the same numbers for its own shard
            # (duplicated experts and router rows). Initialise the unsharded model and load it instead: the same
            # weights as one process (CPU runs are small).
            _load_unsharded_init(model, self.config, torch.initial_seed())
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        return self.model(input_ids, attention_mask)

    # ---- loss -------------------------------------------------------------------------------------------
    def _reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over the ranks that hold distinct tokens (the strategy's data-parallel and context-parallel
        ranks); identity on one process."""
        fn = getattr(self._trainer.strategy, "reduce_token_sum", None) if self._trainer is not None else None
        return t if fn is None else fn(t)

    def _token_loss_sum(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(sum of token losses, local valid-token count) for a batch, in fp32."""
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        labels = batch.get("labels")
        if labels is None:
            labels = shift_labels(input_ids, attention_mask)
        elif attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
        positions = None
        shard = getattr(self._trainer.strategy, "shard_batch", None) if self._trainer is not None else None
        if shard is not None:
            # context parallel: this rank's load-balanced chunks, labels shifted on the full sequence first
            local = shard({"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask})
            input_ids, labels, attention_mask = local["input_ids"], local["labels"], local.get("attention_mask")
            positions = local.get("position_ids")
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        logits_BSV = self.model(input_ids, attention_mask, positions)
        loss_sum = F.cross_entropy(
            logits_BSV.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss_sum, (labels != IGNORE_INDEX).sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        loss_sum, n_local = self._token_loss_sum(batch)
        sums = self._reduce_sum(torch.stack([loss_sum.detach(), n_local.to(loss_sum.dtype)]))
        n_global = sums[1]
        aux, z = self.model.moe_losses()
        if self._step_tokens is None:
            self._step_loss_sum, self._step_tokens = sums[0], n_global
            self._step_aux, self._step_z = aux.detach(), z.detach()
            self._num_micro = 1
        else:
            self._step_loss_sum = self._step_loss_sum + sums[0]
            self._step_tokens = self._step_tokens + n_global
            self._step_aux, self._step_z = self._step_aux + aux.detach(), self._step_z + z.detach()
            self._num_micro += 1
        return loss_sum + n_global * (aux + z)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.model is not None and self._step_tokens is not None
        sync = getattr(self.trainer.strategy, "sync_replicated_grads", None)
        if sync is not None:
            sync()
        n_step = self._step_tokens.clamp(min=1)
        scale = self.trainer.accumulate_grad_batches / n_step
        scale_grads_(self.parameters(), scale)  # per local shard: parameters live on several meshes
        for layer in self.model.moe_layers():
            layer.router.update_expert_bias()
        train_loss = self._step_loss_sum / n_step
        self.last_train_loss = train_loss.detach()
        if not bool(torch.isfinite(train_loss)):
            raise FloatingPointError(
                f"train_loss is {train_loss.item()} at step {self.global_step}: the run diverged. Lower the learning "
                "rate, enable gradient clipping (gradient_clip_val) or check the data; the last checkpoint is intact."
            )
        self.log("train_loss", train_loss, prog_bar=True)
        self.log("train/aux_loss", self._step_aux / self._num_micro)
        self.log("train/z_loss", self._step_z / self._num_micro)
        self.log("train/tokens", self._step_tokens.float())
        # throughput of the whole run (all ranks): valid tokens of the step over the wall time since the last step
        # (the finiteness check above synchronised, so the clock sees the device's work)
        now = time.perf_counter()
        if self._last_step_time is not None:
            tps = float(self._step_tokens) / max(now - self._last_step_time, 1e-9)
            self.log("train/tokens_per_sec", tps, prog_bar=True)
            self.log("train/tokens_per_sec_per_device", tps / self.trainer.world_size)
        self._last_step_time = now
        self._log_routing_stats()
        self._step_loss_sum = self._step_tokens = None

    @torch.no_grad()
    def _log_routing_stats(self) -> None:
        """Per MoE layer (last micro-batch, all ranks): aux and z losses, the load of the busiest expert over the
        mean load, and in capacity mode the fraction of assignments dropped. One small all-reduce per step."""
        layers = self._moe_layers_by_index()
        if not layers:
            return
        counts_LE = torch.stack([layer.last_stats["tokens_per_expert"].float() for _, layer in layers])
        dropped_L = torch.stack([layer.last_stats["num_dropped"].float() for _, layer in layers])
        stats = torch.cat([counts_LE, dropped_L[:, None]], dim=1)
        group = layers[0][1].router.global_group
        if group is not None:
            import torch.distributed._functional_collectives as funcol

            stats = funcol.all_reduce(stats, "sum", group)
        counts_LE, dropped_L = stats[:, :-1], stats[:, -1]
        load_ratio_L = counts_LE.max(-1).values / counts_LE.mean(-1).clamp(min=1e-9)
        assigned_L = counts_LE.sum(-1) + dropped_L
        for i, (layer_idx, layer) in enumerate(layers):
            self.log(f"moe/layer{layer_idx}/aux_loss", layer.last_aux_loss.detach())
            self.log(f"moe/layer{layer_idx}/z_loss", layer.last_z_loss.detach())
            self.log(f"moe/layer{layer_idx}/max_load_ratio", load_ratio_L[i])
            if layer.config.capacity_factor is not None:
                self.log(f"moe/layer{layer_idx}/dropped_fraction", dropped_L[i] / assigned_L[i].clamp(min=1))

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clip by the true global norm over every mesh (torch's clip_grad_norm_ fails on parameters living on
        two meshes); runs after the gradients were rescaled to the step's mean."""
        if gradient_clip_val is None or gradient_clip_val <= 0:
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"only gradient_clip_algorithm='norm' is supported, got {gradient_clip_algorithm!r}")
        from lightning_moe.parallel.grads import clip_grad_norm_

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = clip_grad_norm_(params, gradient_clip_val)
        self.log("train/grad_norm", norm)

    def _moe_layers_by_index(self) -> list[tuple[int, Any]]:
        assert self.model is not None
        return [(int(i), blk.moe) for i, blk in self.model.layers.items() if blk.is_moe]

    # ---- validation ---------------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sums = None
        self._last_step_time = None  # validation time is no training throughput

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss_sum, n_local = self._token_loss_sum(batch)
        s = torch.stack([loss_sum.detach(), n_local.to(loss_sum.dtype)])
        self._val_sums = s if self._val_sums is None else self._val_sums + s

    def on_validation_epoch_end(self) -> None:
        if self._val_sums is None:
            return
        sums = self._reduce_sum(self._val_sums)
        val_loss = sums[0] / sums[1].clamp(min=1)
        self._val_sums = None
        if self.trainer.sanity_checking:
            # Lightning discards what the sanity check logs; when it covers the whole (limited) validation set
            # (num_sanity_val_steps=-1) it is the baseline before training, worth keeping at step 0.
            if self.trainer.num_sanity_val_steps == float("inf") or self.trainer.num_sanity_val_steps < 0:
                self.initial_val_loss = float(val_loss)
                rank_zero_info(f"val_loss before training: {self.initial_val_loss:.4f}")
                for logger in self.loggers:
                    logger.log_metrics({"val_loss": self.initial_val_loss}, step=0)
            return
        self.last_val_loss = float(val_loss)
        # already the global value on every rank; sync_dist only quiets Lightning's warning (one tiny all-reduce)
        self.log("val_loss", val_loss, prog_bar=True, sync_dist=True)

    def on_fit_end(self) -> None:
        first, last = getattr(self, "initial_val_loss", None), getattr(self, "last_val_loss", None)
        if first is not None and last is not None:
            rank_zero_info(
                f"val_loss {first:.4f} -> {last:.4f} ({100 * (last - first) / first:+.1f}%) over {self.global_step} steps"
            )

    # ---- optimisation -------------------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            # no weight decay on norms, biases (all 1-D) and embeddings; DTensors and plain tensors (e.g. the
            # router under tp without FSDP) in separate groups: one fused/foreach kernel cannot mix them
            no_decay = p.ndim < 2 or "tok_embeddings" in name
            groups.setdefault((no_decay, isinstance(p, DTensor)), []).append(p)
        params = [p for g in groups.values() for p in g]
        fused = hp.fused
        if fused is None:
            fused = bool(params) and all(p.device.type == "cuda" for p in params)
        optimizer = torch.optim.AdamW(
            [{"params": g, "weight_decay": 0.0 if no_decay else hp.weight_decay}
             for (no_decay, _), g in sorted(groups.items())],
            lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, fused=fused,
        )
        total = hp.max_steps
        if total is None:
            total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        warmup, min_ratio = hp.warmup_steps, hp.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, max(total, 1), min_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
