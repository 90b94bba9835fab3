"""The command line (``lightning_moe.cli.main``, in-process) and the README / CI contract.

One piece (about 630 lines): its tests drive one entry point (the CLI) with shared fixtures, and the README / CI
contract checks read the same command lines."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml


from lightning_moe.config import ModelConfig, preset_names
import _lane as lane
from _cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny.yaml")


_run = run_cli


def _fields(out: str) -> dict:
    """model.config of a --print_config output, as a ModelConfig."""
    return ModelConfig.from_dict(yaml.safe_load(out)["model"]["config"])


@pytest.mark.slow
def test_fit_tiny_config_short_run(tmp_path, monkeypatch):
    # Lightning's default logger is TensorBoard when it is installed: pretend it is, so that the test holds either way
    # (the pinned CSVLogger is what it reads back)
    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector

    monkeypatch.setattr(logger_connector, "_TENSORBOARD_AVAILABLE", True)
    code = _run([
        "fit", "--config", TINY,
        "--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
        f"--trainer.default_root_dir={tmp_path}", "--data.max_tokens=200000", "--trainer.enable_progress_bar=false",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
    ])
    assert code == 0
    # it really trained: a checkpoint at step 3 that loads without running code, and logged validation losses
    ckpts = glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)
    assert len(ckpts) == 1 and "step=3" in ckpts[0], ckpts
    ckpt = torch.load(ckpts[0], weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 3
    assert ModelConfig.from_dict(ckpt["hyper_parameters"]["config"]) == ModelConfig.from_preset("tiny")
    metrics = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    assert len(metrics) == 1
    with open(metrics[0]) as f:
        vals = [float(r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")]
    # the sanity-check baseline (num_sanity_val_steps=-1 in tiny.yaml) and the validation at step 3
    assert len(vals) == 2 and all(math.isfinite(v) for v in vals), vals
    assert abs(vals[0] - math.log(260)) < 1.0  # a fresh byte-level model is near uniform
    assert vals[1] < vals[0]  # lr 3e-3 for 3 steps lowers it
    # the default LoadBalanceMonitor (every 50 steps) logs the partial window of 3 steps when training ends
    with open(metrics[0]) as f:
        moe = [r for r in csv.DictReader(f) if r.get("moe/layer1/max_load_ratio")]
    assert [(int(r["step"]), float(r["moe/window_steps"])) for r in moe] == [(2, 3.0)]


def test_fit_takes_the_monitor_from_the_config_instead_of_the_default(tmp_path):
    cfg = tmp_path / "monitor.yaml"
    jsonl = tmp_path / "routing" / "counts.jsonl"
    cfg.write_text(yaml.safe_dump({"trainer": {"callbacks": [{
        "class_path": "lightning_moe.callbacks.LoadBalanceMonitor",
        "init_args": {"log_every_n_steps": 1, "jsonl_path": str(jsonl)}}]}}))
    code = _run([
        "fit", "--config", TINY, "--config", str(cfg), "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={tmp_path}", "--data.max_tokens=50000",
        "--data.seq_len=64", "--data.batch_size=2", "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
    ])
    assert code == 0
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert sorted({x["step"] for x in lines}) == [0, 1] and all(x["window_steps"] == 1 for x in lines)
    with open(glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)[0]) as f:
        windows = [float(r["moe/window_steps"]) for r in csv.DictReader(f) if r.get("moe/window_steps")]
    assert windows == [1.0, 1.0]  # the configured monitor only: no default one adding a 2-step window at the end


def test_print_config(capsys):
    code = _run(["fit", "--config", TINY, "--model.lr=0.01", "--print_config"])
    assert code == 0
    out = capsys.readouterr().out
    assert "model:" in out and "data:" in out
    cfg = yaml.safe_load(out)
    # the preset is shown as the fields it resolves to (a config that reloads to the same model)
    assert ModelConfig.from_dict(cfg["model"]["config"]) == ModelConfig.from_preset("tiny")
    assert cfg["model"]["lr"] == pytest.approx(0.01)  # the override, not the file's 3e-3
    assert cfg["data"]["seq_len"] == 256
    assert cfg["trainer"]["max_steps"] == 300


# ---- model.config: a preset plus field overrides compose (issue 8, item 1) --------------------------------------------


def test_cli_overrides_after_a_string_preset_compose(capsys):
    assert _run(["fit", "--config", TINY, "--model.config", "qwen3_moe_30b_a3b", "--model.config.num_layers", "2",
                 "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == ModelConfig.from_preset("qwen3_moe_30b_a3b", num_layers=2)
    # tiny.yaml names the preset `tiny`; a nested override keeps the rest of the preset
    assert _run(["fit", "--config", TINY, "--model.config.moe.top_k", "4", "--model.config.moe.aux_loss_coeff",
                 "1e-3", "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == ModelConfig.from_preset(
        "tiny", moe={"top_k": 4, "aux_loss_coeff": 1e-3})


def test_yaml_preset_dict_and_later_overrides(tmp_path, capsys):
    override = tmp_path / "small_qwen.yaml"
    override.write_text("model:\n  config: {preset: qwen3_moe_30b_a3b, num_layers: 2, moe: {top_k: 4}}\n")
    expected = ModelConfig.from_preset("qwen3_moe_30b_a3b", num_layers=2, moe={"top_k": 4})
    assert _run(["fit", "--config", TINY, "--config", str(override), "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == expected
    # a command-line override after the file composes with it, and so does `--model.config FILE`
    assert _run(["fit", "--config", TINY, "--config", str(override), "--model.config.moe.num_experts", "64",
                 "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == ModelConfig.from_preset(
        "qwen3_moe_30b_a3b", num_layers=2, moe={"top_k": 4, "num_experts": 64})
    fields = tmp_path / "model.yaml"
    fields.write_text("preset: qwen3_moe_30b_a3b\nnum_layers: 2\nmoe: {top_k: 4}\n")
    assert _run(["fit", "--config", TINY, "--model.config", str(fields), "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == expected
    # inline JSON, and `preset` as a dotted key
    assert _run(["fit", "--model.config", '{"preset": "olmoe_1b_7b", "num_layers": 3}', "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == ModelConfig.from_preset("olmoe_1b_7b", num_layers=3)
    assert _run(["fit", "--config", TINY, "--model.config.preset", "mixtral_8x7b", "--model.config.num_layers", "1",
                 "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == ModelConfig.from_preset("mixtral_8x7b", num_layers=1)


def test_printed_config_reloads_to_the_same_model(tmp_path, capsys):
    assert _run(["fit", "--config", TINY, "--model.config.num_layers", "2", "--print_config"]) == 0
    saved = tmp_path / "printed.yaml"
    saved.write_text(capsys.readouterr().out)
    assert _run(["fit", "--config", str(saved), "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == ModelConfig.from_preset("tiny", num_layers=2)


# ---- one clear line and exit status 2 for user errors (item 7) ---------------------------------------------------------


def _bad_files(tmp_path):
    unknown_key = tmp_path / "unknown_key.yaml"
    unknown_key.write_text("model:\n  config: {preset: tiny, moe: {num_expert: 4}}\n")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    return unknown_key, binary


@pytest.mark.parametrize("args, expected", [
    (["--model.config.moe.num_expert", "4"], ["model.config.moe.num_expert", "did you mean 'num_experts'"]),
    (["--model.config.moe.top_k", "16"], ["top_k=16 exceeds moe.num_experts=8"]),
    (["--model.config", "deepseek_v9"], ["unknown preset 'deepseek_v9'", "did you mean 'deepseek_v3'", *preset_names()]),
    (["--model.config.preset", "qwen3"], ["did you mean 'qwen3_moe_30b_a3b'"]),
    (["--model.config.num_layers", "abc"], ["model.config.num_layers must be an integer, got 'abc'"]),
    (["--model.config.qk_norm", "layer"], ["model.config.qk_norm must be one of 'none', 'head', 'full'"]),
    (["--model.lrr", "3"], ["unknown option --model.lrr", "did you mean --model.lr?"]),
    (["--data.seq_len", "abc"], ["data.seq_len: expected int, got 'abc'"]),
    (["--trainer.strategy", "moe_parallel", "--trainer.strategy.epp", "2"], ["--trainer.strategy.epp",
                                                                              "did you mean 'ep'"]),
    (["--config", "{tmp}/missing.yaml"], ["missing.yaml", "does not exist"]),
    (["--config", "{tmp}/unknown_key.yaml"], ["model.config.moe.num_expert", "did you mean 'num_experts'"]),
    (["--model.config", "{tmp}/missing.yaml"], ["file", "missing.yaml", "does not exist"]),
    (["--data.files", "{tmp}/missing.txt"], ["missing.txt", "does not exist"]),
    (["--data.files", "{tmp}/weights.bin"], ["weights.bin", "binary"]),
    (["--data.seq_len", "512"], ["data.seq_len=512 exceeds the model's max_seq_len=256"]),
    (["--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "10"], ["--lr_scheduler needs --optimizer"]),
])
def test_user_errors_are_one_line_and_exit_2(args, expected, tmp_path, capsys):
    _bad_files(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code = _run(["fit", "--config", TINY, *args, "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lightning-moe fit: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


@pytest.mark.parametrize("args, expected", [
    (["--optimizer.lr", "0.1"], ["--optimizer.lr needs --optimizer first"]),
    (["--optimizer", "SGD", "--optimizer.lrr", "0.1"], ["unknown option --optimizer.lrr", "did you mean 'lr'"]),
    (["--optimizer", "SGD", "--optimizer.lr", "abc"], ["optimizer.lr: expected float", "got 'abc'"]),
    (["--optimizer", "SGD", "--lr_scheduler", "StepLR", "--lr_scheduler.step", "3"],
     ["unknown option --lr_scheduler.step", "did you mean 'step_size'"]),
    (["--trainer.strategy", "moe_parallel", "--trainer.strategy.ep", "x"],
     ["trainer.strategy.ep: expected int, got 'x'"]),
    (["--trainer.max_epochs", "abc"], ["trainer.max_epochs: expected int or null, got 'abc'"]),
])
def test_nested_and_typed_option_errors_name_the_option(args, expected, tmp_path, capsys):
    # said from the parser's keys and the classes' signatures, not from jsonargparse's (multi-line) message
    code = _run(["fit", "--config", TINY, *args, f"--trainer.default_root_dir={tmp_path}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lightning-moe fit: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]


def test_config_file_values_compose_with_later_overrides(tmp_path, capsys):
    # a root-level config's section of the subcommand, and a strategy named in a file, take nested options after them
    top = tmp_path / "top.yaml"
    top.write_text("fit:\n  model:\n    config: olmoe_1b_7b\n")
    assert _run(["--config", str(top), "fit", "--model.config.num_layers", "2", "--model.config.moe.top_k", "2",
                 "--print_config"]) == 0
    assert _fields(capsys.readouterr().out) == ModelConfig.from_preset("olmoe_1b_7b", num_layers=2, moe={"top_k": 2})
    layout = tmp_path / "layout.yaml"
    layout.write_text("trainer:\n  devices: 2\n  strategy: moe_parallel\n")
    assert _run(["fit", "--config", TINY, "--config", str(layout), "--trainer.strategy.ep", "2", "--print_config"]) == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_moe.MoEParallelStrategy" and strategy["init_args"]["ep"] == 2


@lane.job
def _unknown_preset(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    proc = lane.run(
        [sys.executable, "-m", "lightning_moe.cli", "fit", "--config", TINY, "--model.config=deepseek_v9",
         "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp}"],
        timeout=300, cwd=str(tmp), env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    return proc, tmp


def test_fit_unknown_preset_exits_2_in_a_real_process():
    # a real process: the exit code and the message a user sees
    proc, tmp_path = lane.result(_unknown_preset)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "deepseek_v9" in proc.stderr
    for name in preset_names():
        assert name in proc.stderr
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


# ---- data files, epochs shorter than the validation interval, strategy by name, optimizers ---------------------------


def test_data_files_takes_one_path_a_directory_or_a_list(tmp_path):
    from lightning_moe.cli import MoECLI
    from lightning_moe.data import TextDataModule
    from lightning_moe.module import MoELanguageModel

    own = tmp_path / "own.txt"
    own.write_text("my own text\n" * 10)
    for value, files in [(str(own), [str(own)]), (str(tmp_path), [str(tmp_path)]),
                         (f"[{own},{own}]", [str(own), str(own)])]:
        saved = sys.argv
        sys.argv = ["lightning-moe"]
        try:
            cli = MoECLI(MoELanguageModel, TextDataModule, run=False, args=[
                "--config", TINY, "--data.files", value, f"--trainer.default_root_dir={tmp_path}"])
        finally:
            sys.argv = saved
        assert cli.datamodule.files == files


@pytest.mark.slow  # 10 CPU s: two fits, a tokenizer trained, generate and predict
def test_own_data_with_a_local_hf_tokenizer(tmp_path, capsys):
    """docs/own_data.md: compressed JSON Lines in a directory, a local Hugging Face tokenizer, the model's vocabulary
    raised from the command line."""
    import gzip

    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["my own text about experts and routers"] * 20, trainer)
    tok_dir = tmp_path / "my_tokenizer"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(tok_dir))
    n_tokens = len(transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True))
    assert n_tokens > 260
    data = tmp_path / "data"
    data.mkdir()
    lines = "".join(json.dumps({"text": f"my own text number {i} about experts"}) + "\n" for i in range(400))
    (data / "train.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    common = ["fit", "--config", TINY, "--data.files", str(data), "--data.tokenizer", str(tok_dir),
              "--data.seq_len=64", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
              "--trainer.limit_val_batches=1",
              "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={tmp_path}",
              "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    assert _run(common) == 2
    assert f"set model.config.vocab_size >= {n_tokens}" in capsys.readouterr().err
    assert _run([*common, "--model.config.vocab_size", str(n_tokens)]) == 0
    ckpt = glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)
    cfg = ModelConfig.from_dict(torch.load(ckpt[0], weights_only=True)["hyper_parameters"]["config"])
    assert cfg == ModelConfig.from_preset("tiny", vocab_size=n_tokens)

    # the checkpoint remembers its tokenizer: generate without --tokenizer decodes with it (not with bytes) ...
    from lightning_moe.generation import generate_main

    capsys.readouterr()
    prompt = ["--ckpt_path", ckpt[0], "--prompt", "my own text", "--max_new_tokens", "6"]
    assert generate_main(prompt + ["--tokenizer", str(tok_dir)]) == 0
    explicit = capsys.readouterr().out
    assert generate_main(prompt) == 0
    out = capsys.readouterr()
    assert out.out == explicit and f"the checkpoint's tokenizer: {tok_dir}" in out.err
    # ... and so do the CLI's evaluation commands
    assert _run(["predict", "--config", TINY, f"--ckpt_path={ckpt[0]}", "--data.predict_prompts=[\"my own\"]",
                 "--model.predict_max_new_tokens=3", f"--trainer.default_root_dir={tmp_path}",
                 "--trainer.enable_progress_bar=false", "--trainer.logger=false"]) == 0
    assert f"data.tokenizer comes from the checkpoint: {tok_dir}" in capsys.readouterr().err
    # once the tokenizer is gone, generate says what to give instead of printing bytes of the wrong vocabulary
    os.rename(tok_dir, tmp_path / "moved")
    assert generate_main(prompt) == 2
    assert "give --tokenizer DIR" in capsys.readouterr().err


@pytest.mark.slow
def test_validation_interval_longer_than_the_epoch_is_no_error(tmp_path):
    # 20000 tokens are 9 batches of 8 x 256: tiny.yaml's val_check_interval of 100 spans epochs
    code = _run(["fit", "--config", TINY, "--data.max_tokens=20000", "--trainer.max_steps=12",
                 "--trainer.val_check_interval=10", "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0",
                 f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
                 "--trainer.enable_model_summary=false",  # the CSV it reads (the default is TensorBoard if installed)
                 "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}"])
    assert code == 0
    metrics = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    with open(metrics[0]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("val_loss")]
    assert [int(r["step"]) for r in rows] == [9]  # validated at the 10th batch, in the second epoch


def test_strategy_by_name_with_arguments(tmp_path, capsys):
    from lightning_moe import MoEParallelStrategy
    from lightning_moe.cli import MoECLI
    from lightning_moe.data import TextDataModule
    from lightning_moe.module import MoELanguageModel

    args = ["--config", TINY, "--trainer.devices=2", "--trainer.strategy", "moe_parallel",
            "--trainer.strategy.ep", "2", f"--trainer.default_root_dir={tmp_path}"]
    assert _run(["fit", *args, "--print_config"]) == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_moe.MoEParallelStrategy" and strategy["init_args"]["ep"] == 2
    saved = sys.argv
    sys.argv = ["lightning-moe"]
    try:
        cli = MoECLI(MoELanguageModel, TextDataModule, run=False, args=args)
    finally:
        sys.argv = saved
    assert isinstance(cli.trainer.strategy, MoEParallelStrategy)
    assert cli.trainer.strategy._sizes["ep"] == 2 and cli.trainer.world_size == 2


def test_optimizer_from_the_command_line(tmp_path):
    """--optimizer SGD: built when Lightning asks (the parameters exist after configure_model), over the model's
    decay / no-decay groups, with the model's warmup-cosine schedule."""
    from lightning_moe.cli import MoECLI
    from lightning_moe.data import TextDataModule
    from lightning_moe.module import MoELanguageModel, warmup_cosine

    saved = sys.argv
    sys.argv = ["lightning-moe"]
    try:
        cli = MoECLI(MoELanguageModel, TextDataModule, args=[
            "fit", "--config", TINY, "--trainer.max_steps=2", "--data.max_tokens=20000", "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--optimizer=SGD", "--optimizer.lr=0.1", "--optimizer.momentum=0.9", "--optimizer.weight_decay=0.01"])
    finally:
        sys.argv = saved
    (opt,) = cli.trainer.optimizers
    assert isinstance(opt, torch.optim.SGD)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.01]  # norms, biases, embeddings: none
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(cli.model.parameters()))
    warmup = yaml.safe_load(Path(TINY).read_text())["model"]["warmup_steps"]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * warmup_cosine(2, warmup, 2, 0.1))
    assert cli.trainer.global_step == 2


