"""MoELanguageModel under a CPU Lightning Trainer: precisions, the loss normalisation (against objectives written
here), gradient accumulation, the expert-bias update, logging, NaN handling, checkpoints and gradient clipping.

Gradients are read from the optimizer itself (``RecordingSGD`` records ``p.grad`` when Lightning's closure has
run the module's rescaling and clipping, right before the update) and cross-checked against parameter deltas."""

from __future__ import annotations

import copy
import glob
import math
import os
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_moe.config import ModelConfig
from lightning_moe.module import IGNORE_INDEX, MoELanguageModel
from lightning_moe.moe.record import MoERecorder

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")

S = 16
V = 260


def small_config(**moe) -> ModelConfig:
    m = dict(num_experts=4, top_k=2, expert_hidden_size=16, first_k_dense=1, shared_expert_hidden_size=16,
             aux_loss_type="aux", aux_loss_coeff=0.1, z_loss_coeff=1e-2)
    m.update(moe)
    return ModelConfig.from_preset("tiny", num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                   dense_hidden_size=32, max_seq_len=S, moe=m)


SIGMOID_BIAS = dict(score_func="sigmoid", expert_bias=True, bias_update_rate=1e-2, aux_loss_type="seq",
                    aux_loss_coeff=1e-2, z_loss_coeff=0.0)


# ---- data ------------------------------------------------------------------------------------------------------------


class _Samples(Dataset):
    def __init__(self, input_ids, labels):
        self.input_ids, self.labels = input_ids, labels

    def __len__(self):
        return self.input_ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


class ToyData(L.LightningDataModule):
    """Random packed-style samples; ``ignore_tail[i]`` last labels of training sample i are IGNORE_INDEX."""

    def __init__(self, n_train=4, n_val=4, batch_size=2, ignore_tail=None, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, V, (n_train + n_val, S + 1), generator=g)
        self.inputs, self.labels = toks[:, :-1].clone(), toks[:, 1:].clone()
        for i, m in enumerate(ignore_tail or []):
            if m:
                self.labels[i, S - m :] = IGNORE_INDEX
        self.n_train, self.batch_size = n_train, batch_size

    def train_batches(self):
        n, b = self.n_train, self.batch_size
        return [{"input_ids": self.inputs[i : i + b], "labels": self.labels[i : i + b]} for i in range(0, n, b)]

    def val_samples(self):
        return {"input_ids": self.inputs[self.n_train :], "labels": self.labels[self.n_train :]}

    def train_dataloader(self):
        ds = _Samples(self.inputs[: self.n_train], self.labels[: self.n_train])
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        ds = _Samples(self.inputs[self.n_train :], self.labels[self.n_train :])
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False)


# ---- module with a recording SGD -------------------------------------------------------------------------------------


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that records every parameter's gradient as the update sees it (after Lightning's closure ran the
    backward, the module's on_before_optimizer_step rescale and configure_gradient_clipping)."""

    def __init__(self, params, lr, sink):
        super().__init__(params, lr=lr, momentum=0.0, weight_decay=0.0)
        self.sink = sink

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sink.append([None if p.grad is None else p.grad.detach().clone()
                          for g in self.param_groups for p in g["params"]])
        super().step()
        return loss


class SGDModule(MoELanguageModel):
    def __init__(self, config, sgd_lr=0.1):
        super().__init__(config)
        self.sgd_lr = sgd_lr
        self.recorded = []

    def configure_optimizers(self):
        return RecordingSGD(self.parameters(), lr=self.sgd_lr, sink=self.recorded)


def make_module(cfg, sgd_lr=0.1, seed=0, cls=SGDModule):
    torch.manual_seed(seed)
    m = cls(cfg, sgd_lr=sgd_lr) if cls is SGDModule else cls(cfg)
    m.configure_model()  # built before fit so the test can keep a copy of the initial weights
    return m


def make_trainer(tmp_path, **kw):
    base = dict(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
                enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
                default_root_dir=str(tmp_path))
    base.update(kw)
    return L.Trainer(**base)


