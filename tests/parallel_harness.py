"""Shared pieces of the parallel-equivalence tests: a small MoE config, a fixed global batch split by the batch
view, and a LightningModule that starts from given weights and trains with plain SGD (Adam's per-parameter
normalisation would hide uniformly mis-scaled gradients)."""

from __future__ import annotations

import copy
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_moe import MoELanguageModel, ModelConfig
from lightning_moe.models.transformer import MoETransformer

SEQ_LEN = 16
GLOBAL_BATCH = 8
STEPS = 3
LR = 0.5


# DeepSeek-V3's shape in small: MLA with q compression and YaRN, sigmoid group-limited routing with a scaling factor,
# expert bias, sequence aux loss and a shared expert (the last from small_config's MoE defaults)
DEEPSEEK_V3_TINY = dict(
    attention="mla", qk_norm="none", q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, rope_scaling=dict(factor=4.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
                                     mscale=1.0, mscale_all_dim=1.0),
)
DEEPSEEK_V3_MOE = dict(num_groups=2, group_topk=1, norm_topk_prob=True, scaling_factor=2.5)
# (leading, trailing) padding of sample i: PAD_PATTERNS[i % 4]. Under cp=2 only cp rank 0's chunks (positions 0-3
# and 12-15) hold padding, so cp rank 1 runs without a mask while rank 0 masks; both tp halves hold some.
PAD_PATTERNS = ((0, 0), (0, 3), (2, 0), (1, 2))
# document lengths of packed sample i: PACK_PATTERNS[i % 4] (boundaries inside and across cp=2's 4-token chunks)
PACK_PATTERNS = ((16,), (5, 11), (3, 6, 7), (9, 4, 3))


def small_config(model: Optional[dict[str, Any]] = None, **moe_overrides: Any) -> ModelConfig:
    """The suite's tiny MoE config; ``model``: ModelConfig field overrides (e.g. :data:`DEEPSEEK_V3_TINY`)."""
    moe = dict(num_experts=4, top_k=2, expert_hidden_size=32, score_func="sigmoid", expert_bias=True,
               bias_update_rate=1e-2, aux_loss_type="seq", aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
               shared_expert_hidden_size=32, first_k_dense=1)
    moe.update(moe_overrides)
    fields = dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, dense_hidden_size=64,
                  max_seq_len=32, qk_norm="head", moe=moe)
    fields.update(model or {})
    return ModelConfig.from_preset("tiny", **fields)


def attention_masks(num_samples: int) -> torch.Tensor:
    """[N, SEQ_LEN] int64, 0 = padding, after :data:`PAD_PATTERNS`."""
    mask = torch.ones(num_samples, SEQ_LEN, dtype=torch.long)
    for i in range(num_samples):
        lead, trail = PAD_PATTERNS[i % len(PAD_PATTERNS)]
        mask[i, :lead] = 0
        mask[i, SEQ_LEN - trail:] = 0
    return mask


def packed_positions(num_samples: int) -> torch.Tensor:
    """[N, SEQ_LEN] int64 per-document positions (restarting at 0 at each document start), after
    :data:`PACK_PATTERNS`."""
    rows = [torch.cat([torch.arange(n) for n in PACK_PATTERNS[i % len(PACK_PATTERNS)]]) for i in range(num_samples)]
    return torch.stack(rows)


