"""MoELanguageModel: the LightningModule (build pipeline, steps, optimizers, logging).

One piece (about 690 lines): one LightningModule whose hooks (steps, optimizer step, checkpoint hooks, logging)
share its state; the build pipeline (build.py), the step accumulator (step.py) and the losses (models/lm_loss.py)
live apart.

The step protocol (DESIGN invariant 13; docs/architecture.md): ``training_step`` calls the model's forward, which
returns an :class:`~lightning_moe.models.outputs.LMStepOutput` (token-loss sum, valid tokens, each MoE layer's losses
and routing record); the module's :class:`~lightning_moe.step.StepAccumulator` (``step_accumulator``) sums the
micro-batches; after the last backward ``optimizer_step`` hands the accumulated
:class:`~lightning_moe.step.StepRecord` to the strategy's ``finalize_step`` hook (or, on Lightning's single-device
strategy, to :func:`~lightning_moe.parallel.finalize.finalize_step` itself) and keeps the
:class:`~lightning_moe.step.StepResult` as ``step_result``, which the routing monitor reads.

Loss normalisation (DESIGN invariant 4): every micro-batch backpropagates the *sum* of its token losses plus its
global valid-token count times its MoE losses; once the step's last backward is done, the gradient finalisation
(:mod:`lightning_moe.parallel.finalize`) multiplies the gradients by
``accumulate_grad_batches / N`` (N = valid tokens of the whole optimizer step over all data-parallel ranks and
micro-batches; Lightning has already divided by accumulate_grad_batches). The step's objective is therefore

    sum(token losses) / N  +  sum_mb (n_mb / N) * sum_layers (aux_mb + z_mb)

which is the plain mean token loss plus the MoE losses (a token-weighted mean over micro-batches, equal to the
plain mean when micro-batches hold equal token counts) and does not depend on the layout. Every
``on_before_optimizer_step`` hook (callbacks' and the module's) sees the finalised gradient of that objective.

Strategies: :class:`~lightning_moe.MoEParallelStrategy` (any layout, one device included) or Lightning's
single-device strategy (the plain ``L.Trainer()`` on one device). Other strategies (DDP, Lightning's FSDP and
ModelParallel strategies, DeepSpeed) would silently use local token counts, local routing counts and rank 0's
expert bias: they are refused at setup.

One piece (over 500 lines): the LightningModule's hooks share its state (build, step accumulator, optimizers,
generation); Lightning calls them on one object.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence, Union

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe.build import ModelTransform, build_model
from lightning_moe.checkpoint.loop_state import start_next_epoch
from lightning_moe.checkpoint.optimizer_state import accept_state_by_name, optimizer_state_by_name
from lightning_moe.config import ModelConfig, resolve_model_config
from lightning_moe.flags import check_flags
from lightning_moe.models.labels import mask_document_ends, shift_labels  # noqa: F401  (public here too)
from lightning_moe.models.lm_loss import IGNORE_INDEX, LOSS_IMPLS
from lightning_moe.models.transformer import MoETransformer, check_components
from lightning_moe.optim import AdamW, MasterAdamW
from lightning_moe.optim.schedule import warmup_cosine  # noqa: F401  (public here too)
from lightning_moe.models.outputs import LMStepOutput
from lightning_moe.parallel.finalize import finalize_step, finalizing_closure
from lightning_moe.step import StepAccumulator, StepResult
from lightning_moe.strategies import MoEParallelStrategy, ParallelRequirements

_MASTER_DTYPES = {None: None, "fp32": torch.float32, "float32": torch.float32}


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


class MoELanguageModel(L.LightningModule):
    """A decoder MoE language model for Lightning.

    Args:
        config: a ModelConfig, a preset name (``ModelConfig.from_preset``) or a dict of ModelConfig fields with an
            optional ``"preset"`` key: ``{"preset": "qwen3_moe_30b_a3b", "num_layers": 2, "moe": {"top_k": 4}}``.
        lr, min_lr_ratio, warmup_steps, max_steps: AdamW with linear warmup then cosine decay to
            ``lr * min_lr_ratio`` at ``max_steps`` (None = the trainer's estimated stepping batches).
        weight_decay: applied to matrices only (not to norms, biases, embeddings; the router bias is a buffer).
        betas, eps: AdamW.
        fused: fused AdamW (None = on when the parameters live on CUDA); with ``master_dtype`` the Triton kernel of
            :class:`~lightning_moe.optim.MasterAdamW` (None = on CUDA when triton imports).
        master_dtype: ``"fp32"``: the optimizer keeps fp32 master weights and fp32 AdamW moments for every bf16 / fp16
            parameter (:class:`~lightning_moe.optim.MasterAdamW`, sharded like the parameters) while the model
            computes in its own dtype -- with ``precision="bf16-true"``: bf16 compute, fp32 master state, bf16
            gradients reduced in fp32 where they are reduced (FSDP2). Checkpoints hold the masters;
            ``save_pretrained`` and ``lightning-moe export`` write them. None: AdamW updates the parameters in their
            own dtype (bf16 moments under bf16-true).
        skip_empty_steps: an optimizer step whose whole global batch has no valid token (every label -100 or
            masked) raises by default; True skips it with a warning (no update, nothing logged as a loss).
        model_transforms: callables ``fn(model) -> model | None`` applied to the meta-device model before
            parallelisation (see :mod:`lightning_moe.build`); callbacks that define ``transform_model`` are
            applied too.
        pretrained: a local Hugging Face folder (config.json + safetensors) to start from: the model config comes
            from it (``config`` may be left out, or must describe the same model) and its weights replace the
            initialisation; under MoEParallelStrategy each rank reads only the slices it holds.
            ``MoELanguageModel.from_pretrained(path, **kwargs)`` is the same.
        predict_max_new_tokens: tokens ``predict_step`` (``trainer.predict``, ``lightning-moe predict``) generates
            after each prompt (greedy).
        loss_impl: how the output projection and cross-entropy run (:mod:`lightning_moe.models.lm_loss`):
            ``"auto"`` (chunked on CUDA: no [tokens, vocab] logits held, the gradients taken in the forward),
            ``"torch"`` (the reference), ``"chunked"``, ``"liger"`` (liger-kernel, the ``lm`` extra).
        attn_impl: the attention kernel of packed batches (``position_ids``), replacing ``config.attn_impl``
            (:mod:`lightning_moe.models.document_mask`): ``"auto"``, ``"sdpa"``, ``"flex"``, ``"varlen"``,
            ``"split"``; None keeps the config's (also with ``pretrained``).

    Batches: ``input_ids`` [B, S]; optional ``labels`` [B, S] *pre-shifted* (``labels[t]`` is the token after
    ``input_ids[t]``, -100 = ignore; absent: the inputs shifted), ``attention_mask`` and ``position_ids`` [B, S]
    (packed documents: positions restarting at 0 at each document start; attention then stays inside each document
    and the labels of documents' last tokens are dropped). Hugging Face's unshifted labels (``labels == input_ids``,
    as ``DataCollatorWithFlattening`` writes) are refused on the first training batch.
    """

    def __init__(
        self,
        config: Union[ModelConfig, str, dict, None] = None,
        lr: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        max_steps: Optional[int] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused: Optional[bool] = None,
        master_dtype: Optional[str] = None,
        skip_empty_steps: bool = False,
        model_transforms: Optional[Sequence[Callable[[nn.Module], Optional[nn.Module]]]] = None,
        pretrained: Optional[str] = None,
        predict_max_new_tokens: int = 64,
        loss_impl: str = "auto",
        attn_impl: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.hf_model_type: Optional[str] = None
        if pretrained is not None:
            from lightning_moe.models.hf import config_from_hf, load_hf_config

            hf = load_hf_config(pretrained)
            self.hf_model_type = hf.get("model_type")
            if config is None:
                config = config_from_hf(hf)
        self.config = _resolve_config("tiny" if config is None else config)
        if attn_impl is not None:
            self.config = dataclasses.replace(self.config, attn_impl=attn_impl)
        check_components(self.config)  # a misspelt component fails here, before the Trainer starts
        if pretrained is not None:
            from lightning_moe.models.hf import _config_differences, config_from_hf

            diff = _config_differences(self.config, config_from_hf(hf))
            if diff:
                raise ValueError(f"config does not describe the model in {pretrained}/config.json ({'; '.join(diff)}): "
                                 "leave config out to take the folder's, or fix those fields")
        check_flags("MoELanguageModel", skip_empty_steps=skip_empty_steps,
                    **({} if fused is None else {"fused": fused}))
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        # configs are stored as plain dicts so weights_only checkpoint loading accepts them
        self.save_hyperparameters(
            {"config": self.config.to_dict(), "lr": lr, "min_lr_ratio": min_lr_ratio, "warmup_steps": warmup_steps,
             "max_steps": max_steps, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps, "fused": fused,
             "master_dtype": master_dtype, "skip_empty_steps": skip_empty_steps, "pretrained": pretrained,
             "predict_max_new_tokens": predict_max_new_tokens, "loss_impl": loss_impl, "attn_impl": attn_impl}
        )
        if loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl must be one of {LOSS_IMPLS}, got {loss_impl!r}")
        self.loss_impl = loss_impl
        if master_dtype not in _MASTER_DTYPES:
            raise ValueError(f"master_dtype must be one of {sorted(k for k in _MASTER_DTYPES if k)} or None, got "
                             f"{master_dtype!r}")
        #: the optimizer's master dtype (None: it updates the parameters in their own dtype); the strategy reduces
        #: gradients in it under FSDP2
        self.master_dtype: Optional[torch.dtype] = _MASTER_DTYPES[master_dtype]
        self.pretrained = pretrained
        self.skip_empty_steps = skip_empty_steps
        self.model_transforms = list(model_transforms or [])
        self.model: Optional[MoETransformer] = None
        #: the running optimizer step: loss sum and token count (all data ranks), this process's routing records
        self.step_accumulator = StepAccumulator()
        #: the last finalised optimizer step (global numbers, identical on every rank): what callbacks such as
        #: LoadBalanceMonitor read in on_before_optimizer_step; None before the first step
        self.step_result: Optional[StepResult] = None
        self.last_train_loss: Optional[Tensor] = None
        self.initial_val_loss: Optional[float] = None
        self.last_val_loss: Optional[float] = None
        self._val_sums: Optional[Tensor] = None
        self._prev_step_time: Optional[float] = None
        self._last_saved_step = -1  # global step of the last checkpoint saved in this process
        self._restored_hparams: Optional[dict[str, Any]] = None  # of the checkpoint being resumed
        self._initial_state: Optional[dict[str, Tensor]] = None  # full weights to start from (upcycling)
        self._train_batch_checked = False  # the first training batch gets validate_batch (label convention too)

    # ---- strategy ---------------------------------------------------------------------------------------
    @property
    def _strategy(self) -> Optional[Strategy]:
        return self._trainer.strategy if self._trainer is not None else None

    @property
    def _parallel(self) -> Optional[MoEParallelStrategy]:
        s = self._strategy
        return s if isinstance(s, MoEParallelStrategy) else None

    def setup(self, stage: str) -> None:
        _check_strategy(self._strategy)

    def parallel_requirements(self) -> ParallelRequirements:
        """What :class:`~lightning_moe.MoEParallelStrategy` needs of this module (its one seam into it): the model
        config it checks against the layout and the batches, and the master-weight dtype its FSDP2 reduces in."""
        return ParallelRequirements(config=self.config, master_dtype=self.master_dtype)

    # ---- model construction: the build pipeline (lightning_moe.build) ---------------------------------------
    def configure_model(self) -> None:
        """build on meta -> model transforms (``model_transforms``, then callbacks' ``transform_model``, then the
        strategy's) -> the strategy's parallelize -> materialise on the strategy's device -> initialise.
        Idempotent, as Lightning requires."""
        if self.model is not None:
            return
        strategy = self._strategy
        _check_strategy(strategy)
        transforms = list(self.model_transforms)
        if self._trainer is not None:
            transforms += [cb.transform_model for cb in self._trainer.callbacks if isinstance(cb, ModelTransform)]
        parallel = self._parallel
        if parallel is not None:
            transforms += parallel.model_transforms()
        self.model = build_model(
            self.config,
            transforms=transforms,
            parallelize=parallel.parallelize_model if parallel is not None else None,
            device=strategy.root_device if strategy is not None else torch.device("cpu"),
            initialize=self._initialize,
        )

    def _initialize(self, model: MoETransformer) -> None:
        """Weights from ``pretrained`` (each rank reads its own slices), else the seeded init, the same weights
        whatever the layout."""
        if self._initial_state is not None:  # upcycled weights (full tensors): each rank keeps its shards
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, dict(self._initial_state), options=StateDictOptions(full_state_dict=True))
            self._initial_state = None
            model.reset_buffers()
            return
        if self.pretrained is not None:
            from lightning_moe.models.hf import load_hf_weights_

            result = load_hf_weights_(model, self.pretrained)
            rank_zero_info(f"loaded {self.pretrained} ({result.bytes_read / 2**20:.1f} MiB read on rank 0)")
            return
        strategy = self._strategy
        if strategy is not None and strategy.world_size > 1:
            # one initialisation for the whole world: replicated plain tensors (e.g. the router under tp without
            # FSDP) must agree across ranks, whatever each process's RNG state was
            torch.manual_seed(strategy.broadcast(torch.initial_seed() % 2**63))
        with torch.no_grad():
            model.init_weights()
        if model.tok_embeddings.weight.device.type == "cpu" and any(isinstance(p, DTensor) for p in model.parameters()):
            # CPU meshes have no DTensor RNG tracker: every rank would draw the same numbers for its own shard
            # (duplicated experts and router rows). Initialise the unsharded model and load it instead: the same
            # weights as one process (CPU runs are small).
            _load_unsharded_init(model, self.config, torch.initial_seed())

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None) -> Tensor:
        """Logits [B, S, V]. ``position_ids`` [B, S]: packed documents (positions restarting at 0 at each document
        start; attention never crosses a document). Checks the inputs against the model's limits (vocabulary,
        max_seq_len, a 0/1 mask, well-formed positions): a ValueError naming the limit, not an IndexError deep inside
        the model."""
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        optional = {"attention_mask": attention_mask, "position_ids": position_ids}
        self._check_batch({"input_ids": input_ids, **{k: v for k, v in optional.items() if v is not None}})
        return self.model(input_ids, attention_mask, position_ids_BS=position_ids)

    def _check_batch(self, batch: dict[str, Tensor]) -> None:
        from lightning_moe.data.collate import validate_batch

        validate_batch(batch, self.config.vocab_size, self.config.max_seq_len)

    # ---- Hugging Face ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> "MoELanguageModel":
        """A module that starts from the Hugging Face folder ``path`` (families qwen3_moe, mixtral, deepseek_v3,
        olmoe): ``MoELanguageModel(pretrained=path, **kwargs)``. The weights are read when the model is built
        (``configure_model``, which the Trainer calls), by every rank for its own shards."""
        return cls(pretrained=path, **kwargs)

    @classmethod
    def upcycle(cls, dense: Union["MoELanguageModel", str], moe: Any, granularity: int = 1,
                **kwargs: Any) -> "MoELanguageModel":
        """An MoE module upcycled from a dense one (Megatron's ``--moe-use-upcycling``): ``dense`` is a dense
        ``MoELanguageModel``, a checkpoint of one (a ``.ckpt`` file or a distributed checkpoint directory) or a
        Hugging Face dense folder (``qwen3``, ``llama``);
        ``moe`` a :class:`~lightning_moe.MoEConfig` (or dict). Experts start as copies of the dense MLP (granularity
        g > 1: g finer experts per copy), the router fresh, and the model's output at initialisation equals the
        dense model's (see :mod:`lightning_moe.models.upcycle` for the rule). ``kwargs`` go to the module."""
        from lightning_moe.config import MoEConfig
        from lightning_moe.models.upcycle import upcycle_state_dict

        if isinstance(dense, MoELanguageModel):
            if dense.model is None:
                dense.configure_model()
            assert dense.model is not None
            sd, dense_cfg = dense.model.state_dict(), dense.config
        elif os.path.isfile(os.path.join(str(dense), "config.json")):  # a Hugging Face dense folder (qwen3, llama)
            from lightning_moe.models.hf import from_hf

            model = from_hf(dense)
            sd, dense_cfg = model.state_dict(), model.config
        else:
            from lightning_moe.generation import load_for_generation

            model, dense_cfg = load_for_generation(dense)
            sd = model.state_dict()
        moe_cfg = MoEConfig(**moe) if isinstance(moe, dict) else moe
        state, cfg = upcycle_state_dict(sd, dense_cfg, moe_cfg, granularity)
        module = cls(config=cfg, **kwargs)
        module._initial_state = state
        return module

    def save_pretrained(self, out_dir: str, *, model_type: Optional[str] = None, **kwargs: Any) -> None:
        """Write a Hugging Face folder (config.json + sharded safetensors) that ``transformers`` loads. Collective
        under a distributed strategy (every rank calls it; rank 0 writes). ``model_type``: the family to write
        (default: the one imported from, else inferred from the config). The weights are the optimizer's fp32
        masters where it keeps them (``master_dtype``), else the parameters; ``dtype=torch.bfloat16`` (a save_hf
        option, as every other keyword) casts them."""
        from lightning_moe.checkpoint.optimizer_state import param_names
        from lightning_moe.models.hf import save_hf

        if self.model is None:
            self.configure_model()
        assert self.model is not None
        state = self.model.state_dict()
        optimizers = self.trainer.optimizers if self._trainer is not None else []
        masters = optimizers[0].master_params() if optimizers and isinstance(optimizers[0], MasterAdamW) else {}
        names = param_names(self.model)
        state.update({names[id(p)]: m for p, m in masters.items() if id(p) in names})
        save_hf(state, out_dir, self.config,
                model_type=model_type or self.hf_model_type or infer_model_type(self.config), **kwargs)

    def generate(self, prompt_or_ids: Any, max_new_tokens: int = 64, **kwargs: Any) -> Any:
        """A string -> its continuation (byte tokenizer, stops at EOS); a list of strings -> their continuations;
        token ids [B, S] or [S] -> prompt + continuation ids. Greedy by default (``temperature``, ``top_p``,
        ``top_k`` sample); KV cache. See :func:`lightning_moe.generation.generate`. One process."""
        from lightning_moe.generation import generate_any

        assert self.model is not None, "call configure_model() first (the Trainer does)"
        return generate_any(self.model, prompt_or_ids, max_new_tokens=max_new_tokens, **kwargs)

    # ---- loss -------------------------------------------------------------------------------------------
    def _reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over the ranks that hold distinct tokens (the strategy's data-parallel and context-parallel
        ranks); identity on one device."""
        parallel = self._parallel
        return t if parallel is None else parallel.reduce_token_sum(t)

    def _step_output(self, batch: dict[str, Tensor]) -> LMStepOutput:
        """The model's step output for a batch (this rank's part of it under context parallelism)."""
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        position_ids = batch.get("position_ids")
        labels = batch.get("labels")
        if labels is None:
            labels = shift_labels(input_ids, attention_mask, position_ids)
        else:
            if attention_mask is not None:
                labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
            labels = mask_document_ends(labels, position_ids)
        positions = None
        parallel = self._parallel
        if parallel is not None:
            # context parallel: this rank's load-balanced chunks, labels shifted on the full sequence first
            local = parallel.shard_batch({"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask,
                                          "position_ids": position_ids})
            input_ids, labels, attention_mask = local["input_ids"], local["labels"], local.get("attention_mask")
            positions, position_ids = local.get("global_positions"), local.get("position_ids")
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        # the collate's host-side document structure (no sync in the forward); context parallelism ignores it
        out = self.model(input_ids, attention_mask, positions, labels_BS=labels, loss_impl=self.loss_impl,
                         position_ids_BS=position_ids, document_segments=batch.get("document_segments"))
        assert isinstance(out, LMStepOutput)
        return out

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        if not self._train_batch_checked:  # once: batches from any collator (e.g. transformers') meet our contract
            self._check_batch(batch)
            self._train_batch_checked = True
        out = self._step_output(batch)
        sums = self._reduce_sum(torch.stack([out.loss_sum.detach(), out.num_tokens.to(out.loss_sum.dtype)]))
        num_tokens = sums[1]  # this micro-batch's valid tokens over every data rank
        self.step_accumulator.add(sums[0], num_tokens, out.routing)
        objective = out.loss_sum + num_tokens * (out.aux_loss + out.z_loss)
        if self._trainer is not None and self.trainer.accumulate_grad_batches == 1:
            # the step's token count is known before its only backward: normalise here, so no pass over every
            # gradient is needed afterwards (the finalisation skips its 1/N scaling of prescaled steps)
            self.step_accumulator.prescaled = True
            return objective / num_tokens.clamp(min=1)
        return objective

    # ---- gradient finalisation ------------------------------------------------------------------------------
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Optional[Callable] = None) -> None:
        """Runs the gradient finalisation (:meth:`finalize_gradients`) right after the closure's backward and
        before any ``on_before_optimizer_step`` hook, under every supported strategy. An override must call
        ``super().optimizer_step(...)`` (``MoEParallelStrategy`` raises when a step was not finalised)."""
        if optimizer_closure is not None:
            optimizer_closure = finalizing_closure(optimizer_closure, self.finalize_gradients)
        optimizer.step(closure=optimizer_closure)

    def finalize_gradients(self) -> StepResult:
        """Hand the step's accumulated record to the gradient finalisation, with everything it needs given
        explicitly: through the strategy's ``finalize_step`` hook (which adds its layout's groups), or on
        Lightning's single-device strategy to :func:`~lightning_moe.parallel.finalize.finalize_step` directly.
        Then :meth:`on_step_finalized`."""
        assert self.model is not None
        kwargs = dict(
            parameters=self.parameters(),
            accumulate_grad_batches=self.trainer.accumulate_grad_batches,
            update_expert_bias=self.model.update_expert_bias,
            skip_empty=self.skip_empty_steps,
            step=self.trainer.global_step,
            # fp32 master weights: their gradients are summed in fp32 where they are summed (as FSDP2's reduce-scatter)
            tp_reduce_dtype=self.master_dtype,
        )
        record = self.step_accumulator.pop()
        parallel = self._parallel
        result = parallel.finalize_step(record, **kwargs) if parallel is not None else finalize_step(record, **kwargs)
        self.on_step_finalized(result)
        return result

    def on_step_finalized(self, result: StepResult) -> None:
        """Called by the gradient finalisation with the step's global statistics, before the hooks: keeps them
        (``step_result``, ``last_train_loss``) and logs the layout-invariant step metrics. Per-layer routing health
        (load ratios, dropped and dead experts, entropy, per-layer losses) is
        :class:`~lightning_moe.callbacks.LoadBalanceMonitor`'s job."""
        self.step_result = result
        if result.skipped:
            return
        self.last_train_loss = result.loss
        self.log("train_loss", result.loss, prog_bar=True)
        self.log("train/aux_loss", result.aux_loss)
        self.log("train/z_loss", result.z_loss)
        self.log("train/tokens", result.num_tokens)
        if self._trainer is not None and self.trainer.optimizers:
            self.log("train/lr", float(self.trainer.optimizers[0].param_groups[0]["lr"]))
        # throughput of the whole run (all ranks): the step's valid tokens over the time since the last step
        # (the finalisation synchronised the device, so the clock sees its work)
        if self._prev_step_time is not None:
            tps = float(result.num_tokens) / max(result.finished_at - self._prev_step_time, 1e-9)
            self.log("train/tokens_per_sec", tps, prog_bar=True)
            self.log("train/tokens_per_sec_per_device", tps / self.trainer.world_size)
        self._prev_step_time = result.finished_at

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clip by the true global norm over every mesh (torch's clip_grad_norm_ fails on parameters living on
        two meshes); runs after the gradient finalisation, on the step's mean gradient."""
        if gradient_clip_val is None or gradient_clip_val <= 0:
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"only gradient_clip_algorithm='norm' is supported, got {gradient_clip_algorithm!r}")
        from lightning_moe.parallel.grads import clip_grad_norm_

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = clip_grad_norm_(params, gradient_clip_val)
        self.log("train/grad_norm", norm)

    # ---- validation ---------------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sums = None
        self._prev_step_time = None  # validation time is no training throughput

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._check_batch(batch)  # evaluation data may come from anywhere (trainer.validate); not in training steps
        out = self._step_output(batch)
        s = torch.stack([out.loss_sum.detach(), out.num_tokens.to(out.loss_sum.dtype)])
        self._val_sums = s if self._val_sums is None else self._val_sums + s

    def on_test_epoch_start(self) -> None:
        self._val_sums = None

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        """test_loss (mean token loss over the whole test set, all ranks) and test_perplexity."""
        if self._val_sums is None:
            return
        sums = self._reduce_sum(self._val_sums)
        self._val_sums = None
        if float(sums[1]) == 0:
            rank_zero_warn("the test set has no valid token (every label -100 or masked): nothing is logged")
            return
        loss = sums[0] / sums[1]
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_perplexity", torch.exp(loss), sync_dist=True)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        """Greedy continuations of ``predict_max_new_tokens`` (hparam, default 64) for ``batch["input_ids"]``
        (left-padded with ``attention_mask`` when the prompts differ in length). Returns the prompt + continuation
        ids; when the batch carries the prompt strings (``TextDataModule(predict_prompts=...)``) it returns
        ``[{"prompt": ..., "completion": ...}]`` decoded with the data module's tokenizer and prints them."""
        from lightning_moe.generation import generate

        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        self._check_batch({"input_ids": ids, **({"attention_mask": mask} if mask is not None else {})})
        assert self.model is not None
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        eos = getattr(dm, "eos_id", None)
        out = generate(self.model, ids, attention_mask=mask, eos_token_id=eos,
                       max_new_tokens=int(self.hparams.get("predict_max_new_tokens", 64)))
        prompts = batch.get("prompt")
        if prompts is None or dm is None or not hasattr(dm, "get_tokenizer"):
            return out
        tok = dm.get_tokenizer()
        results = []
        for prompt, row in zip(prompts, out[:, ids.shape[1]:].tolist()):
            if eos is not None and eos in row:
                row = row[: row.index(eos)]
            results.append({"prompt": prompt, "completion": tok.decode(row)})
            if self.trainer.is_global_zero:
                print(f"{prompt}{results[-1]['completion']}\n")
        return results

    def on_validation_epoch_end(self) -> None:
        if self._val_sums is None:
            return
        sums = self._reduce_sum(self._val_sums)
        self._val_sums = None
        if float(sums[1]) == 0:  # one host sync per validation run
            rank_zero_warn("validation saw no valid token (every label -100 or masked): val_loss is not logged; "
                           "check the validation data's labels and attention_mask")
            return
        val_loss = sums[0] / sums[1]
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

    def on_train_start(self) -> None:
        """After a resume: a learning rate given now (command line, config) replaces the checkpoint's base LR while
        the schedule's position continues; say what came from where."""
        restored, self._restored_hparams = self._restored_hparams, None
        if not restored:
            return
        lr = self.hparams.lr
        old_lr = restored.get("lr")
        if old_lr is not None and old_lr != lr:
            for cfg in self.trainer.lr_scheduler_configs:
                sched = cfg.scheduler
                sched.base_lrs = [lr for _ in sched.base_lrs]
                for group, fn in zip(sched.optimizer.param_groups, getattr(sched, "lr_lambdas", [])):
                    group["initial_lr"] = lr
                    group["lr"] = lr * fn(sched.last_epoch)
            rank_zero_info(f"resumed at step {self.global_step}: lr {lr} (given now) replaces the checkpoint's "
                           f"{old_lr}; the schedule continues from its position")
        same = sorted(k for k, v in restored.items() if k != "config" and self.hparams.get(k) == v)
        rank_zero_info(f"resumed at step {self.global_step} from a checkpoint; optimizer moments, LR-schedule "
                       f"position, step counters and expert bias come from it; hyper-parameters equal to the "
                       f"checkpoint's: {', '.join(same) or 'none'}")

    def on_train_end(self) -> None:
        """With checkpointing on, the end of training always leaves a checkpoint of the final weights
        (``last.ckpt`` in the ModelCheckpoint's folder, written now unless this step was just saved)."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        cb = self.trainer.checkpoint_callback
        if not isinstance(cb, ModelCheckpoint) or cb.dirpath is None:
            return
        if self._last_saved_step != self.global_step:
            path = os.path.join(cb.dirpath, "last" + cb.FILE_EXTENSION)
            self.trainer.save_checkpoint(path, weights_only=False)  # the full state: resumable
            rank_zero_info(f"final checkpoint (step {self.global_step}): {path}")
        else:
            rank_zero_info(f"final checkpoint (step {self.global_step}): in {cb.dirpath} "
                           f"({os.path.basename(cb.last_model_path or cb.best_model_path)})")

    def on_fit_end(self) -> None:
        first, last = self.initial_val_loss, self.last_val_loss
        if first is not None and last is not None:
            rank_zero_info(
                f"val_loss {first:.4f} -> {last:.4f} ({100 * (last - first) / first:+.1f}%) over {self.global_step} steps"
            )

    # ---- optimisation -------------------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for name, p in self.named_parameters():
            if p.requires_grad:
                # no weight decay on norms, biases (all 1-D) and embeddings
                (no_decay if p.ndim < 2 or "tok_embeddings" in name else decay).append(p)
        params = decay + no_decay
        fused = hp.fused
        if fused is None:
            fused = bool(params) and all(p.device.type == "cuda" for p in params)
        # the same two groups under every layout (optimizer and LR-scheduler states resume anywhere); AdamW keeps
        # DTensor and plain parameters apart inside its fused kernels, MasterAdamW steps their local tensors
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if self.master_dtype is not None:
            optimizer: torch.optim.Optimizer = MasterAdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                                                           fused=hp.fused)
        else:
            optimizer = AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, fused=fused)
        accept_state_by_name(optimizer, self)
        total = hp.max_steps
        if total is None:
            total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        warmup, min_ratio = hp.warmup_steps, hp.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, max(total, 1), min_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of another model fails here, naming the parameters and shapes (Lightning's single-device
        loader; MoEParallelStrategy checks in its own load_checkpoint). One saved at the end of an epoch resumes at
        the next epoch's first batch (:mod:`lightning_moe.checkpoint.loop_state`; runs before Lightning restores
        its loops)."""
        start_next_epoch(checkpoint)
        self._restored_hparams = dict(checkpoint.get("hyper_parameters") or {})
        sd = checkpoint.get("state_dict")
        if sd is not None and self.model is not None:
            from lightning_moe.checkpoint.optimizer_state import check_shapes

            check_shapes({k: tuple(v.shape) for k, v in self.state_dict().items()},
                         {k: tuple(v.shape) for k, v in sd.items()}, "being loaded", strict=self.strict_loading)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Optimizer states by parameter name, whatever the strategy (so they load under any layout). The checkpoint
        holds the weights and the full config: it does not need (nor name as a source) the ``pretrained`` folder,
        which may be gone when it is loaded."""
        self._last_saved_step = self.global_step
        if (checkpoint.get("hyper_parameters") or {}).get("pretrained") is not None:
            checkpoint["hyper_parameters"] = {**checkpoint["hyper_parameters"], "pretrained": None}
        states = checkpoint.get("optimizer_states")
        if states and self._trainer is not None:
            optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.trainer.optimizers]
            checkpoint["optimizer_states"] = [optimizer_state_by_name(osd, opt, self)
                                              for osd, opt in zip(states, optimizers)]


def infer_model_type(config: ModelConfig) -> str:
    """The Hugging Face family whose architecture matches ``config`` (qwen3_moe when several do; when none does,
    the closest, whose export error then names what stops each family)."""
    from lightning_moe.models.hf import export_families

    if config.attention == "mla":
        guess = "deepseek_v3"
    elif config.qk_norm == "full":
        guess = "olmoe"
    elif config.qk_norm == "none" and config.moe.score_func == "softmax" and not config.moe.pre_softmax:
        guess = "mixtral"
    else:
        guess = "qwen3_moe"
    fits = [mt for mt, why in export_families(config).items() if why is None]
    return guess if guess in fits or not fits else fits[0]


def _check_strategy(strategy: Optional[Strategy]) -> None:
    if strategy is None or isinstance(strategy, (MoEParallelStrategy, SingleDeviceStrategy)):
        return
    raise ValueError(
        f"MoELanguageModel cannot run under {type(strategy).__name__}: it would normalise the loss by local token "
        "counts, compute the global aux loss from local routing counts and let the expert bias drift between "
        "ranks. Use lightning_moe.MoEParallelStrategy (Trainer(strategy='moe_parallel') is plain FSDP2 data "
        "parallelism; MoEParallelStrategy(ep=..., tp=...) adds expert and tensor parallelism) or one device."
    )
