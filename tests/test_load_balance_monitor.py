"""LoadBalanceMonitor (issue 9, part 1): routing-health metrics, JSONL counts, W&B/CSV loggers, no host sync.

* W=1: every logged number equals the one computed here from the routers' own outputs (counts, normalised scores,
  losses) over the window; logging only every n optimizer steps plus the partial window at the end; the JSONL counts
  of a dropless run sum to top_k x the window's non-padding tokens (counted from the data's attention masks).
* W=2, ep=2 under MoEParallelStrategy: the JSONL lines and metrics equal the one-process run's on the same global
  batch (counts summed over ranks); rank 1 logs nothing.
* WandbLogger (offline) gets the heatmap image and the histograms; a CSVLogger gets the scalars.
* Steps that do not log never call a host-synchronising tensor method.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from _dist import run_distributed
from parallel_harness import GLOBAL_BATCH, EquivalenceModel, FixedData, reference_state_dict, small_config
from test_lightning_integration import MemoryLogger

from lightning_moe import LoadBalanceMonitor, MoELanguageModel, MoEParallelStrategy
from lightning_moe.callbacks.routing_metrics import load_heatmap, window_metrics

SEQ = 16
TOP_K = 2  # small_config's


class PaddedData(L.LightningDataModule):
    """Samples with trailing padding (attention_mask 0) of 0..4 tokens; read in order (one process)."""

    def __init__(self, num_samples: int, batch_size: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.samples = []
        for i in range(num_samples):
            mask = torch.ones(SEQ, dtype=torch.long)
            mask[SEQ - i % 5:] = 0
            self.samples.append({"input_ids": torch.randint(0, 260, (SEQ,), generator=g), "attention_mask": mask})
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=self.batch_size, shuffle=False)


class RouterRecorder(Callback):
    """Per optimizer step, what every router returned in training forwards (counts, scores, masks, losses), and the
    expert biases after the step's update; read independently of the finalisation path the monitor uses."""

    def __init__(self) -> None:
        self.steps: list[dict[int, list[dict[str, torch.Tensor]]]] = []
        self.biases: list[dict[int, torch.Tensor]] = []
        self._pending: dict[int, list[dict[str, torch.Tensor]]] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for idx, blk in pl_module.model.layers.items():
            if blk.is_moe:
                blk.moe.router.register_forward_hook(self._hook(int(idx)))

    def _hook(self, idx: int):
        def hook(router: Any, args: tuple, out: Any) -> None:
            if router.training:
                valid = args[1] if len(args) > 1 and args[1] is not None else torch.ones(out.scores.shape[0])
                self._pending.setdefault(idx, []).append(dict(
                    counts=out.tokens_per_expert.detach().clone(), scores=out.scores.detach().clone(),
                    valid=valid.bool().clone(), aux=out.aux_loss.detach().clone(), z=out.z_loss.detach().clone()))
        return hook

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.steps.append(self._pending)
        self._pending = {}
        self.biases.append({int(i): b.moe.router.expert_bias.detach().clone()
                            for i, b in pl_module.model.layers.items() if b.is_moe})


