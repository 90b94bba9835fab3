"""ActivationOffload on CPU (host copies through the same code path): exact gradients for every module kind,
state-dict keys unchanged, the size threshold, bad arguments, and the callback through the Trainer's build
pipeline under MoEParallelStrategy (W=1). The W=2 ep=2 case is in test_recompute.py."""

from __future__ import annotations

import copy

import pytest
import torch

import lightning_moe.callbacks.activation_offload as ao
from _memory import assert_same, gqa_config, mla_config, reference_model, step, tokens
from lightning_moe.callbacks import ActivationOffload


def _offloaded(cfg, modules, min_bytes=0, prefetch=True):
    model = copy.deepcopy(reference_model(cfg))
    ActivationOffload(modules, min_bytes=min_bytes, prefetch=prefetch).transform_model(model)
    return model


@pytest.mark.parametrize("cfg_fn", [gqa_config, mla_config], ids=["gqa", "mla"])
def test_offload_gives_identical_gradients(cfg_fn):
    cfg = cfg_fn()
    base = step(copy.deepcopy(reference_model(cfg)), tokens(cfg))
    for modules in (["experts"], ["moe"], ["attention", "shared_experts", "mlp"], ["block"]):
        assert_same(step(_offloaded(cfg, modules), tokens(cfg)), base)
    assert_same(step(_offloaded(cfg, ["moe"], prefetch=False), tokens(cfg)), base)


def test_offload_copies_once_and_keeps_small_tensors(monkeypatch):
    made = []
    real = ao._Offloaded.__init__

    def counting(self, t, stream):
        made.append((tuple(t.shape), t.dtype))
        real(self, t, stream)

    monkeypatch.setattr(ao._Offloaded, "__init__", counting)
    cfg = gqa_config()
    model = _offloaded(cfg, ["experts"])
    assert list(model.state_dict()) == list(reference_model(cfg).state_dict())
    step(model, tokens(cfg))
    # per MoE layer: rows (once, though both gate and up GEMMs save them), offsets, gate, silu(gate), up, h, the
    # rows' combine weights and the weighted h (the weights scale h before the down projection; this is the PyTorch
    # path: the fused CUDA kernel keeps only gate, up, the weights and the weighted h)
    assert len(made) == 8 * cfg.num_moe_layers, str(made)
    made.clear()
    step(_offloaded(cfg, ["experts"], min_bytes=10**9), tokens(cfg))
    assert made == []


@pytest.mark.parametrize("kwargs", [{"modules": ["expert"]}, {"modules": []}, {"min_bytes": -1}])
def test_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="ActivationOffload"):
        ActivationOffload(**kwargs)


def test_trainer_applies_it_as_a_model_transform_with_selective_recompute():
    import lightning as L

    from lightning_moe import MoELanguageModel, MoEParallelStrategy
    from lightning_moe.data import TextDataModule

    cb = ActivationOffload(["experts", "attention"], min_bytes=0)
    model = MoELanguageModel(gqa_config(), warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=MoEParallelStrategy(activation_checkpointing="norm,moe_act"), callbacks=[cb])
    try:
        trainer.fit(model, datamodule=TextDataModule(seq_len=16, batch_size=2))
    finally:  # the strategy's one-process group must not leak into later tests
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    experts = model.model.moe_layers()[0].experts
    assert isinstance(experts.forward, ao._Scoped)
    assert type(experts.act_down).__name__ == "Recomputed"
    assert torch.isfinite(model.last_train_loss)
