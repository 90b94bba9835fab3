"""The Lightning contract of MoELanguageModel and MoEParallelStrategy (issue: integration without workarounds).

* Hooks see the true gradient: a callback's and the module's ``on_before_optimizer_step`` read the finalised
  gradient of the step's objective (after tp sync, 1/N and the routing reductions), on one device (Lightning's
  single-device strategy and MoEParallelStrategy) and on W=2 (dp_shard=2, ep=2).
* Strategies that cannot give the guarantees are refused at setup with a ValueError naming MoEParallelStrategy.
* Logged losses and routing metrics (the module's and LoadBalanceMonitor's) are the same numbers under every layout
  for the same global batch.
* ``Trainer(strategy="moe_parallel")`` works; the build pipeline runs transforms on the meta model before
  parallelisation; components come from the registry.
* Layout problems are ValueErrors before step 1.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch import nn

from _dist import run_distributed
from parallel_harness import GLOBAL_BATCH, EquivalenceModel, FixedData, reference_state_dict, small_config
from test_module import ToyData, hand_grads, rel_err
from test_module import small_config as module_config

from lightning_moe import LoadBalanceMonitor, MoELanguageModel, MoEParallelStrategy


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("model.")


class GradRecorder(Callback):
    """Records, in on_before_optimizer_step, every gradient (full tensor) and the step's loss."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.grads.append({_clean(n): _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None})
        self.losses.append(float(pl_module.step_result.loss))