def params_of(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


def hand_objective(ref, micro_batches):
    """The step's objective written from the module docstring: sum(token CE) / N + sum_mb (n_mb / N) *
    sum_layers(aux_mb + z_mb), N the valid labels of the step. Returns (objective, mean token CE)."""
    n_mb = [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches]
    N = sum(n_mb)
    ce_sum = 0.0
    moe = 0.0
    for mb, n in zip(micro_batches, n_mb):
        recorder = MoERecorder()
        logits = ref(mb["input_ids"], recorder=recorder)
        ce_sum = ce_sum + F.cross_entropy(logits.flatten(0, 1).float(), mb["labels"].flatten(),
                                          ignore_index=IGNORE_INDEX, reduction="sum")
        records = recorder.records.values()
        assert len(records) == len(ref.moe_layers()) > 0
        moe = moe + (n / N) * sum(r.aux_loss + r.z_loss for r in records)
    return ce_sum / N + moe, ce_sum / N


def hand_grads(ref, micro_batches):
    ref.train()
    ref.zero_grad(set_to_none=True)
    obj, _ = hand_objective(ref, micro_batches)
    obj.backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def recorded_by_name(module, step=0):
    names = [n for n, _ in module.named_parameters()]
    return {n.removeprefix("model."): g for n, g in zip(names, module.recorded[step])}


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ---- (a) precisions --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_precisions_train_and_keep_routing_state_fp32(tmp_path, precision):
    cfg = small_config(**SIGMOID_BIAS)
    losses = []

    class Track(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train_loss"]))

    torch.manual_seed(0)
    module = MoELanguageModel(cfg, lr=1e-3, warmup_steps=0)
    trainer = make_trainer(tmp_path, max_steps=3, precision=precision, callbacks=[Track()])
    trainer.fit(module, ToyData(n_train=6))
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(V)) < 1.0  # a fresh model predicts roughly uniformly
    layers = module.model.moe_layers()
    assert len(layers) == 2
    rate = cfg.moe.bias_update_rate
    for layer in layers:
        assert layer.router.weight.dtype == torch.float32
        assert layer.router.expert_bias.dtype == torch.float32
        b = layer.router.expert_bias
        # three updates of +-rate (or 0): exact multiples of the rate survive in fp32, and some expert moved
        assert b.abs().max() > 0
        torch.testing.assert_close(b / rate, torch.round(b / rate), rtol=0, atol=1e-4)
        assert b.abs().max() <= 3 * rate * (1 + 1e-6)
    if precision == "bf16-true":
        assert module.model.layers["1"].attention.wq.weight.dtype == torch.bfloat16
        assert layers[0].experts.w1.dtype == torch.bfloat16


# ---- (b) gradient accumulation ---------------------------------------------------------------------------------------


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    cfg = small_config(aux_loss_type="seq", aux_loss_coeff=0.1, z_loss_coeff=1e-2)
    runs = {}
    for bs, acc in ((4, 1), (2, 2)):
        module = make_module(cfg, sgd_lr=0.1)
        p0 = params_of(module)
        trainer = make_trainer(tmp_path, accumulate_grad_batches=acc)
        trainer.fit(module, ToyData(n_train=4, batch_size=bs))
        assert trainer.global_step == 1 and len(module.recorded) == 1
        runs[(bs, acc)] = (p0, params_of(module), recorded_by_name(module))
    (p0a, pa, ga), (p0b, pb, gb) = runs[(4, 1)], runs[(2, 2)]
    for n in p0a:
        assert torch.equal(p0a[n], p0b[n])  # same initial weights
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
        assert rel_err(gb[n], ga[n]) < 1e-5, n
        # the update really happened (the comparison is not between two untouched models)
        assert not torch.equal(pa[n], p0a[n]), n


# ---- (c) loss normalisation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("acc", [1, 2])
def test_gradient_is_that_of_the_documented_objective(tmp_path, acc):
    # unequal valid-token counts: micro-batch 1 has 32 labels, micro-batch 2 has 6 + 4 (the rest are ignored)
    data = ToyData(n_train=4, batch_size=4 // acc, ignore_tail=[0, 0, 10, 12])
    cfg = small_config(aux_loss_type="aux", aux_loss_coeff=0.1, z_loss_coeff=1e-2)
    module = make_module(cfg, sgd_lr=1.0)
    ref = copy.deepcopy(module.model)
    p0 = params_of(module)
    trainer = make_trainer(tmp_path, accumulate_grad_batches=acc)
    trainer.fit(module, data)
    got = recorded_by_name(module)
    want = hand_grads(ref, data.train_batches())
    assert set(got) == set(want)
    for n in want:
        assert rel_err(got[n], want[n]) < 1e-4, (n, rel_err(got[n], want[n]))
        # SGD lr=1 applied exactly that gradient
        torch.testing.assert_close(p0[n] - module.model.get_parameter(n).detach(), got[n], rtol=1e-3, atol=1e-6)
    # the router's gradient carries the aux and z terms: check that dropping or mis-weighting them would be seen
    router = "layers.1.moe.router.weight"
    ref2 = copy.deepcopy(ref)
    ref2.zero_grad(set_to_none=True)
    _, ce_only = hand_objective(ref2, data.train_batches())
    ce_only.backward()
    assert rel_err(ref2.get_parameter(router).grad, want[router]) > 1e-2
    if acc == 2:
        # plain mean of the micro-batches' MoE losses (instead of token-weighted) differs measurably
        mbs = data.train_batches()
        ref3 = copy.deepcopy(ref)
        ref3.zero_grad(set_to_none=True)
        n_mb = [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in mbs]
        obj = 0.0
        for mb in mbs:
            recorder = MoERecorder()
            logits = ref3(mb["input_ids"], recorder=recorder)
            obj = obj + F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="sum") / sum(n_mb)
            obj = obj + 0.5 * sum(r.aux_loss + r.z_loss for r in recorder.records.values())
        obj.backward()
        assert rel_err(ref3.get_parameter(router).grad, want[router]) > 1e-3


# ---- (d) expert bias -------------------------------------------------------------------------------------------------


def _hand_counts(ref, micro_batches, biases):
    """Per MoE layer, assignments per expert of the micro-batches routed by hand: top-k of sigmoid(x W^T) + bias
    on the router inputs captured from the reference model run with those biases."""
    layers = ref.moe_layers()
    captured = {i: [] for i in range(len(layers))}
    hooks = [l.register_forward_pre_hook(lambda mod, args, i=i: captured[i].append(args[0].detach()))
             for i, l in enumerate(layers)]
    with torch.no_grad():
        for l, b in zip(layers, biases):
            l.router.expert_bias.copy_(b)
        ref.eval()
        for mb in micro_batches:
            ref(mb["input_ids"])
    for h in hooks:
        h.remove()
    counts = []
    for i, l in enumerate(layers):
        E, k = l.num_experts, l.top_k
        c = torch.zeros(E, dtype=torch.long)
        for x in captured[i]:
            logits = x.reshape(-1, x.shape[-1]).float() @ l.router.weight.detach().float().T
            ids = torch.topk(torch.sigmoid(logits) + biases[i], k, dim=-1).indices
            c += torch.bincount(ids.flatten(), minlength=E)
        counts.append(c)
    return counts


def test_expert_bias_updates_once_per_optimizer_step(tmp_path):
    cfg = small_config(**SIGMOID_BIAS)
    rate = cfg.moe.bias_update_rate
    data = ToyData(n_train=8, batch_size=2)
    module = make_module(cfg, sgd_lr=0.0)  # weights never move: only the bias does
    ref = copy.deepcopy(module.model)
    trainer = make_trainer(tmp_path, max_steps=2, accumulate_grad_batches=2)
    trainer.fit(module, data)
    assert trainer.global_step == 2

    E = cfg.moe.num_experts
    mbs = data.train_batches()
    bias = [torch.zeros(E) for _ in ref.moe_layers()]
    after_first = None
    for step in range(2):
        counts = _hand_counts(ref, mbs[2 * step : 2 * step + 2], bias)
        for c in counts:
            assert int(c.sum()) == 2 * 2 * S * cfg.moe.top_k  # both micro-batches counted
        # b += rate * sign(mean(n) - n); sign(mean - n_i) == sign(sum - E n_i) exactly in integers
        bias = [b + rate * torch.sign(c.sum() - E * c).float() for b, c in zip(bias, counts)]
        if step == 0:
            after_first = [b.clone() for b in bias]
    got = [l.router.expert_bias for l in module.model.moe_layers()]
    for g, w in zip(got, bias):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-7)
    # the test can tell the wrong rules apart on this data: counts of one micro-batch only, or an update after
    # every micro-batch, give other biases
    zero = [torch.zeros(E) for _ in ref.moe_layers()]
    first_mb_only = [rate * torch.sign(c.sum() - E * c).float() for c in _hand_counts(ref, mbs[:1], zero)]
    assert any(not torch.equal(a, f) for a, f in zip(after_first, first_mb_only))
    per_micro = zero
    for mb in mbs[:4]:
        per_micro = [b + rate * torch.sign(c.sum() - E * c).float()
                     for b, c in zip(per_micro, _hand_counts(ref, [mb], per_micro))]
    assert any(not torch.allclose(g, w, rtol=0, atol=1e-7) for g, w in zip(got, per_micro))
    assert module.step_accumulator.num_micro_batches == 0  # the demand went into the update, nothing carries over