# ---- commands and noise ----------------------------------------------------------------------------------------------


def test_top_level_help_lists_every_command(capsys):
    assert _run(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "plan", "generate"):
        assert re.search(rf"^\s+{command}\s", out, flags=re.M), out
    assert _run(["fitt"]) == 2
    assert "did you mean 'fit'" in capsys.readouterr().err


def test_generate_is_dispatched_lazily(monkeypatch, capsys):
    import types

    calls = []
    stub = types.ModuleType("lightning_moe.generation")
    stub.generate_main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, "lightning_moe.generation", stub)
    assert _run(["generate", "--ckpt", "x.ckpt", "--prompt", "def"]) == 0
    assert calls == [["--ckpt", "x.ckpt", "--prompt", "def"]]
    monkeypatch.setitem(sys.modules, "lightning_moe.generation", None)  # not installed: a clear error
    assert _run(["generate", "--ckpt", "x.ckpt"]) == 2
    assert "`generate` is not available" in capsys.readouterr().err


NOISE = ["args parameter is intended", "💡 Tip", "skip_none", "tensorboardX", "LeafSpec", "Traceback",
         "DTensor random operators", "smaller than the logging interval"]


@lane.job
def _tiny_cpu_ep2(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    example = ROOT / "examples" / "configs" / "tiny_cpu_ep2.yaml"
    proc = lane.run(
        [sys.executable, "-m", "lightning_moe.cli", "fit", "--config", str(example), "--trainer.max_steps", "3",
         "--data.max_tokens=40000", "--trainer.limit_val_batches=1", "--trainer.val_check_interval=3",
         f"--trainer.default_root_dir={tmp}", "--trainer.enable_progress_bar=false"],
        timeout=300, cwd=str(tmp),
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"},
    )
    return proc, tmp


def test_tiny_cpu_ep2_example_runs_quietly():
    """The two-process CPU example trains for a few steps, as a user runs it (Lightning starts the second process),
    without third-party noise."""
    proc, tmp_path = lane.result(_tiny_cpu_ep2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in out
    assert re.search(r"val_loss \d+\.\d+ -> \d+\.\d+ \(-\d+\.\d%\) over 3 steps", out), out[-2000:]
    assert glob.glob(str(tmp_path / "**" / "*step=3.ckpt"), recursive=True), out[-2000:]
    for noise in NOISE:
        assert noise not in out, (noise, out[-3000:])


# ---- README / CI contract ---------------------------------------------------------------------------------------------


def _first_code_block(text: str) -> list[str]:
    m = re.search(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    if m is None:
        pytest.fail("README.md has no fenced code block; its first one must hold the run and test commands")
    lines = []
    for line in m.group(1).splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def _ci_test_command() -> str:
    run = (ROOT / ".ci" / "run").read_text()
    cmds = [l.strip() for l in run.splitlines()
            if "pytest" in l and not l.strip().startswith(("#", "echo"))]
    assert len(cmds) == 1, f".ci/run should hold one test command line, found {cmds}"
    return cmds[0]


def test_readme_commands_match_ci():
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.fail("README.md does not exist: its first code block must hold exactly two command lines, the "
                    "second equal to the test command in .ci/run")
    cmds = _first_code_block(readme.read_text())
    assert len(cmds) == 2, f"README.md's first code block should hold exactly two command lines, found {cmds}"
    assert cmds[1] == _ci_test_command(), (
        f"README's test command {cmds[1]!r} differs from .ci/run's {_ci_test_command()!r}")


@pytest.mark.slow
def test_resume_from_the_cli_last_lr_and_shape(tmp_path, capsys, caplog):
    """`--ckpt_path last` finds the newest checkpoint (the end of training always leaves one), a learning rate
    given now wins over the checkpoint's, another model shape is refused naming the fields, and a missing last
    checkpoint is said prominently (an error with --resume_required)."""
    base = ["fit", "--config", TINY, "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={tmp_path}", "--data.max_tokens=60000",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false"]
    assert _run(base + ["--trainer.max_steps=3"]) == 0
    assert "final checkpoint (step 3)" in caplog.text and "`weights_only` was not set" not in caplog.text
    lasts = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    assert len(lasts) == 1 and torch.load(lasts[0], weights_only=True)["global_step"] == 3
    capsys.readouterr()
    assert _run(base + ["--trainer.max_steps=4", "--ckpt_path=last", "--model.lr=1e-5"]) == 0
    err = capsys.readouterr()
    text = err.err + err.out
    assert "--ckpt_path last ->" in text and "lr=1e-05 (checkpoint: 0.003)" in text, text[-2000:]
    # another model shape than the checkpoint's
    assert _run(base + ["--trainer.max_steps=5", "--ckpt_path=last", "--model.config.num_layers=2"]) == 2
    assert "model.config differs from the checkpoint" in capsys.readouterr().err
    # nothing to resume
    empty = tmp_path / "empty"
    args = [a if not a.startswith("--trainer.default_root_dir") else f"--trainer.default_root_dir={empty}" for a in base]
    assert _run(args + ["--trainer.max_steps=1", "--ckpt_path=last", "--resume_required=true"]) == 2
    assert "no checkpoint under" in capsys.readouterr().err
    assert _run(args + ["--trainer.max_steps=1", "--ckpt_path=last"]) == 0
    assert "training starts FROM SCRATCH" in capsys.readouterr().err


def test_test_and_predict_commands(tmp_path, capsys):
    """`lightning-moe test` reports test_loss / test_perplexity on test files (or the validation split);
    `lightning-moe predict` prints the prompts' continuations."""
    text = tmp_path / "t.txt"
    text.write_text("def main():\n    return 0\n" * 200)
    base = ["--config", TINY, f"--trainer.default_root_dir={tmp_path}", "--data.max_tokens=60000",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.limit_test_batches=2",
            "--trainer.limit_predict_batches=1"]
    assert _run(["test"] + base + [f"--data.test_files={text}"]) == 0
    out = capsys.readouterr().out
    assert "test_loss" in out and "test_perplexity" in out, out[-1500:]
    assert _run(["predict"] + base + ["--data.predict_prompts=[\"def main(\", \"import o\"]",
                                      "--model.predict_max_new_tokens=5"]) == 0
    out = capsys.readouterr().out
    assert out.count("def main(") >= 1 and "import o" in out, out[-1500:]
    assert _run(["predict"] + base) == 2
    assert "nothing to predict" in capsys.readouterr().err


def _test_loss(out: str) -> float:
    """test_loss from the table `lightning-moe test` prints (rich or plain)."""
    found = re.search(r"test_loss\D*?([0-9]+\.[0-9]+)", out)
    assert found, out[-1500:]
    return float(found.group(1))


def _newest(root) -> dict:
    from lightning_moe.cli import newest_checkpoint

    path = newest_checkpoint(root)
    assert path is not None, f"no checkpoint under {root}"
    meta = Path(path) / "meta.pt" if os.path.isdir(path) else path
    return {"path": path, **torch.load(meta, weights_only=True, map_location="cpu")}


def test_ckpt_path_last_finds_the_final_step_checkpoint_and_a_missing_one_fails(tmp_path, capsys):
    """When the last step is also a validation step only `epoch=0-step=N.ckpt` is written (no last.ckpt): `last`
    still resolves to it for test and fit; test / validate / predict / generate without a checkpoint exit 2
    instead of evaluating a freshly initialised model. The plain config's checkpoints are checksummed: one flipped
    byte is refused, naming the file."""
    from lightning_moe.generation import generate_main

    text = tmp_path / "t.txt"
    text.write_text("def main():\n    return 0\n" * 200)
    base = ["--config", TINY, f"--trainer.default_root_dir={tmp_path / 'run'}", "--data.max_tokens=60000",
            "--data.seq_len=64", "--data.batch_size=4", "--trainer.enable_progress_bar=false", "--trainer.logger=false"]
    fit = ["fit", *base, "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1",
           "--trainer.num_sanity_val_steps=0"]
    assert _run(fit + ["--trainer.max_steps=4"]) == 0
    written = sorted(p.name for p in (tmp_path / "run").rglob("*.ckpt"))
    assert written == ["epoch=0-step=4.ckpt"], written  # the final step was saved by the validation: no last.ckpt
    step4 = _newest(tmp_path / "run")["path"]
    capsys.readouterr()

    test = ["test", *base, f"--data.test_files={text}", "--trainer.limit_test_batches=2"]
    assert _run(test + ["--ckpt_path=last"]) == 0
    out = capsys.readouterr()
    assert f"--ckpt_path last -> {step4}" in out.err, out.err[-1500:]
    from_last = _test_loss(out.out)
    assert _run(test + [f"--ckpt_path={step4}"]) == 0
    assert _test_loss(capsys.readouterr().out) == from_last
    assert _run(test) == 0  # no checkpoint asked for: the fresh model, said so
    out = capsys.readouterr()
    assert "runs a freshly initialised model" in out.err and _test_loss(out.out) != from_last

    assert _run(fit + ["--trainer.max_steps=5", "--ckpt_path=last"]) == 0
    assert "FROM SCRATCH" not in capsys.readouterr().err
    resumed = _newest(tmp_path / "run")
    assert resumed["global_step"] == 5 and resumed["path"] != step4

    # nothing under the run folder: an error for every command but fit
    empty = [a if not a.startswith("--trainer.default_root_dir") else f"--trainer.default_root_dir={tmp_path / 'no'}"
             for a in base]
    for command in ("test", "validate", "predict"):
        assert _run([command, *empty, "--ckpt_path=last", f"--data.test_files={text}",
                     "--data.predict_prompts=[\"def\"]"]) == 2, command
        assert "--ckpt_path last: no checkpoint under" in capsys.readouterr().err
    assert generate_main(["--ckpt_path", str(tmp_path / "no" / "last.ckpt"), "--prompt", "def"]) == 2
    assert "does not exist" in capsys.readouterr().err

    # checksummed by default: a flipped byte that torch.load would not notice is refused before the run starts
    assert Path(step4 + ".crc32").is_file()
    damaged = tmp_path / "damaged.ckpt"
    data = bytearray(Path(step4).read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    Path(str(damaged) + ".crc32").write_text(Path(step4 + ".crc32").read_text())
    torch.load(damaged, weights_only=True)  # the damage is invisible without the checksum
    assert _run(fit + ["--trainer.max_steps=6", f"--ckpt_path={damaged}"]) == 2
    assert "damaged.ckpt is damaged" in capsys.readouterr().err


def test_a_distributed_checkpoint_resumes_under_the_plain_config(tmp_path, capsys):
    """A checkpoint directory (MoEParallelStrategy's distributed format, any layout) given to the plain tiny.yaml
    loads: the CLI chooses MoEParallelStrategy for it, and says so; another strategy is refused naming the flag."""
    base = ["--config", TINY, f"--trainer.default_root_dir={tmp_path}", "--data.max_tokens=60000",
            "--data.seq_len=64", "--data.batch_size=4", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
            "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
    try:
        assert _run(["fit", *base, "--trainer.max_steps=2", "--trainer.strategy=moe_parallel"]) == 0
        first = _newest(tmp_path)
        assert os.path.isdir(first["path"]) and first["global_step"] == 2
        capsys.readouterr()
        assert _run(["fit", *base, "--trainer.max_steps=3", f"--ckpt_path={first['path']}"]) == 0
        assert "is a distributed checkpoint (a directory): loading it with MoEParallelStrategy" in \
            capsys.readouterr().err
        assert _newest(tmp_path)["global_step"] == 3
        assert _run(["fit", *base, "--trainer.max_steps=4", f"--ckpt_path={first['path']}",
                     "--trainer.strategy=single_device"]) == 2
        assert "--trainer.strategy moe_parallel" in capsys.readouterr().err
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_the_progress_bar_of_a_step_based_run(tmp_path, capsys):
    """With rich installed (the test extras) the bar of `lightning-moe fit` reads `Epoch 0`, not Lightning's
    `Epoch 0/-2` of an unbounded max_epochs, and shows the throughput whole under a short name."""
    pytest.importorskip("rich")
    assert _run(["fit", "--config", TINY, "--trainer.max_steps=3", "--trainer.limit_val_batches=0",
                 "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={tmp_path}", "--data.seq_len=64",
                 "--data.batch_size=2", "--data.max_tokens=20000", "--trainer.logger=false",
                 "--trainer.enable_checkpointing=false", "--trainer.enable_model_summary=false"]) == 0
    out = capsys.readouterr().out
    assert "Epoch 0" in out and "Epoch 0/-" not in out, out[-2000:]
    assert re.search(r"tok/s: \d+\b", out) and "tokens_per" not in out and "v_num" not in out, out[-2000:]