def reference_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The same weights in every process: a seeded CPU init of the unsharded model."""
    torch.manual_seed(1234)
    model = MoETransformer(cfg)
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def global_tokens(num_samples: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    # a skewed distribution so the model has something to learn and routing is not uniform
    probs = torch.softmax(torch.randn(260, generator=g) * 2, 0)
    return torch.multinomial(probs, num_samples * SEQ_LEN, replacement=True, generator=g).view(num_samples, SEQ_LEN)


class _Rows(Dataset):
    def __init__(self, tokens: torch.Tensor, masks: Optional[torch.Tensor] = None,
                 positions: Optional[torch.Tensor] = None) -> None:
        self.tokens, self.masks, self.positions = tokens, masks, positions

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = {"input_ids": self.tokens[i]}
        if self.masks is not None:
            row["attention_mask"] = self.masks[i]
        if self.positions is not None:
            row["position_ids"] = self.positions[i]
        return row


class FixedData(L.LightningDataModule):
    """Global step s holds samples [s*G, (s+1)*G); rank r of the batch view reads samples r, r+R, ...
    (DistributedSampler without shuffling), so the union over ranks of a step is the same global batch."""

    def __init__(self, micro_batch: int, num_samples: int, padded: bool = False, packed: bool = False) -> None:
        super().__init__()
        self.micro_batch = micro_batch
        self.ds = _Rows(global_tokens(num_samples), attention_masks(num_samples) if padded else None,
                        packed_positions(num_samples) if packed else None)

    def train_dataloader(self) -> DataLoader:
        kw = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(self.ds, shuffle=False, drop_last=True, **kw)
        return DataLoader(self.ds, batch_size=self.micro_batch, sampler=sampler)


class EquivalenceModel(MoELanguageModel):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], loss_impl: str = "auto",
                 sgd_lr: float = LR) -> None:
        super().__init__(config, warmup_steps=0, loss_impl=loss_impl)
        self._weights = weights
        self.sgd_lr = sgd_lr
        self.step_losses: list[float] = []
        self.step_aux_losses: list[float] = []  # the logged train/aux_loss and train/z_loss of every step
        self.step_z_losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # a copy: set_model_state_dict rewrites the dict it is given in place
        set_model_state_dict(self.model, copy.copy(self._weights), options=StateDictOptions(full_state_dict=True))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.sgd_lr)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.step_losses.append(float(self.last_train_loss))
        assert self.step_result is not None
        self.step_aux_losses.append(float(self.step_result.aux_loss))
        self.step_z_losses.append(float(self.step_result.z_loss))


def train(layout: Optional[dict[str, Any]], world_size: int, accumulate: int = 1, clip: Optional[float] = None,
          moe: Optional[dict[str, Any]] = None, loss_impl: str = "auto", model: Optional[dict[str, Any]] = None,
          padded: bool = False, packed: bool = False, lr: float = LR) -> dict[str, Any]:
    """Train STEPS SGD steps on the fixed data under ``layout`` (None = one process, default strategy); return
    the per-step losses (train_loss and the logged aux and z losses), the full final state dict, and every rank's
    expert biases. ``model``: ModelConfig overrides; ``padded``: batches carry attention masks after
    :data:`PAD_PATTERNS`; ``packed``: they carry per-document ``position_ids`` after :data:`PACK_PATTERNS`;
    ``lr``: the SGD step size."""
    from lightning_moe import MoEParallelStrategy

    cfg = small_config(model, **(moe or {}))
    weights = reference_state_dict(cfg)
    module = EquivalenceModel(cfg, weights, loss_impl, lr)
    layout = dict(layout or {})
    dp = 1
    if layout:
        strategy: Any = MoEParallelStrategy(**layout)
        from lightning_moe.parallel.dims import ParallelDims

        sizes = {k: v for k, v in layout.items() if k in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")}
        sizes["dp_shard"] = -1 if sizes.get("dp_shard", "auto") == "auto" else sizes["dp_shard"]
        dp = ParallelDims(world_size=world_size, **sizes).num_data_shards
    else:
        strategy = "auto"
    micro = GLOBAL_BATCH // (dp * accumulate)
    assert micro >= 1
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size if layout else 1, strategy=strategy, max_steps=STEPS,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=FixedData(micro, GLOBAL_BATCH * STEPS, padded, packed))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True))
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in full.items()}
    biases = [layer.router.expert_bias.detach().cpu().clone() for layer in module.model.moe_layers()]
    return {"losses": module.step_losses, "aux_losses": module.step_aux_losses, "z_losses": module.step_z_losses,
            "state": full, "biases": biases}


def compare(result: dict[str, Any], ref: dict[str, Any], rtol: float = 1e-5) -> list[str]:
    """Differences beyond rtol (relative to the reference's norm); empty when equivalent."""
    problems = []
    if len(result["losses"]) != len(ref["losses"]):
        problems.append(f"{len(result['losses'])} steps vs {len(ref['losses'])}")
    for key, name in (("losses", "train_loss"), ("aux_losses", "train/aux_loss"), ("z_losses", "train/z_loss")):
        for i, (a, b) in enumerate(zip(result[key], ref[key])):
            if abs(a - b) > rtol * abs(b):
                problems.append(f"step {i} {name} {a:.8f} vs {b:.8f}")
    for k, v in ref["state"].items():
        if k not in result["state"]:
            problems.append(f"missing {k}")
            continue
        got = result["state"][k].float()
        err = (got - v.float()).norm() / v.float().norm().clamp(min=1e-12)
        if err > rtol:
            problems.append(f"{k}: rel err {err:.2e}")
    return problems