# ---- (e) logged losses -----------------------------------------------------------------------------------------------


def test_logged_train_and_val_loss(tmp_path):
    data = ToyData(n_train=4, n_val=4, batch_size=2, ignore_tail=[0, 3, 11, 0])
    cfg = small_config()
    module = make_module(cfg, sgd_lr=0.0)  # weights stay the initial ones: every loss is computable by hand
    ref = copy.deepcopy(module.model)
    logged = {}

    class Grab(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if "train_loss" in trainer.callback_metrics:
                logged["train_loss"] = float(trainer.callback_metrics["train_loss"])

    trainer = make_trainer(tmp_path, accumulate_grad_batches=2, limit_val_batches=2, val_check_interval=2,
                           num_sanity_val_steps=-1, callbacks=[Grab()])
    trainer.fit(module, data)
    with torch.no_grad():
        ref.train()
        _, mean_ce = hand_objective(ref, data.train_batches())
        v = data.val_samples()
        val = F.cross_entropy(ref(v["input_ids"]).flatten(0, 1), v["labels"].flatten(), ignore_index=IGNORE_INDEX)
    # the token-weighted mean (32 + 13 + 5 + 16 labels), not the mean of per-micro-batch means
    assert logged["train_loss"] == pytest.approx(float(mean_ce), rel=1e-5)
    mb = data.train_batches()
    with torch.no_grad():
        per_mb = [F.cross_entropy(ref(b["input_ids"]).flatten(0, 1), b["labels"].flatten()) for b in mb]
    assert abs(float(sum(per_mb) / 2) - float(mean_ce)) > 1e-4  # the two means differ on this data
    assert "val_loss" in trainer.callback_metrics
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(float(val), rel=1e-5)
    assert module.initial_val_loss == pytest.approx(float(val), rel=1e-5)


def test_no_initial_val_loss_without_full_sanity_check(tmp_path):
    module = make_module(small_config(), sgd_lr=0.0)
    trainer = make_trainer(tmp_path, limit_val_batches=1, val_check_interval=1, num_sanity_val_steps=1)
    trainer.fit(module, ToyData())
    assert module.initial_val_loss is None
    assert "val_loss" in trainer.callback_metrics


# ---- (f) NaN ---------------------------------------------------------------------------------------------------------


def test_nan_loss_raises(tmp_path):
    module = make_module(small_config(), sgd_lr=0.1)
    with torch.no_grad():
        module.model.output.weight[5, 3] = float("nan")
    p0 = params_of(module)
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.raises(FloatingPointError, match=r"(?s)train_loss is nan.*learning rate"):
        trainer.fit(module, ToyData())
    assert module.recorded == []  # raised before the optimizer applied anything
    for n, p in p0.items():
        torch.testing.assert_close(module.model.get_parameter(n).detach(), p, rtol=0, atol=0, equal_nan=True)


# ---- (g) checkpoints -------------------------------------------------------------------------------------------------


def test_checkpoint_weights_only_and_load_from_checkpoint(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    cfg = small_config(**SIGMOID_BIAS)
    torch.manual_seed(0)
    module = MoELanguageModel(cfg, lr=1e-2, warmup_steps=0)
    ckpt_dir = tmp_path / "ckpt"
    # 3 steps: each moves every expert bias by +-rate (or 0), so an odd count leaves them non-zero
    trainer = make_trainer(tmp_path, max_steps=3, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)])
    trainer.fit(module, ToyData(n_train=6))
    files = glob.glob(os.path.join(ckpt_dir, "*.ckpt"))
    assert len(files) == 1, files
    ckpt = torch.load(files[0], weights_only=True, map_location="cpu")
    assert isinstance(ckpt["hyper_parameters"]["config"], dict)
    assert ModelConfig.from_dict(ckpt["hyper_parameters"]["config"]) == cfg
    assert ckpt["global_step"] == 3
    trained = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert any(k.endswith("expert_bias") for k in ckpt["state_dict"])
    loaded = MoELanguageModel.load_from_checkpoint(files[0], map_location="cpu")
    assert loaded.config == cfg
    got = loaded.state_dict()
    assert set(got) == set(trained)
    for k, v in trained.items():
        assert torch.equal(got[k], v), k
    # the trained weights differ from a fresh init, so equality above is not trivial
    fresh = make_module(cfg, cls=MoELanguageModel, seed=1)
    assert not torch.equal(fresh.state_dict()["model.output.weight"], trained["model.output.weight"])
    assert any(v.abs().max() > 0 for k, v in trained.items() if k.endswith("expert_bias"))