def _expected(recorder: RouterRecorder, steps: range) -> dict[str, float]:
    """The monitor's per-layer metrics from the raw router outputs of ``steps``, written from the definitions."""
    out: dict[str, float] = {}
    for idx in sorted(recorder.steps[steps[0]]):
        mbs = [mb for s in steps for mb in recorder.steps[s][idx]]
        counts = torch.stack([mb["counts"] for mb in mbs]).sum(0).double()
        E = counts.numel()
        mean = counts.mean()
        tokens = sum(int(mb["valid"].sum()) for mb in mbs)
        ent = 0.0
        for mb in mbs:
            p = mb["scores"].double()
            assert torch.allclose(p.sum(-1), torch.ones(p.shape[0], dtype=p.dtype), atol=1e-5)  # a distribution
            h = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1)
            ent += float(h[mb["valid"]].sum())
        bias = recorder.biases[steps[-1]][idx].double()
        p = f"moe/layer{idx}/"
        out.update({
            p + "max_load_ratio": float(counts.max() / mean), p + "min_load_ratio": float(counts.min() / mean),
            p + "load_cv": math.sqrt(float(((counts - mean) ** 2).sum()) / E) / float(mean),
            p + "dead_experts": float(sum(c == 0 for c in counts.tolist())),
            p + "dropped_fraction": 0.0, p + "router_entropy": ent / tokens,
            p + "aux_loss": sum(float(mb["aux"]) for mb in mbs) / len(mbs),
            p + "z_loss": sum(float(mb["z"]) for mb in mbs) / len(mbs),
            p + "expert_bias_mean": float(bias.mean()), p + "expert_bias_max_abs": float(bias.abs().max()),
        })
    return out


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def _fit_one_process(tmp_path: Any, callbacks: list, loggers: Any, max_steps: int, accumulate: int = 2,
                     samples: int = 12) -> MoELanguageModel:
    torch.manual_seed(0)
    model = MoELanguageModel(small_config(), warmup_steps=0, lr=1e-2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                        logger=loggers, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        default_root_dir=tmp_path, log_every_n_steps=1)
    trainer.fit(model, datamodule=PaddedData(samples, 2))
    return model


# ---- W=1: values, cadence, dropless counts ---------------------------------------------------------------------------


def test_window_metrics_from_raw_counts_cadence_and_dropless_jsonl(tmp_path):
    recorder, logger = RouterRecorder(), MemoryLogger()
    jsonl = tmp_path / "sub" / "routing.jsonl"
    monitor = LoadBalanceMonitor(log_every_n_steps=2, jsonl_path=str(jsonl))
    data = PaddedData(12, 2)
    _fit_one_process(tmp_path, [recorder, monitor], logger, max_steps=3)

    # cadence: steps 0-1 logged at step 1 (the step Lightning logs that step's train_loss at), the partial window
    # (step 2) at the end of training
    rows = [(step, m) for step, m in logger.rows if any(k.startswith("moe/") for k in m)]
    assert [(s, m["moe/window_steps"]) for s, m in rows] == [(1, 2.0), (2, 1.0)]
    train_steps = sorted({s for s, m in logger.rows if "train_loss" in m})
    assert train_steps == [0, 1, 2]

    for (step, got), window in zip(rows, (range(0, 2), range(2, 3))):
        want = _expected(recorder, window)
        bad = [f"{k}: {got.get(k)} vs {v}" for k, v in want.items() if k not in got or not _close(got[k], v)]
        assert not bad, bad
        layers = sorted({int(k.split("/")[1][5:]) for k in want})
        ratios = {i: want[f"moe/layer{i}/max_load_ratio"] for i in layers}
        assert got["moe/worst_layer"] == max(ratios, key=ratios.get)
        assert _close(got["moe/max_load_ratio"], max(ratios.values()))
        assert _close(got["moe/load_cv_mean"], sum(want[f"moe/layer{i}/load_cv"] for i in layers) / len(layers))
        assert got["moe/dead_experts"] == sum(want[f"moe/layer{i}/dead_experts"] for i in layers)

    # JSONL: one line per MoE layer and log step; dropless: counts sum to top_k x the window's non-padding tokens,
    # counted here from the attention masks (accumulate 2 x batch 2 = 4 samples per step)
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [(x["step"], x["layer"], x["window_steps"], x["micro_batches"]) for x in lines] == [
        (1, 1, 2, 4), (1, 2, 2, 4), (2, 1, 1, 2), (2, 2, 1, 2)]
    for x in lines:
        first = (x["step"] + 1 - x["window_steps"]) * 4
        tokens = sum(int(s["attention_mask"].sum()) for s in data.samples[first:first + 4 * x["window_steps"]])
        assert tokens < 4 * x["window_steps"] * SEQ  # the data really has padding
        assert x["num_tokens"] == tokens and x["num_dropped"] == 0
        assert sum(x["tokens_per_expert"]) == TOP_K * tokens
        assert len(x["expert_bias"]) == len(x["tokens_per_expert"]) == 4
        assert _close(x["entropy"], rows[0 if x["step"] == 1 else 1][1][f"moe/layer{x['layer']}/router_entropy"])


