"""``lightning-moe plan`` with a parallel layout, and the example configs it validates."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from lightning_moe.cli import MoECLI
from lightning_moe.config import ModelConfig, MoEConfig, resolve_model_config
from lightning_moe.data import TextDataModule
from lightning_moe.module import MoELanguageModel
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.plan import PRECISION_BYTES, alltoall_volume, layout_plan, layout_rows, memory_plan
from _cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
# the examples that run as they are; finetune_chat.yaml names the user's folders (tests/test_finetune_chat.py runs it)
EXAMPLES = sorted(p for p in CONFIGS.glob("*.yaml") if "pretrained" not in yaml.safe_load(p.read_text())["model"])
QWEN_8GPU = CONFIGS / "qwen3_moe_30b_8gpu.yaml"


_run = run_cli


def _strategy_sizes(doc: dict) -> dict:
    init = dict(doc["trainer"]["strategy"]["init_args"])
    return {k: init[k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "etp") if k in init}


# ---- example configs ------------------------------------------------------------------------------------------------


def test_expected_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"tiny.yaml", "qwen3_moe_1gpu.yaml", "qwen3_moe_2gpu_ep2.yaml", "qwen3_moe_30b_8gpu.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_print_config(path, capsys):
    code = _run(["fit", "--config", str(path), "--print_config"])
    assert code == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model"]["config"]
    spec = yaml.safe_load(path.read_text())["model"]["config"]
    # printed as the resulting fields, whether the file names a preset or gives fields
    assert isinstance(printed, dict)
    assert ModelConfig.from_dict(printed) == resolve_model_config(spec)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_instantiates_without_process_groups(path, tmp_path):
    """The CLI builds Trainer, strategy, model and data of every example on one CPU process (the accelerator forced
    to cpu); no process group is created and the model itself is only built in configure_model."""
    doc = yaml.safe_load(path.read_text())
    saved = sys.argv
    sys.argv = ["lightning-moe"]
    try:
        cli = MoECLI(MoELanguageModel, TextDataModule, run=False, args=[
            "--config", str(path), "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}"])
    finally:
        sys.argv = saved
    assert not dist.is_initialized()
    assert cli.model.model is None
    spec = doc["model"]["config"]
    expected = ModelConfig.from_preset(spec) if isinstance(spec, str) else ModelConfig.from_dict(spec)
    assert cli.model.config == expected
    assert cli.datamodule.seq_len == doc["data"]["seq_len"] <= expected.max_seq_len
    assert cli.datamodule.vocab_size <= expected.vocab_size
    strategy = doc["trainer"].get("strategy")
    if isinstance(strategy, dict):
        from lightning_moe import MoEParallelStrategy

        assert isinstance(cli.trainer.strategy, MoEParallelStrategy)
        world = doc["trainer"]["devices"] * doc["trainer"].get("num_nodes", 1)
        assert cli.trainer.world_size == world
        sizes = _strategy_sizes(doc)
        dims = cli.trainer.strategy._dims()
        assert dims == ParallelDims(world_size=world, **sizes)
        dims.validate(expected, doc["data"]["seq_len"])
    # the header documents how to launch and validate it
    text = path.read_text()
    assert f"lightning-moe fit --config examples/configs/{path.name}" in text
    if path.name != "tiny.yaml":
        assert f"lightning-moe plan --config examples/configs/{path.name}" in text


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.name != "tiny.yaml"], ids=lambda p: p.name)
def test_plan_validates_example(path, capsys):
    assert _run(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "PER-GPU" in out and any(l.startswith("total") for l in out.splitlines())


def test_8gpu_layout_per_gpu_bytes():
    doc = yaml.safe_load(QWEN_8GPU.read_text())
    cfg = ModelConfig.from_preset(doc["model"]["config"])
    assert doc["trainer"]["precision"] == "bf16-true"
    assert doc["trainer"]["strategy"]["init_args"]["activation_checkpointing"] == "full"
    dims = ParallelDims(world_size=8, **_strategy_sizes(doc))
    assert (dims.dp_shard, dims.tp, dims.ep, dims.edp_shard) == (4, 2, 8, 1)
    plan = layout_plan(cfg, dims, "bf16-true", doc["data"]["seq_len"], doc["data"]["batch_size"], "full")

    # independently: tp x FSDP(dp_shard=4) for embeddings, lm_head and attention projections; FSDP only for norms
    # (including the per-head qk norms) and the fp32 router; ep=8 for the routed experts
    b = {k: v["total"] for k, v in cfg.param_breakdown().items()}
    qk_norms = 2 * cfg.head_dim * cfg.num_layers
    expected = {
        "embedding": b["embedding"] // 8 * 2,
        "lm_head": b["lm_head"] // 8 * 2,
        "attention": (b["attention"] - qk_norms) // 8 * 2 + qk_norms // 4 * 2,
        "norms": b["norms"] // 4 * 2,
        "final_norm": b["final_norm"] // 4 * 2,
        "router": b["router"] // 4 * 4,
        "routed_experts": b["routed_experts"] // 8 * 2,
    }
    got = {r.component: r.weight_bytes for r in plan.rows}
    assert got == expected
    total = plan.total()
    assert total.weight_bytes == sum(expected.values())
    whole = sum(r.weight_bytes for r in memory_plan(cfg, "bf16-true"))
    assert whole / 8 <= total.weight_bytes <= whole / 4
    # bf16-true: grads like weights, AdamW moments twice (the fp32 router: 4 and 8 bytes)
    for r in plan.rows:
        assert r.grad_bytes == r.weight_bytes
        assert r.optim_bytes == 2 * r.weight_bytes
    assert total.total_bytes < 40 * 2**30  # room for activations on a 141 GiB H200


@pytest.mark.slow
def test_world_one_layout_is_the_single_device_plan():
    for name in ("tiny", "deepseek_v3", "qwen3_moe_30b_a3b"):
        cfg = ModelConfig.from_preset(name)
        for precision in PRECISION_BYTES:
            single = memory_plan(cfg, precision)
            rows = layout_rows(cfg, ParallelDims(world_size=1), precision)
            assert [(r.component, r.weight_bytes, r.grad_bytes, r.optim_bytes) for r in single] == [
                (r.component, r.weight_bytes, r.grad_bytes, r.optim_bytes) for r in rows]
            assert all(r.local_params == r.params for r in rows)


def test_dp_replicate_divides_nothing_and_edp_shards_experts():
    cfg = ModelConfig.from_preset("qwen3_moe_30b_a3b")
    b = {k: v["total"] for k, v in cfg.param_breakdown().items()}
    hsdp = {r.component: r for r in layout_rows(cfg, ParallelDims(world_size=16, dp_replicate=2, tp=2, ep=8))}
    one = {r.component: r for r in layout_rows(cfg, ParallelDims(world_size=8, tp=2, ep=8))}
    assert {k: r.local_params for k, r in hsdp.items()} == {k: r.local_params for k, r in one.items()}
    # 16 ranks in one replica: the experts are FSDP-sharded over edp_shard=2 on top of ep=8
    fsdp = {r.component: r for r in layout_rows(cfg, ParallelDims(world_size=16, tp=2, ep=8))}
    assert fsdp["routed_experts"].local_params == b["routed_experts"] // 16
    assert fsdp["routed_experts"].split == "ep8 x edp2"
    assert fsdp["embedding"].local_params == b["embedding"] // 16


def test_router_and_shared_experts_not_tp_split():
    cfg = ModelConfig.from_preset("tiny", moe={"shared_expert_hidden_size": 128})  # shared experts, a dense first layer
    b = {k: v["total"] for k, v in cfg.param_breakdown().items()}
    rows = {r.component: r for r in layout_rows(cfg, ParallelDims(world_size=4, tp=2, ep=2))}  # dp_shard=2
    assert rows["shared_experts"].local_params == b["shared_experts"] // 2
    assert rows["router"].local_params == b["router"] // 2
    assert rows["dense_mlp"].local_params == b["dense_mlp"] // 4
    assert rows["routed_experts"].local_params == b["routed_experts"] // 4  # ep=2 x edp_shard=2


def test_mla_heads_tp_split_latents_replicated():
    cfg = ModelConfig.from_preset("deepseek_v3", num_layers=2, hidden_size=256, num_heads=8, q_lora_rank=64,
                                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                  vocab_size=512, dense_hidden_size=512, moe=dict(first_k_dense=1, num_experts=8, top_k=2,
                                                                                  num_groups=2, group_topk=1))
    D, H, ql, kl = 256, 8, 64, 32
    split = H * 24 * ql + H * 32 * kl + H * 16 * D  # wq_b, wkv_b, wo: heads over tp
    whole = D * ql + ql + D * (kl + 8) + kl  # wq_a, q_norm, wkv_a (with the shared rope key), kv_norm
    assert {k: v["total"] for k, v in cfg.param_breakdown().items()}["attention"] == 2 * (split + whole)
    rows = {r.component: r for r in layout_rows(cfg, ParallelDims(world_size=4, tp=2, ep=2))}  # dp_shard=2
    assert rows["attention"].local_params == 2 * (split // 4 + whole // 2)
    assert rows["attention"].split == "tp2 x fsdp2"


# ---- all-to-all volume ---------------------------------------------------------------------------------------------


def _small() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden_size=32,
                       max_seq_len=64, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_size=8, first_k_dense=1))


def test_alltoall_volume_by_hand():
    cfg = _small()  # 2 MoE layers, D=16, k=2
    # world 4: tp=2 x dp_shard=2 for attention, ep=4 for experts; 3 sequences of 32 tokens per data rank
    dims = ParallelDims(world_size=4, tp=2, ep=4)
    a = alltoall_volume(cfg, dims, seq_len=32, micro_batch=3)
    T = 3 * 32 // 2  # sequence parallel: each tp rank routes half the tokens
    rows = T * 2
    per_transfer = rows * 16 * 2  # bf16
    assert (a.tokens_per_rank, a.rows_per_rank, a.transfers) == (48, 96, 4) == (T, rows, 4)
    assert a.ep_bytes == 4 * 2 * per_transfer * 3 // 4 == 18432
    assert a.etp_bytes == 0 and a.total_bytes == 18432
    # full activation checkpointing reruns the forward dispatch and combine
    assert alltoall_volume(cfg, dims, 32, 3, "full").ep_bytes == 6 * 2 * per_transfer * 3 // 4
    # ... only in the MoE layers among the first n blocks with recompute_num_layers (block 0 is dense here)
    part = alltoall_volume(cfg, dims, 32, 3, "full", recompute_num_layers=2)
    assert (part.transfers, part.recomputed_layers) == (4, 1)
    assert part.ep_bytes == (4 * 2 + 2) * per_transfer * 3 // 4
    assert alltoall_volume(cfg, dims, 32, 3, "full", recompute_num_layers=1).ep_bytes == a.ep_bytes
    assert alltoall_volume(cfg, dims, 32, 3, "full", recompute_num_layers=3).transfers == 6
    with pytest.raises(ValueError, match="add 'full'"):
        alltoall_volume(cfg, dims, 32, 3, "norm", recompute_num_layers=2)
    # etp=2 (world 8: tp=2, dp_shard=4; ep=2 x etp=2 x edp_shard=2): the received rows are all-gathered /
    # reduce-scattered over etp, (etp - 1) x rows per transfer
    e = alltoall_volume(cfg, ParallelDims(world_size=8, tp=2, ep=2, etp=2), 32, 3)
    assert e.ep_bytes == 4 * 2 * per_transfer // 2
    assert e.etp_bytes == 4 * 2 * per_transfer * 1
    # context parallel splits the sequence too; no expert parallelism: no traffic
    assert alltoall_volume(cfg, ParallelDims(world_size=4, cp=2, ep=2), 32, 3).tokens_per_rank == 48
    assert alltoall_volume(cfg, ParallelDims(world_size=4, tp=2), 32, 3).total_bytes == 0
    # pad_to_capacity sends E * capacity rows, capacity = ceil(cf * T * k / E)
    cap = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=1.5, pad_to_capacity=True))
    assert alltoall_volume(cap, dims, 32, 3).rows_per_rank == 4 * 36  # ceil(1.5 * 48 * 2 / 4) = 36


def test_plan_cli_layout_output(capsys):
    code = _run(["plan", "--preset", "qwen3_moe_30b_a3b", "--world", "8", "--tp", "2", "--ep", "8",
                 "--precision", "bf16-true"])
    assert code == 0
    out = capsys.readouterr().out
    assert "dp_shard=4" in out and "edp_shard=1" in out and "PER-GPU" in out
    assert "bf16" in out and "NOT counted: activations" in out
    total = next(l for l in out.splitlines() if l.startswith("total"))
    assert "7.1 GiB" in total and "28.5 GiB" in total
    # 2048 tokens/rank x 8 rows x 2048 x 2 B x 7/8, 4 transfers, 48 layers = 10.5 GiB
    a2a = next(l for l in out.splitlines() if l.startswith("all-to-all"))
    assert "10.5 GiB" in a2a
    # full recomputation of the first 12 of 48 blocks: 12 layers re-run 2 of their 4 transfers, 10.5 x 1.125 GiB
    code = _run(["plan", "--preset", "qwen3_moe_30b_a3b", "--world", "8", "--tp", "2", "--ep", "8",
                 "--precision", "bf16-true", "--activation-checkpointing", "full", "--recompute-num-layers", "12"])
    out = capsys.readouterr().out
    assert code == 0 and "+ 2 in each of the 12 MoE layers" in out
    assert "11.8 GiB" in next(l for l in out.splitlines() if l.startswith("all-to-all"))


def test_plan_without_layout_prints_totals(capsys):
    assert _run(["plan", "--preset", "qwen3_moe_30b_a3b", "--precision", "bf16-true"]) == 0
    out = capsys.readouterr().out
    assert "whole model on one device" in out
    total = next(l for l in out.splitlines() if l.startswith("total"))
    assert "30.53B" in total and "3.35B" in total


@pytest.mark.parametrize("argv, fix", [
    (["--preset", "qwen3_moe_30b_a3b", "--world", "8", "--ep", "3"], "choose ep in {1, 2, 4, 8}"),
    (["--preset", "qwen3_moe_30b_a3b", "--world", "6", "--ep", "3"],
     "ep=3 does not divide num_experts=128: choose ep in {1, 2}"),
    (["--preset", "qwen3_moe_30b_a3b", "--world", "6", "--tp", "3"], "tp=3 does not divide num_heads=32"),
    (["--preset", "qwen3_moe_30b_a3b", "--world", "8", "--tp", "2", "--dp-shard", "2"],
     "choose sizes whose product is 8"),
    (["--preset", "qwen3_moe_30b_a3b", "--world", "8", "--cp", "2", "--seq-len", "4094"], "multiple of 4"),
    (["--preset", "deepseek_v3", "--world", "6", "--tp", "3"],
     "tp=3 does not divide num_heads=128 (tensor parallel splits MLA's heads after its latent projections)"),
    (["--preset", "olmoe_1b_7b", "--world", "8", "--tp", "2"], "qk_norm='head'"),
    (["--preset", "qwen3_moe_30b_a3b", "--tp", "2"], "need --world"),
    (["--preset", "tiny", "--world", "2", "--seq-len", "512"], "max_seq_len=256"),
    (["--preset", "tiny", "--world", "2", "--dp-shard", "many"], "invalid int or 'auto' value"),
])
def test_invalid_layouts(argv, fix, capsys):
    code = _run(["plan", *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert "lightning-moe plan: error:" in err and fix in err, err


def test_example_with_bad_layout_fails_at_trainer_construction(tmp_path):
    """A layout that cannot fit the world is a ValueError when the Trainer is built, before any launch."""
    saved = sys.argv
    sys.argv = ["lightning-moe"]
    try:
        with pytest.raises(ValueError, match=r"choose ep in \{1, 2, 4, 8\}"):
            MoECLI(MoELanguageModel, TextDataModule, run=False, args=[
                "--config", str(QWEN_8GPU), "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}",
                "--trainer.strategy.init_args.ep=3"])
    finally:
        sys.argv = saved
    assert not dist.is_initialized()