class HookOverrideModel(EquivalenceModel):
    """Overrides on_before_optimizer_step WITHOUT super(): must not change the gradient the optimizer applies."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.step_losses.append(float(self.last_train_loss))
        self.seen = {_clean(n): _full(p.grad) for n, p in self.named_parameters() if p.grad is not None}


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _run(layout: Any, world_size: int, steps: int = 2, model_cls: Any = EquivalenceModel, moe: Any = None,
         callbacks: Any = (), strategy: Any = None) -> dict[str, Any]:
    cfg = small_config(**(moe or {}))
    model = model_cls(cfg, reference_state_dict(cfg))
    recorder, logger = GradRecorder(), MemoryLogger()
    dp = 1
    if layout is not None:
        strategy = MoEParallelStrategy(**layout)
        from lightning_moe.parallel.dims import ParallelDims

        sizes = {k: v for k, v in layout.items() if k in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")}
        dp = ParallelDims(world_size=world_size, **sizes).num_data_shards
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy or "auto", max_steps=steps, logger=logger,
        callbacks=[recorder, LoadBalanceMonitor(log_every_n_steps=1), *callbacks], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
        log_every_n_steps=1,
    )
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH // dp, GLOBAL_BATCH * steps))
    out = {"grads": recorder.grads, "losses": recorder.losses, "logged": logger.rows,
           "module_losses": model.step_losses, "strategy": type(trainer.strategy).__name__}
    if hasattr(model, "seen"):
        out["module_seen"] = model.seen
    return out


def _compare_grads(got: list[dict], want: list[dict], rtol: float = 1e-5) -> list[str]:
    problems = []
    assert len(got) == len(want) > 0
    for step, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), set(g) ^ set(w)
        for n in w:
            err = rel_err(g[n], w[n])
            if err > rtol:
                problems.append(f"step {step} {n}: rel err {err:.2e}")
    return problems


# ---- hooks see the true gradient ---------------------------------------------------------------------------------


def test_hooks_see_the_finalised_gradient_on_one_device(tmp_path):
    """Lightning's single-device strategy: a callback's on_before_optimizer_step sees the gradient of the documented
    objective (mean token loss + MoE losses), not the raw token-sum gradient."""
    data = ToyData(n_train=4, batch_size=4, ignore_tail=[0, 3, 0, 7])
    cfg = module_config(aux_loss_type="aux", aux_loss_coeff=0.1, z_loss_coeff=1e-2)
    torch.manual_seed(0)
    module = MoELanguageModel(cfg, warmup_steps=0)
    module.configure_model()
    ref = copy.deepcopy(module.model)
    recorder = GradRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[recorder])
    trainer.fit(module, data)
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    want = hand_grads(ref, data.train_batches())
    got = recorder.grads[0]
    assert set(got) == set(want)
    for n in want:
        assert rel_err(got[n], want[n]) < 1e-4, (n, rel_err(got[n], want[n]))
    # the raw (unnormalised) gradient would be ~N times larger: the check above could not pass by accident
    n_tokens = sum(int((b["labels"] != -100).sum()) for b in data.train_batches())
    assert n_tokens > 10


def _hooks_w2(rank: int, world_size: int) -> dict:
    out = {}
    for name, layout in (("dp_shard=2", dict(dp_shard=2)), ("ep=2", dict(ep=2)), ("tp=2 ep=2", dict(tp=2, ep=2, dp_shard=1))):
        out[name] = _run(layout, world_size, model_cls=HookOverrideModel)
    return out


def _one_process(rank: int, world_size: int) -> dict:
    return {"auto": _run(None, 1, model_cls=HookOverrideModel),
            "moe_parallel, one device": _run({}, 1, model_cls=HookOverrideModel)}


@pytest.fixture(scope="module")
def one_process():
    return run_distributed(_one_process, 1)


@pytest.mark.timeout(600)
def test_hooks_see_the_same_gradient_under_every_layout(one_process):
    ref = one_process["auto"]
    assert ref["strategy"] == "SingleDeviceStrategy"
    single = one_process["moe_parallel, one device"]
    assert single["strategy"] == "MoEParallelStrategy"
    results = {"moe_parallel, one device": single, **run_distributed(_hooks_w2, 2)}
    failures = []
    for name, res in results.items():
        failures += [f"[{name}] {p}" for p in _compare_grads(res["grads"], ref["grads"])]
        # the module's own hook, overridden without super(), sees the same finalised gradient
        failures += [f"[{name}] module hook: {p}" for p in _compare_grads([res["module_seen"]], [ref["grads"][-1]])]
        if any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(res["losses"], ref["losses"])):
            failures.append(f"[{name}] losses {res['losses']} vs {ref['losses']}")
    assert not failures, "\n".join(failures[:20])


# ---- logged metrics are layout-invariant ----------------------------------------------------------------------------

_METRICS = ("train_loss", "train/aux_loss", "train/z_loss", "train/tokens")


def _logged(res: dict) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for _, row in res["logged"]:
        for k, v in row.items():
            if k in _METRICS or k.startswith("moe/"):
                out.setdefault(k, []).append(v)
    return out


@pytest.mark.timeout(600)
def test_logged_metrics_do_not_depend_on_the_layout(one_process):
    ref = _logged(one_process["auto"])
    assert set(_METRICS) <= set(ref) and any(k.startswith("moe/layer") for k in ref), sorted(ref)
    assert all(v > 0 for v in ref["train/aux_loss"]) and all(v > 0 for v in ref["train/z_loss"])
    results = run_distributed(_hooks_w2, 2)
    failures = []
    for name in ("dp_shard=2", "tp=2 ep=2"):
        got = _logged(results[name])
        for key, want in ref.items():
            vals = got.get(key)
            if vals is None or len(vals) != len(want) or any(
                    not math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-9) for a, b in zip(vals, want)):
                failures.append(f"[{name}] {key}: {vals} vs {want}")
    assert not failures, "\n".join(failures)


# ---- strategies that cannot give the guarantees -------------------------------------------------------------------


def _refused(rank: int, world_size: int) -> dict:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    out = {}
    for name, strategy in (("ddp", DDPStrategy()), ("model_parallel", ModelParallelStrategy())):
        model = MoELanguageModel(small_config(), warmup_steps=0)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0)
        try:
            trainer.fit(model, datamodule=FixedData(2, 4))
            out[name] = "trained"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_unsupported_strategies_are_refused_at_setup():
    out = run_distributed(_refused, 1)
    for name, msg in out.items():
        assert "MoEParallelStrategy" in msg and "cannot run under" in msg, (name, msg)


def test_strategy_is_registered():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="moe_parallel", logger=False)
    assert isinstance(trainer.strategy, MoEParallelStrategy)


# ---- build pipeline and registry ------------------------------------------------------------------------------------


class SwapActivations(Callback):
    """A model transform: sees the meta model before parallelisation and wraps every routed-expert module."""

    def __init__(self) -> None:
        self.seen_meta = None
        self.seen_dtensor = None

    def transform_model(self, model: nn.Module) -> nn.Module:
        params = list(model.parameters())
        self.seen_meta = all(p.is_meta for p in params)
        self.seen_dtensor = any(type(p).__name__ == "DTensor" or hasattr(p, "placements") for p in params)
        for layer in model.moe_layers():
            layer.experts.transformed = True
        return model


def _pipeline(rank: int, world_size: int) -> dict:
    cb = SwapActivations()
    res = _run(dict(ep=2), world_size, steps=1, callbacks=[cb])
    return {"meta": cb.seen_meta, "dtensor": cb.seen_dtensor, "losses": res["losses"]}


def test_model_transforms_run_on_the_meta_model_before_parallelisation():
    out = run_distributed(_pipeline, 2)
    assert out["meta"] is True and out["dtensor"] is False
    assert len(out["losses"]) == 1 and math.isfinite(out["losses"][0])
    # in-process: the transform's change is kept on the built model, and a transform must return the model
    module = MoELanguageModel(small_config(), model_transforms=[lambda m: setattr(m, "tagged", True)])
    module.configure_model()
    assert module.model.tagged is True
    bad = MoELanguageModel(small_config(), model_transforms=[lambda m: nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="transforms must return the MoETransformer"):
        bad.configure_model()


def test_component_registry_chooses_classes_from_config():
    from lightning_moe.models import registry
    from lightning_moe.moe.experts import GroupedExperts

    class CountingExperts(GroupedExperts):
        calls = 0

        def forward(self, x, counts):
            CountingExperts.calls += 1
            return super().forward(x, counts)

    registry.register("experts", "counting_test", CountingExperts, overwrite=True)
    cfg = small_config(experts="counting_test")
    module = MoELanguageModel(cfg)
    module.configure_model()
    assert all(isinstance(layer.experts, CountingExperts) for layer in module.model.moe_layers())
    module(torch.randint(0, 200, (2, 8)))
    assert CountingExperts.calls == len(module.model.moe_layers())
    with pytest.raises(ValueError, match="moe.experts='gruoped_mm' is not a registered experts.*grouped_mm"):
        MoELanguageModel(small_config(experts="gruoped_mm"))
    with pytest.raises(ValueError, match="did you mean 'grouped_mm'"):
        registry.build("experts", "gruoped_mm", 4, 8, 8)
    # the loop reference is registered too and gives the same output as the grouped GEMM
    a = MoELanguageModel(small_config())
    a.configure_model()
    b = MoELanguageModel(small_config(experts="loop"))
    b.configure_model()
    b.model.load_state_dict(a.model.state_dict())
    ids = torch.randint(0, 200, (2, 8))
    torch.testing.assert_close(a(ids), b(ids), rtol=1e-5, atol=1e-5)


# ---- layout problems are ValueErrors before step 1 ---------------------------------------------------------------------


def _layout_errors(rank: int, world_size: int) -> dict:
    from parallel_harness import SEQ_LEN, _Rows, global_tokens
    from torch.utils.data import DataLoader, DistributedSampler

    class Data(L.LightningDataModule):
        def __init__(self, seq_len: int, uneven: bool = False) -> None:
            super().__init__()
            self.seq_len, self.uneven = seq_len, uneven

        def train_dataloader(self) -> DataLoader:
            ids = torch.randint(0, 200, (8, self.seq_len))
            rows: Any = [{"input_ids": row} for row in ids]
            bs = 2 if not self.uneven else 2 + dist.get_rank()
            return DataLoader(rows, batch_size=bs)

    cases = {
        "seq_len vs tp": (dict(tp=2, dp_shard=1), {}, Data(15)),
        "seq_len vs 2*cp": (dict(cp=2, dp_shard=1), {}, Data(14)),
        "pad_to_capacity with unequal tokens": (
            dict(ep=2), dict(moe=dict(capacity_factor=1.5, pad_to_capacity=True)), Data(SEQ_LEN, uneven=True)),
    }
    out = {}
    for name, (layout, overrides, data) in cases.items():
        moe_over = overrides.pop("moe", {})
        cfg = small_config(**moe_over)
        if overrides:
            import dataclasses

            cfg = dataclasses.replace(cfg, **overrides)
        model = MoELanguageModel(cfg, warmup_steps=0)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEParallelStrategy(**layout), max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                            use_distributed_sampler=False)
        try:
            trainer.fit(model, datamodule=data)
            out[name] = ("trained", None)
        except ValueError as e:
            out[name] = ("ValueError", str(e), model.global_step)
        dist.barrier()
    return out


@pytest.mark.timeout(600)
def test_layout_problems_are_value_errors_before_step_one():
    out = run_distributed(_layout_errors, 2)
    expect = {
        "seq_len vs tp": "seq_len=15 is not divisible by 2",
        "seq_len vs 2*cp": "seq_len=14 is not divisible by 2*cp = 4",
        "pad_to_capacity with unequal tokens": "needs the same number of tokens on every rank",
    }
    for name, want in expect.items():
        got = out[name]
        assert got[0] == "ValueError" and want in got[1], (name, got)
        assert got[2] == 0, (name, "no optimizer step may have run", got)


def test_every_other_lightning_strategy_is_refused():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from lightning_moe.module import _check_strategy

    for cls in (DDPStrategy, FSDPStrategy, ModelParallelStrategy):
        with pytest.raises(ValueError, match="Use lightning_moe.MoEParallelStrategy"):
            _check_strategy(cls())
    _check_strategy(SingleDeviceStrategy(torch.device("cpu")))
    _check_strategy(MoEParallelStrategy())


def test_a_step_without_valid_tokens_is_an_error_or_skipped(tmp_path):
    from lightning_moe.parallel.finalize import EmptyStepError

    data = ToyData(n_train=2, batch_size=2, ignore_tail=[16, 16])  # every label of the step ignored
    kw = dict(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    module = MoELanguageModel(module_config(), warmup_steps=0)
    with pytest.raises(EmptyStepError, match="no valid token in its whole global batch"):
        L.Trainer(**kw).fit(module, data)
    module = MoELanguageModel(module_config(), warmup_steps=0, skip_empty_steps=True)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.warns(UserWarning, match="the step is skipped"):
        L.Trainer(**kw).fit(module, data)
    assert module.step_result.skipped and module.last_train_loss is None
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_python_entry_points_check_inputs_and_test_step_reports(tmp_path):
    module = MoELanguageModel(module_config(), warmup_steps=0)
    module.configure_model()
    V, S = module.config.vocab_size, module.config.max_seq_len
    with pytest.raises(ValueError, match=str(V)):
        module(torch.full((1, 4), V))
    with pytest.raises(ValueError, match="max_seq_len"):
        module(torch.zeros(1, S + 1, dtype=torch.long))
    with pytest.raises(ValueError):
        module(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1.0, float("nan"), 1.0, 1.0]]))
    data = ToyData(n_train=2, n_val=4, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    out = trainer.test(module, dataloaders=data.val_dataloader(), verbose=False)[0]
    assert math.isclose(out["test_perplexity"], math.exp(out["test_loss"]), rel_tol=1e-5)
    assert abs(out["test_loss"] - math.log(V)) < 1.5  # an untrained model is near uniform
    module.hparams.predict_max_new_tokens = 6
    prompts = torch.utils.data.DataLoader([{"input_ids": torch.randint(0, V, (8,))} for _ in range(2)], batch_size=2)
    preds = trainer.predict(module, dataloaders=prompts)
    assert preds[0].shape == (2, 8 + 6)
