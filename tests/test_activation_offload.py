"""ActivationOffload on CPU (synchronous copies through the same steps as CUDA's): exact gradients for every module
kind, state-dict keys unchanged, the size threshold, the prefetch order, bad arguments, and the callback through the
Trainer's build pipeline under MoEParallelStrategy (W=1), also in bf16-true inside recomputed blocks. The W=2 ep=2
case and every recompute x offload combination are in test_recompute.py."""

from __future__ import annotations

import copy

import pytest
import torch

import lightning_moe.callbacks.activation_offload as ao
from _memory import assert_same, gqa_config, mla_config, reference_model, step, tokens
from _trainer import fit_recording_losses
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
    step(_offloaded(cfg, ["attention"]), tokens(cfg))
    # linear flattens its input afresh at each call (a new view of the same data): the input shared by wq, wk and wv
    # is copied once, and wo's input once, per layer; RoPE's cos and sin (views of one table) once each for q and k
    assert made.count(((tokens(cfg).numel(), cfg.hidden_size), torch.float32)) == 2 * cfg.num_layers, str(made)
    made.clear()
    step(_offloaded(cfg, ["experts"], min_bytes=10**9), tokens(cfg))
    assert made == []


@pytest.mark.parametrize("prefetch", [True, False])
def test_every_offloaded_tensor_comes_back_once_by_prefetch_or_on_use(monkeypatch, prefetch):
    """Each host copy is brought back exactly once; with prefetch, all of them before their node runs (when the
    backward reaches the module's output, or the output of the module after it in the forward)."""
    loads, made = [], []
    in_prefetch = [False]
    real_init, real_load, real_prefetch = ao._Offloaded.__init__, ao._Offloaded.load, ao._Group.prefetch

    def init(self, t, stream):
        real_init(self, t, stream)
        made.append(id(self))

    def load(self, stream):
        if self.dev is None:
            loads.append((id(self), in_prefetch[0]))
        real_load(self, stream)

    def prefetch_(self, grad=None):
        in_prefetch[0] = True
        try:
            real_prefetch(self, grad)
        finally:
            in_prefetch[0] = False

    monkeypatch.setattr(ao._Offloaded, "__init__", init)
    monkeypatch.setattr(ao._Offloaded, "load", load)
    monkeypatch.setattr(ao._Group, "prefetch", prefetch_)
    cfg = gqa_config()
    base = step(copy.deepcopy(reference_model(cfg)), tokens(cfg))
    assert_same(step(_offloaded(cfg, ["experts", "attention"], prefetch=prefetch), tokens(cfg)), base)
    assert made and sorted(i for i, _ in loads) == sorted(made)  # each copy once
    assert {by_prefetch for _, by_prefetch in loads} == {prefetch}


def test_trainer_bf16_true_recomputed_blocks_with_offload_match_no_option():
    """The combination that failed on the H200 (full@2 + norm + moe_act + attn_core + offload[experts]), through the
    Trainer in bf16-true: the first step's finalised gradients and the losses equal those of no option."""
    import lightning as L

    from lightning_moe import MoELanguageModel, MoEParallelStrategy
    from lightning_moe.data import TextDataModule

    class FirstGradients(L.Callback):
        grads: dict = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if not self.grads:
                self.grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.detach().clone()
                              for n, p in pl_module.named_parameters()}

    def fit(strategy, callbacks=()):
        L.seed_everything(0, verbose=False)
        probe = FirstGradients()
        model = MoELanguageModel(gqa_config(), warmup_steps=0)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            precision="bf16-true", strategy=strategy, callbacks=[probe, *callbacks])
        losses = fit_recording_losses(trainer, model, TextDataModule(seq_len=16, batch_size=2))
        return probe.grads, losses, model

    base, base_losses, _ = fit(MoEParallelStrategy())
    grads, losses, model = fit(MoEParallelStrategy(activation_checkpointing=["full", "norm", "moe_act", "attn_core"],
                                                   recompute_num_layers=2),
                               [ActivationOffload(["experts"], min_bytes=0)])
    assert [b.activation_plan.recompute.seams for b in model.model.layers.values()] == [{"forward"}] * 2 + [set()] * (
        len(model.model.layers) - 2)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert losses == base_losses and len(losses) == 2
    assert grads.keys() == base.keys()
    for n in grads:
        assert torch.equal(grads[n], base[n]), n


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
    fit_recording_losses(trainer, model, TextDataModule(seq_len=16, batch_size=2))
    experts = model.model.moe_layers()[0].experts
    assert experts.activation_plan.offload.scope is cb.offloader
    assert experts.activation_plan.recompute.seams == {"act_down"}
    assert model.model.layers["0"].attention.activation_plan.offload.scope is cb.offloader
    assert all(n.activation_plan.recompute.seams == {"forward"} for n in model.model.modules()
               if type(n).__name__ == "RMSNorm")
    assert torch.isfinite(model.last_train_loss)


def test_composition_order_of_recompute_and_offload(monkeypatch):
    """The activation plan's order, seen in what is copied to the host: a recomputed experts forward inside the
    experts' offload scope offloads only its region inputs (the internals are dropped and recomputed), while inside
    a block that ``full`` recomputes the scope is innermost: the internals are offloaded as without recomputation
    (offload wins) and the re-run in the backward offloads nothing again."""
    from lightning_moe.parallel.parallelize import apply_ac

    made = []
    real = ao._Offloaded.__init__

    def counting(self, t, stream):
        made.append(tuple(t.shape))
        real(self, t, stream)

    monkeypatch.setattr(ao._Offloaded, "__init__", counting)
    cfg = gqa_config()
    ids = tokens(cfg)
    base = step(copy.deepcopy(reference_model(cfg)), ids)
    R, F = ids.numel() * cfg.moe.top_k, cfg.moe.expert_hidden_size

    def run(kinds):
        made.clear()
        model = _offloaded(cfg, ["experts"])
        apply_ac(model, kinds)
        assert_same(step(model, ids), base)
        return list(made)

    alone = run("none")
    assert len(alone) == 8 * cfg.num_moe_layers and (R, F) in alone
    # region inputs: the rows, the counts and the rows' weights; no [R, F] intermediate
    assert sorted(run(["experts"])) == sorted([(R, cfg.hidden_size), (cfg.moe.num_experts,), (R,)]
                                              * cfg.num_moe_layers)
    assert sorted(run(["full"])) == sorted(alone)
