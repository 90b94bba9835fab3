"""MoEParallelStrategy behaviour outside the equivalence suite: precision handling and early layout errors."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from _dist import run_distributed
from parallel_harness import FixedData, small_config


def _bf16_true(rank: int, world_size: int) -> list:
    from lightning_moe import MoELanguageModel, MoEParallelStrategy

    out = []
    for layout, dp in ((dict(ep=2), 2), (dict(tp=2, ep=2, dp_shard=1), 1)):
        model = MoELanguageModel(small_config(), warmup_steps=0)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=MoEParallelStrategy(**layout), precision="bf16-true",
            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0,
        )
        trainer.fit(model, datamodule=FixedData(8 // dp, 16))
        layer = model.model.layers["1"].moe
        out.append({
            "layout": layout,
            "loss": float(model.last_train_loss),
            "router": layer.router.weight.dtype,
            "bias": layer.router.expert_bias.dtype,
            "bias_moved": bool(layer.router.expert_bias.abs().sum() > 0),
            "experts": layer.experts.w1.dtype,
            "attention": model.model.layers["1"].attention.wq.weight.dtype,
        })
    return out


def test_bf16_true_keeps_routing_state_fp32_under_fsdp_and_tp():
    """Lightning's bf16-true casts the whole module; under FSDP2 that cast cannot be undone, so the strategy
    builds in bf16 and keeps the routers (their own FSDP group) in fp32."""
    for res in run_distributed(_bf16_true, 2):
        assert math.isfinite(res["loss"]), res
        assert res["router"] == torch.float32 and res["bias"] == torch.float32, res
        assert res["bias_moved"], res
        assert res["experts"] == torch.bfloat16 and res["attention"] == torch.bfloat16, res


def test_invalid_layout_fails_at_trainer_construction():
    from lightning_moe import MoEParallelStrategy

    with pytest.raises(ValueError, match="choose dp_replicate, cp and tp whose product is in"):
        L.Trainer(accelerator="cpu", devices=2, strategy=MoEParallelStrategy(tp=3), logger=False)
    with pytest.raises(ValueError, match="dispatcher must be one of"):
        MoEParallelStrategy(dispatcher="deepep")
    with pytest.raises(ValueError, match="ep must be a positive integer"):
        MoEParallelStrategy(ep=0)
