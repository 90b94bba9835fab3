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
        L.seed_everything(0)  # deterministic: the sign rule can bring a bias back to 0 after two steps
        model = MoELanguageModel(small_config(), warmup_steps=0)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=MoEParallelStrategy(**layout), precision="bf16-true",
            max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
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
        MoEParallelStrategy(dispatcher="flex")  # "deepep" exists: tests/test_deepep_dispatcher.py
    with pytest.raises(ValueError, match="ep must be a positive integer"):
        MoEParallelStrategy(ep=0)


def _initial_weights(rank: int, world_size: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_moe import MoELanguageModel, MoEParallelStrategy
    from lightning_moe.models.transformer import MoETransformer

    L.seed_everything(7)
    cfg = small_config()
    model = MoELanguageModel(cfg)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEParallelStrategy(ep=2), max_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=FixedData(4, 8))
    got = get_model_state_dict(model.model, options=StateDictOptions(full_state_dict=True))
    got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in got.items()}
    with torch.device("meta"):
        ref = MoETransformer(cfg)
    ref.to_empty(device="cpu")
    torch.manual_seed(7)
    ref.init_weights()
    return {"got": {k: v.detach().clone() for k, v in got.items()}, "ref": ref.state_dict()}


def test_sharded_cpu_init_equals_the_unsharded_init():
    """On CPU meshes DTensor has no RNG tracker; a seeded run must not give every shard the same numbers
    (duplicated experts and router rows): the strategy's model starts from the one-process init."""
    out = run_distributed(_initial_weights, 2)
    got, ref = out["got"], out["ref"]
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    w1 = got["layers.1.moe.experts.w1"]
    assert not torch.equal(w1[0], w1[2]), "experts on the two ep ranks must differ"


@pytest.mark.parametrize("free", [True, False])
def test_gradients_are_freed_after_the_optimizer_step(free):
    """By default the step's gradients are gone before the next forward (not only before its backward), so they do
    not sit in memory at the forward's activation peak; ``free_grads_after_step=False`` keeps Lightning's timing."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_moe import MoELanguageModel, MoEParallelStrategy
    from lightning_moe.data import TextDataModule
    from test_activation_offload import gqa_config

    seen = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append([p.grad is not None for p in pl_module.parameters() if p.requires_grad])

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            assert all(p.grad is not None for p in pl_module.parameters() if p.requires_grad)

    model = MoELanguageModel(gqa_config(), warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=MoEParallelStrategy(free_grads_after_step=free), callbacks=[Probe()])
    try:
        trainer.fit(model, datamodule=TextDataModule(seq_len=16, batch_size=2))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert len(seen) == 3 and not any(seen[0])
    for flags in seen[1:]:
        assert not any(flags) if free else all(flags)
    assert torch.isfinite(model.last_train_loss)


def test_teardown_leaves_the_model_and_optimizer_state_on_their_devices(monkeypatch):
    """As under Lightning's ModelParallelStrategy: the end of fit does not move the model and its optimizer state
    to the CPU (the generic strategy's teardown does: every rank's shards with fp32 masters into host memory), and
    still tears down the accelerator and the precision plugin."""
    import lightning.pytorch.strategies.strategy as lightning_strategy

    from lightning_moe import MoELanguageModel, MoEParallelStrategy
    from lightning_moe.data import TextDataModule
    from test_activation_offload import gqa_config

    moved, torn = [], []
    monkeypatch.setattr(lightning_strategy, "_optimizers_to_device", lambda *a, **k: moved.append("optimizers"))
    model = MoELanguageModel(gqa_config(), warmup_steps=0)
    model.cpu = lambda: moved.append("model") or model
    strategy = MoEParallelStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, strategy=strategy)
    for part in (trainer.strategy.accelerator, trainer.strategy.precision_plugin):
        monkeypatch.setattr(part, "teardown", lambda p=type(part).__name__: torn.append(p))
    try:
        trainer.fit(model, datamodule=TextDataModule(seq_len=16, batch_size=2))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert trainer.global_step == 1 and moved == []
    assert sorted(torn) == sorted({type(trainer.strategy.accelerator).__name__,
                                   type(trainer.strategy.precision_plugin).__name__})


def _trainer(**kw):
    from lightning_moe import MoEParallelStrategy

    return L.Trainer(accelerator="cpu", devices=1, strategy=MoEParallelStrategy(**kw), max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0)


def test_a_module_without_parallel_requirements_is_refused():
    from lightning.pytorch.demos.boring_classes import BoringModel

    with pytest.raises(TypeError, match=r"declares parallel_requirements\(\).*got BoringModel"):
        _trainer().fit(BoringModel())


def test_the_strategy_reads_the_module_through_parallel_requirements_only(monkeypatch):
    """The config and master dtype the strategy acts on are those parallel_requirements() returns, not the module's
    attributes: a smaller max_seq_len there fails the first batch; a master dtype there reaches FSDP2's reduce dtype."""
    import dataclasses

    import lightning_moe.strategies.moe_parallel as moe_parallel
    from lightning_moe import MoELanguageModel
    from lightning_moe.strategies import ParallelRequirements

    class Declared(MoELanguageModel):
        declared: ParallelRequirements

        def parallel_requirements(self):
            return self.declared

    seen = []
    real = moe_parallel.parallelize
    monkeypatch.setattr(moe_parallel, "parallelize", lambda model, dims, **kw: seen.append(kw) or real(model, dims, **kw))
    model = Declared(small_config(), warmup_steps=0)
    assert model.master_dtype is None
    model.declared = ParallelRequirements(dataclasses.replace(model.config, max_seq_len=4), master_dtype=torch.float32)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=4"):
        _trainer().fit(model, datamodule=FixedData(2, 4))
    assert seen[0]["reduce_dtype"] is torch.float32
    with pytest.raises(TypeError, match="must return a lightning_moe.strategies.ParallelRequirements"):
        model.declared = model.config
        _trainer().fit(model, datamodule=FixedData(2, 4))
    with pytest.raises(TypeError, match="config must be a lightning_moe.ModelConfig"):
        ParallelRequirements({"hidden_size": 64})