def test_window_metrics_formulas_on_hand_made_counts():
    # layer 1: counts [4, 0, 2, 2] (a dead expert), 1 assignment dropped, 4 tokens, sums over 2 micro-batches
    w = torch.tensor([[4.0, 0, 2, 2, 1, 4, 0.5, 0.1, 3.0], [2, 2, 2, 2, 0, 4, 0.2, 0.1, 2.0]], dtype=torch.float64)
    m = window_metrics([1, 3], w, micro_batches=2, window_steps=1, bias_LE=torch.tensor([[0.1, -0.3, 0, 0]] * 2),
                       per_expert=True)
    assert m["moe/layer1/max_load_ratio"] == 2.0 and m["moe/layer1/min_load_ratio"] == 0.0
    assert _close(m["moe/layer1/load_cv"], math.sqrt(2) / 2) and m["moe/layer3/load_cv"] == 0.0
    assert m["moe/layer1/dead_experts"] == 1 and m["moe/dead_experts"] == 1
    assert _close(m["moe/layer1/dropped_fraction"], 1 / 9) and _close(m["moe/dropped_fraction"], 1 / 17)
    assert _close(m["moe/layer1/router_entropy"], 0.75) and _close(m["moe/layer1/aux_loss"], 0.25)
    assert _close(m["moe/layer1/expert_bias_max_abs"], 0.3) and _close(m["moe/layer1/expert_bias_mean"], -0.05)
    assert m["moe/worst_layer"] == 1 and m["moe/layer1/expert0/load_fraction"] == 0.5
    img = load_heatmap(w[:, :4])
    assert img.dtype == torch.uint8 and img.shape[2] == 3 and img.shape[1] >= 512
    assert img[0, 0].tolist() != [247, 247, 247] and img[-1, 0].tolist() == [247, 247, 247]  # hot / balanced
    assert img[0, img.shape[1] // 4 + 1].tolist() == [0, 0, 0]  # the dead expert


# ---- no host sync on steps that do not log ---------------------------------------------------------------------------

_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")


@contextmanager
def _count_host_syncs(calls: list[str]):
    saved = {n: getattr(torch.Tensor, n) for n in _SYNCS}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return fn(*a, **k)
        return counted

    try:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, wrap(n, fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


class CountingMonitor(LoadBalanceMonitor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls: list[tuple[int, list[str]]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        calls: list[str] = []
        with _count_host_syncs(calls):
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.calls.append((trainer.global_step, calls))


def test_no_host_sync_on_steps_that_do_not_log(tmp_path):
    monitor = CountingMonitor(log_every_n_steps=3, jsonl_path=str(tmp_path / "r.jsonl"))
    _fit_one_process(tmp_path, [monitor], MemoryLogger(), max_steps=5, accumulate=1, samples=10)
    assert [s for s, _ in monitor.calls] == [0, 1, 2, 3, 4]
    for step, calls in monitor.calls:
        if step == 2:
            assert calls, "the instrument must see the log step's transfer (else it proves nothing)"
        else:
            assert not calls, f"step {step} synchronised the host: {calls}"


# ---- W=2 ep=2 equals one process -------------------------------------------------------------------------------------


def _fit_equivalence(strategy: Any, devices: int, micro: int, jsonl: str) -> dict[str, Any]:
    cfg = small_config()
    model = EquivalenceModel(cfg, reference_state_dict(cfg))
    monitor, logger = LoadBalanceMonitor(log_every_n_steps=2, jsonl_path=jsonl), MemoryLogger()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=3, logger=logger,
                        callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        use_distributed_sampler=False)
    trainer.fit(model, datamodule=FixedData(micro, GLOBAL_BATCH * 3))
    moe_rows = [(s, m) for s, m in logger.rows if any(k.startswith("moe/") for k in m)]
    return {"rows": moe_rows, "last": monitor.last_metrics}


def _ep2(rank: int, world_size: int, jsonl: str) -> dict[str, Any]:
    # W=2, ep=2: the dense view is dp_shard=2, so each rank reads half of every global batch
    out = _fit_equivalence(MoEParallelStrategy(ep=2), world_size, GLOBAL_BATCH // 2, jsonl)
    if rank != 0:
        assert not out["rows"] and not out["last"], "only rank 0 logs"
    return out


@pytest.mark.timeout(300)
def test_ep2_counts_and_metrics_equal_one_process(tmp_path):
    one, two = str(tmp_path / "one.jsonl"), str(tmp_path / "two.jsonl")
    ref = _fit_equivalence("auto", 1, GLOBAL_BATCH, one)
    got = run_distributed(_ep2, 2, two, timeout=240)
    assert [s for s, _ in got["rows"]] == [s for s, _ in ref["rows"]] == [1, 2]
    for (_, g), (_, r) in zip(got["rows"], ref["rows"]):
        assert set(g) == set(r)
        bad = [f"{k}: {g[k]} vs {r[k]}" for k in r if not _close(g[k], r[k])]
        assert not bad, bad
    ref_lines = [json.loads(x) for x in open(one)]
    got_lines = [json.loads(x) for x in open(two)]  # rank 1 wrote nothing: one line per layer and log step
    assert len(got_lines) == len(ref_lines) == 4
    for g, r in zip(got_lines, ref_lines):
        for k in ("step", "layer", "tokens_per_expert", "num_tokens", "num_dropped", "window_steps"):
            assert g[k] == r[k], (k, g[k], r[k])
        assert r["num_tokens"] == GLOBAL_BATCH * SEQ * r["window_steps"]  # global: both ranks' tokens
        assert sum(r["tokens_per_expert"]) == TOP_K * r["num_tokens"]
        for k in ("aux_loss", "z_loss", "entropy"):
            assert _close(g[k], r[k]), (k, g[k], r[k])
        assert all(_close(a, b) for a, b in zip(g["expert_bias"], r["expert_bias"]))


# ---- loggers ---------------------------------------------------------------------------------------------------------


def test_wandb_offline_gets_heatmap_and_histograms_and_csv_gets_scalars(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="W&B logging needs `pip install lightning_moe[wandb]`")
    pytest.importorskip("PIL", reason="wandb.Image needs pillow (`pip install lightning_moe[wandb]`)")
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    for k, v in dict(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", WANDB_DISABLE_GIT="true",
                     WANDB_DISABLE_CODE="true", WANDB_CONSOLE="off", WANDB_API_KEY="").items():
        monkeypatch.setenv(k, v)
    wb = WandbLogger(offline=True, save_dir=str(tmp_path), project="lightning_moe_test")
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    monitor = LoadBalanceMonitor(log_every_n_steps=1)
    # what reaches the W&B run: spy on its public `log` (the .wandb record file is a binary, block-framed format whose
    # byte layout is not an API; reading it with a regex failed one CI run in several)
    logged: list[dict] = []
    run = wb.experiment
    run_log = run.log
    monkeypatch.setattr(run, "log", lambda data, *a, **k: (logged.append(dict(data)), run_log(data, *a, **k))[1])
    try:
        _fit_one_process(tmp_path, [monitor], [wb, csv_logger], max_steps=2, accumulate=1, samples=4)
        run_dir = run.dir
    finally:
        wandb.finish()
    assert "offline-run" in os.path.dirname(run_dir)
    images = glob.glob(os.path.join(run_dir, "media", "images", "moe", "load_heatmap_*.png"))
    assert len(images) == 2, os.listdir(run_dir)  # W&B wrote one heatmap per log step
    moe_logs = [d for d in logged if "moe/worst_layer" in d]
    assert len(moe_logs) == 2, [sorted(d) for d in logged]
    for d in moe_logs:
        assert isinstance(d["moe/load_heatmap"], wandb.Image)
        assert "moe/layer2/max_load_ratio" in d
        for layer in (1, 2):
            hist = d[f"moe/layer{layer}/load"]
            assert isinstance(hist, wandb.Histogram)
            assert len(hist.histogram) == small_config().moe.num_experts and sum(hist.histogram) == pytest.approx(1.0, abs=1e-5)

    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("moe/layer1/max_load_ratio")]
    assert [int(r["step"]) for r in rows] == [0, 1]
    assert "moe/load_heatmap" not in rows[0]  # no media in CSV


def test_tensorboard_gets_the_heatmap_image(tmp_path):
    import tensorboard  # noqa: F401  (the "test" extra installs it; Lightning's TensorBoardLogger needs it)
    from lightning.pytorch.loggers import TensorBoardLogger

    tb = TensorBoardLogger(str(tmp_path), name="tb")
    seen: list[tuple] = []
    tb.experiment.add_image = lambda tag, img, global_step=None, dataformats="CHW": seen.append(
        (tag, img.shape, global_step, dataformats))
    _fit_one_process(tmp_path, [LoadBalanceMonitor(log_every_n_steps=1)], tb, max_steps=1, accumulate=1, samples=2)
    assert seen and seen[0][0] == "moe/load_heatmap" and seen[0][3] == "HWC" and seen[0][1][2] == 3


# ---- user errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(log_every_n_steps=0), "log_every_n_steps"), (dict(log_every_n_steps=2.5), "log_every_n_steps"),
    (dict(heatmap="yes"), "heatmap"), (dict(jsonl_path=3), "jsonl_path"), (dict(jsonl_path="."), "directory"),
])
def test_bad_arguments_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoadBalanceMonitor(**kwargs)


def test_refuses_a_module_that_is_not_moe_language_model(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[LoadBalanceMonitor()])
    with pytest.raises(ValueError, match="MoELanguageModel"):
        trainer.fit(BoringModel())


def test_a_model_without_moe_layers_warns_and_logs_nothing(tmp_path):
    from lightning_moe import ModelConfig

    cfg = ModelConfig.from_preset("tiny", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                  dense_hidden_size=32, max_seq_len=32, moe=dict(first_k_dense=2))
    monitor, logger = LoadBalanceMonitor(log_every_n_steps=1, jsonl_path=str(tmp_path / "r.jsonl")), MemoryLogger()
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=logger, callbacks=[monitor], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="no MoE layer"):
        trainer.fit(MoELanguageModel(cfg, warmup_steps=0), datamodule=PaddedData(4, 2))
    assert not monitor.last_metrics and not (tmp_path / "r.jsonl").exists()
    assert not any(k.startswith("moe/") for _, m in logger.rows for k in m)


def test_skipped_steps_are_left_out_of_the_window(tmp_path):
    from test_module import S, ToyData
    from test_module import small_config as module_config

    data = ToyData(n_train=4, batch_size=2, ignore_tail=[S, S, 0, 0])  # step 0: every label ignored -> skipped
    monitor = LoadBalanceMonitor(log_every_n_steps=2, jsonl_path=str(tmp_path / "r.jsonl"))
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[monitor], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="the step is skipped"):
        trainer.fit(MoELanguageModel(module_config(), warmup_steps=0, skip_empty_steps=True), data)
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert {(x["step"], x["window_steps"], x["num_tokens"]) for x in lines} == {(1, 1, 2 * S)}
    # a second fit appends to the same file: its lines carry another run id
    first = {x["run"] for x in lines}
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[monitor], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="the step is skipped"):
        trainer.fit(MoELanguageModel(module_config(), warmup_steps=0, skip_empty_steps=True), data)
    runs = [json.loads(x)["run"] for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(first) == 1 and runs[:len(lines)] == [*first] * len(lines)
    assert len(runs) == 2 * len(lines) and set(runs[len(lines):]) - first == set(runs[len(lines):])