# ---- (h) gradient clipping -------------------------------------------------------------------------------------------


def test_gradient_clipping_clips_to_the_value(tmp_path):
    data = ToyData(n_train=2, batch_size=2)
    cfg = small_config()
    lr, clip = 1.0, 0.01
    module = make_module(cfg, sgd_lr=lr)
    ref = copy.deepcopy(module.model)
    p0 = params_of(module)
    trainer = make_trainer(tmp_path, gradient_clip_val=clip)
    trainer.fit(module, data)
    want = hand_grads(ref, data.train_batches())
    pre_norm = math.sqrt(sum(float(g.double().square().sum()) for g in want.values()))
    assert pre_norm > 20 * clip  # the clip is active
    logged = float(trainer.callback_metrics["train/grad_norm"])
    assert logged == pytest.approx(pre_norm, rel=1e-4)  # the logged norm is the pre-clip norm
    got = recorded_by_name(module)
    post_norm = math.sqrt(sum(float(g.double().square().sum()) for g in got.values()))
    assert post_norm == pytest.approx(clip, rel=1e-4)
    # the update: lr * clip in norm, in the direction of the true gradient
    delta_sq = sum(float((module.model.get_parameter(n).detach().double() - p0[n].double()).square().sum())
                   for n in p0)
    assert math.sqrt(delta_sq) == pytest.approx(lr * clip, rel=1e-4)
    for n in want:
        assert rel_err(got[n] * (pre_norm / clip), want[n]) < 1e-4, n


@pytest.mark.parametrize("shape", [(0, 8), (2, 0)])
def test_an_empty_batch_is_a_value_error(shape):
    """No sequence, or sequences of no token: a ValueError naming the shape, not a reshape error deep in attention."""
    module = MoELanguageModel(small_config())
    module.configure_model()
    ids = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError, match=r"a batch needs at least one sequence of at least one token"):
        module(ids)
    with pytest.raises(ValueError, match=r"a batch needs at least one sequence"):
        module.validation_step({"input_ids": ids}, 0)
