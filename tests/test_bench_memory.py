"""bench/memory.py: its setting labels parse into the strategy's options, and its CPU smoke run goes through a
partial full recomputation (full@N) and recompute + offload at the doubled batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import memory  # noqa: E402


def test_labels_parse_into_recompute_kinds_layers_and_offload():
    assert memory.split_labels("none,full@4,norm+attn_core +offload[moe,attention]") == [
        "none", "full@4", "norm+attn_core +offload[moe,attention]"]
    assert memory.parse_setting("none [grads freed]") == ("none", None, None)
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
