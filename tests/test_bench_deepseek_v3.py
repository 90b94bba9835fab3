"""bench/deepseek_v3_step.py on a CPU: its --smoke run (both models through every code path but CUDA timing: the
optimizer timing, the profiler, the table, the JSON and its .log), and in process its FLOP count, argument checks,
run order, time budget and optimizer byte count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _lane as lane
from _bench import has_transformers

REPO = Path(__file__).resolve().parent.parent
RUNNER = [sys.executable, "-m", "bench", "deepseek_v3_step"]


def _has_transformers() -> bool:
    return has_transformers("DeepseekV3ForCausalLM")


@pytest.fixture(scope="module")
def ds():
    """The suite's module (importing it sets no environment variable)."""
    import bench.deepseek_v3_step

    return bench.deepseek_v3_step


@lane.job
def _smoke(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "ds.json"
    env = dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return lane.run([*RUNNER, "--smoke", "--profile", "--out", str(out)], cwd=REPO, env=env,
                    timeout=300), out


def test_smoke_run_of_the_whole_script():
    proc, out = lane.result(_smoke)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    ours, hf = report["runs"]  # the peer runs right after the first variant of ours
    assert ours["impl"].startswith("lightning_moe") and ours["ok"] and not ours.get("error")
    for r in (ours, hf) if not hf.get("skipped") else (ours,):
        assert r["tokens_per_s"] > 0 and r["mfu_causal"] > 0 and r["mfu_noncausal"] > r["mfu_causal"]
        opt = r["optimizer_step"]
        assert opt["seconds"] > 0 and opt["bound_s"] > 0 and opt["ratio_to_bound"] > 0, opt
        if r is hf:  # the plain loop keeps its last step's gradients
            assert opt["grads_filled_with_zeros"] == 0
        else:  # MoEParallelStrategy freed them after the optimizer step: zeros stand in (the same bytes move)
            assert opt["grads_filled_with_zeros"] > 0
        assert r["loss_first"] > r["loss_last"]
    assert "aten::" in ours["profile_top"]
    assert ours["timed_steps"] == 1  # steps 2, warmup 0, the last step profiled and not timed
    if hf.get("skipped"):  # transformers missing: the peer is skipped with the reason, not a crash
        assert not _has_transformers() and "transformers" in hf["skipped"]
    else:
        assert hf["impl"] == "hf grouped_mm (sdpa)" and hf["ok"], hf.get("traceback")
        p = report["comparison"]["params"]
        assert p["ours"] == p["hf"] == p["config_count_params"] - p["expert_bias_buffer_entries"]
        assert hf["first_batch_checksum"] == ours["first_batch_checksum"]
        assert report["comparison"]["ratios"][0]["same_first_batch"]
    text = out.with_suffix(".log").read_text()
    assert "MFU (causal)" in text and "opt / bound" in text and "attention causal" in text
    assert text.strip() in proc.stdout


def test_flops_count_every_matmul_weight(ds):
    for smoke in (True, False):
        cfg = ds.model_config(smoke)
        f = ds.step_flops(cfg, 64)
        b = cfg.param_breakdown()
        latent_norms = cfg.num_layers * (cfg.q_lora_rank + cfg.kv_lora_rank)
        not_matmul = (b["embedding"]["active"] + b["norms"]["active"] + b["final_norm"]["active"] + latent_norms
                      + ds.expert_bias_entries(cfg))
        assert f["weight_macs_per_token"] == cfg.count_params()["active"] - not_matmul
        attn = f["forward_flops_by_component"]["attention_noncausal"]
        assert attn == 2 * cfg.num_layers * cfg.num_heads * (192 + 128 if not smoke else 24 + 16) * 64
        assert f["flops_per_token"] - f["flops_per_token_causal"] == pytest.approx(3 * attn / 2)
    full = ds.model_config(False)
    assert full.count_params()["total"] == 8_537_234_560 and full.num_moe_layers == 2


@pytest.mark.parametrize("argv, match", [
    (["--steps", "2", "--warmup", "1", "--profile"], "--profile needs"),
    (["--steps", "2", "--warmup", "2"], "no step would be timed"),
    (["--ours-variants", "auto,chunky+compile"], "chunky"),
    (["--ours-variants", "auto+jit"], "auto\\+jit"),
    (["--skip-hf", "--skip-ours"], "nothing to run"),
    (["--opt-reps", "0"], "--opt-reps"),
    (["--time-limit", "-1"], "--time-limit"),
])
def test_user_errors_are_value_errors(ds, argv, match):
    with pytest.raises(ValueError, match=match):
        ds.parse_args(["--smoke", *argv])


def test_run_order_and_time_budget(ds):
    args = ds.parse_args(["--smoke", "--ours-variants", "chunked+compile,auto"])
    assert ds.plan(args) == [("ours", "chunked+compile"), ("hf", "grouped_mm"), ("ours", "auto")]
    assert ds.plan(ds.parse_args(["--smoke", "--skip-hf"])) == [("ours", "")]
    budget = ds.Budget(0)
    assert budget.refusal("x") is None and budget.deadline() is None
    budget = ds.Budget(ds.TIME_RESERVE_S + budget.elapsed() + 100)
    assert budget.refusal("x") is None and budget.deadline() is not None
    budget.ran(1000)
    assert "skipped x: --time-limit" in budget.refusal("x")


@pytest.mark.skipif(not _has_transformers(), reason="transformers (with DeepseekV3ForCausalLM) is not installed")
def test_hf_loop_stops_at_the_deadline_and_optimizer_bytes(ds):
    args = ds.parse_args(["--smoke", "--steps", "3"])
    cfg = ds.model_config(True)
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = ds.deepseek_v3_model(cfg, device, torch.float32)
    opt, sched = ds.ts.hf_optimizer(model, args.lr, args.steps, device)
    res = {}
    losses, times = ds.hf_loop(model, opt, sched, args, device, 0.0, res)  # a deadline long past: one step only
    assert len(losses) == len(times) == 1 and res["stopped_by_time_limit_after_steps"] == 1
    o = ds.time_optimizer_step(opt, device, 2, {"bytes_per_s": 1e9})
    n = ds.count_parameters(model)
    assert n == cfg.count_params()["total"] - ds.expert_bias_entries(cfg)
    # fp32 param, grad, exp_avg, exp_avg_sq read (16 bytes), param and both moments written (12 bytes)
    assert o["bytes"]["total"] == 28 * n and o["bound_s"] == pytest.approx(28 * n / 1e9)
    assert o["grads_filled_with_zeros"] == 0 and len(o["times_s"]) == 2
