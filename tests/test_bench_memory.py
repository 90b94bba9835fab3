"""bench/memory.py: its setting labels parse into the strategy's options, its CPU smoke run goes through a
partial full recomputation (full@N) and recompute + offload at the doubled batch with the first-step gradients equal
to none's, the gradient comparison flags a wrong gradient, and --time-limit skips what would not fit."""

from __future__ import annotations

import json

import pytest
import torch

from bench import memory


def test_labels_parse_into_recompute_kinds_layers_and_offload():
    assert memory.split_labels("none,full@4,norm+attn_core +offload[moe,attention]") == [
        "none", "full@4", "norm+attn_core +offload[moe,attention]"]
    assert memory.parse_setting("none [grads freed]") == ("none", None, None)
    assert memory.parse_setting("none [repeat]") == ("none", None, None)
    assert memory.parse_setting("full@4") == ("full", 4, None)
    assert memory.parse_setting("offload[experts]") == ("none", None, ["experts"])
    assert memory.parse_setting("full@2+norm+moe_act +offload[experts,attention]") == (
        ["full", "norm", "moe_act"], 2, ["experts", "attention"])
    with pytest.raises(ValueError, match="nothing may follow"):
        memory.parse_setting("offload[experts] norm")
    for label in memory.SETTINGS:  # every default setting is one the strategy accepts
        from lightning_moe import MoEParallelStrategy

        ac, layers, _ = memory.parse_setting(label)
        MoEParallelStrategy(activation_checkpointing=ac, recompute_num_layers=layers)


def test_cpu_smoke_runs_partial_full_recomputation(tmp_path):
    out = tmp_path / "memory.json"
    rc = memory.main(["--device", "cpu", "--small", "--steps", "2", "--warmup", "1", "--only",
                      "full@1,norm+moe_act+attn_core +offload[experts]", "--out", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["setting"] for r in runs[:3]] == ["none", "norm+moe_act+attn_core +offload[experts]", "full@1"]
    assert runs[2]["recompute_num_layers"] == 1 and runs[2]["activation_checkpointing"] == "full"
    assert runs[-1]["batch_size"] == 2 * runs[0]["batch_size"]  # the "fits" run of the chosen setting
    first = [r["loss_first"] for r in runs[:3]]
    assert max(first) - min(first) < 1e-4, first  # same model and batch: recomputation changes no number
    for r in runs[1:3]:  # fp32 on one CPU process: the first step's gradients are bit-equal to none's
        assert r["grad_rel_diff_max"] == 0.0 and r["grad_bit_equal"] == r["grad_params"] > 0, r


def test_gradient_comparison_flags_a_wrong_gradient():
    ref = {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.arange(3.0)}
    same = memory.compare_gradients({k: v.clone() for k, v in ref.items()}, ref, torch.device("cpu"))
    assert same == {"grad_rel_diff_max": 0.0, "grad_worst_param": "a", "grad_bit_equal": 2, "grad_params": 2}
    off = memory.compare_gradients({"a": ref["a"], "b": ref["b"] * 1.5}, ref, torch.device("cpu"))
    assert off["grad_worst_param"] == "b" and off["grad_rel_diff_max"] == pytest.approx(0.5)
    assert off["grad_bit_equal"] == 1 and not memory._grads_ok({**off, "finite": True}, 1e-2)
    assert "differ" in memory.compare_gradients({"a": ref["a"]}, ref, torch.device("cpu"))["grad_error"]


def test_time_limit_skips_settings_that_would_not_fit(tmp_path):
    out = tmp_path / "memory.json"
    rc = memory.main(["--device", "cpu", "--small", "--only", "full@1", "--time-limit", "1", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert rc == 0 and [r["setting"] for r in runs] == ["none", "full@1"]
    assert all("--time-limit 1s" in r["skipped"] for r in runs)
