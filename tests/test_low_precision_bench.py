"""bench/low_precision.py on CPU at toy sizes: every mode (layer, step, convergence) runs emulated and writes its JSON
and curves; a --time-limit that leaves no time skips every unit with a message instead of failing. The GPU run
(the issue's numbers) is the same script without --small (see its docstring)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao.float8", reason="the fp8 dense linears use torchao (the ao extra)")

BENCH = Path(__file__).resolve().parent.parent / "bench" / "low_precision.py"
SMOKE = ["--device", "cpu", "--small", "--shapes", "mixtral", "--iters", "1", "--warmup", "1", "--steps", "4",
         "--seq-len", "64", "--conv-steps", "3", "--recipes", "fp8_rowwise,nvfp4", "--repeats", "2",
         "--step-modes", "eager", "--noise-seed", "1"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_low_precision", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(bench, tmp_path, *extra):
    out = tmp_path / "lowp.json"
    threads = torch.get_num_threads()
    try:
        assert bench.main([*SMOKE, "--out", str(out), *extra]) == 0
    finally:
        torch.set_num_threads(threads)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return json.loads(out.read_text()), out


def test_every_mode_runs_on_cpu(bench, tmp_path, capsys):
    report, out = _run(bench, tmp_path)
    (layer,) = report["layer"]
    assert layer["shape"] == "mixtral"
    for routing in ("learned", "forced"):
        assert layer["baseline"][routing]["ms"] > 0 and layer["fp8_rowwise"][routing]["speedup"] > 0
    assert 1e-4 < layer["fp8_rowwise"]["y_rel_diff"] < 0.2  # quantized, and no more than that
    for recipe in ("baseline", "auto", "fp8_rowwise"):  # the median of the repeats, each one kept
        t = layer[recipe]["learned"]
        assert len(t["ms_repeats"]) == 2 and min(t["ms_repeats"]) <= t["ms"] <= max(t["ms_repeats"])
    assert layer["auto"]["converted"] == []  # no crossover table for a CPU: the auto choice is bf16 everywhere
    # both step models (the Qwen3 bench model, the DeepSeek-V3 shape), each with the baseline and both recipes
    assert [(r["model"], r["mode"], r["recipe"]) for r in report["step"]] == [
        (m, "eager", r) for m in ("qwen8", "dsv3") for r in ("baseline", "auto", "fp8_rowwise")]
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in report["step"])
    for r in report["step"]:  # one run each, its rate the median of three windows of its timed steps
        assert r["repeats"] == 1 and len(r["tokens_per_s_windows"]) == 3
        assert r["tokens_per_s"] == sorted(r["tokens_per_s_windows"])[1]
    targets = {(r["model"], r["recipe"]): r.get("target") for r in report["step"]}
    assert targets[("dsv3", "auto")] == 1.1 and targets[("qwen8", "auto")] == 0.98  # issue 23's, on the default
    fp8 = {r["model"]: r for r in report["step"] if r["recipe"] == "fp8_rowwise"}
    assert all(len(r["converted"]) > 0 for r in fp8.values())  # forced FP8 really converted GEMMs
    conv = report["convergence"]
    assert conv["preset"] == "tiny" and conv["settings"]["precision"] == "32-true"
    assert [r["recipe"] for r in conv["runs"]] == ["baseline", "fp8_rowwise", "nvfp4", "baseline_seed1"]
    *recipes, noise = conv["summary"]
    for s in recipes:  # the same init and data as the baseline, a finite comparison over all steps
        assert s["same_init"] and s["same_data"] and s["compared_steps"] == 3 and abs(s["rel_diff"]) < 0.5
        assert s["emulate"] is True and s["target"] in (0.01, 0.03)
    # the second init: same data, another init, no target (it is the noise the others are read against)
    assert noise["same_data"] and not noise["same_init"] and noise["target"] is None and noise["ok"] is None
    assert Path(conv["curves"]).exists() and Path(conv["curves"]).parent == out.parent
    printed = capsys.readouterr().out
    assert "##### summary" in printed and "s/step" in printed


def test_time_limit_skips_units_with_a_message(bench, tmp_path, capsys):
    report, _ = _run(bench, tmp_path, "--time-limit", "0.01")
    assert report["layer"] == [{"shape": "mixtral", "skipped": "time limit"}]
    assert all(r["skipped"] == "time limit" for r in report["step"])
    assert all(s["note"] == "skipped (time limit)" for s in report["convergence"]["summary"])
    # the layer shape; step models x recipes (one run each); the convergence runs and the second init
    assert capsys.readouterr().out.count("SKIPPED") == 1 + 2 * 3 + 3 + 1


def test_conv_reference_runs_only_what_earlier_reports_lack(bench, tmp_path, capsys):
    """--conv-reference: the finished runs of earlier reports are kept (not run again), only the missing (recipe,
    seed) runs run, and each comparison still checks the init; a report of other settings is refused."""
    conv = ["--mode", "convergence", "--recipes", "fp8_rowwise"]
    first, first_out = _run(bench, tmp_path / "a", *conv)
    prior = {r["recipe"]: r for r in first["convergence"]["runs"]}
    assert list(prior) == ["baseline", "fp8_rowwise", "baseline_seed1"]
    again, again_out = _run(bench, tmp_path / "b", *conv[:2], "--recipes", "nvfp4", "--conv-reference", str(first_out))
    runs = {r["recipe"]: r for r in again["convergence"]["runs"]}
    assert list(runs) == ["baseline", "nvfp4", "baseline_seed1", "fp8_rowwise"]
    for name in ("baseline", "fp8_rowwise", "baseline_seed1"):  # taken over, not run again
        assert runs[name]["losses"] == prior[name]["losses"] and runs[name]["from"] == str(first_out)
    assert "from" not in runs["nvfp4"]
    summary = {s["recipe"]: s for s in again["convergence"]["summary"]}
    assert summary["nvfp4"]["same_init"] and summary["nvfp4"]["compared_steps"] == 3
    assert summary["baseline_seed1"]["ok"] is None and not summary["baseline_seed1"]["same_init"]
    # paired init seeds: seed 1's baseline is there already, so only fp8_rowwise from seed 1 runs
    capsys.readouterr()
    seeds, _ = _run(bench, tmp_path / "c", *conv, "--conv-seeds", "0,1", "--conv-reference", str(again_out))
    assert capsys.readouterr().out.count("=== tiny-fp8_rowwise") == 1
    conv_report = seeds["convergence"]
    assert [r["recipe"] for r in conv_report["runs"]] == ["baseline", "fp8_rowwise", "baseline_seed1",
                                                          "fp8_rowwise_seed1", "nvfp4"]
    pair1 = next(s for s in conv_report["summary"] if s["recipe"] == "fp8_rowwise_seed1")
    seed1_base = next(r for r in conv_report["runs"] if r["recipe"] == "baseline_seed1")
    assert pair1["seed"] == 1 and pair1["same_init"] and pair1["baseline_final"] == pytest.approx(
        sum(seed1_base["losses"][-3:]) / 3)  # against the baseline of its own init
    paired = {p["arm"]: p for p in conv_report["paired"]}
    fp8 = paired["fp8_rowwise"]
    assert fp8["n"] == 2 and set(fp8["rel_diff_by_seed"]) == {"0", "1"}
    assert fp8["mean"] == pytest.approx(sum(fp8["rel_diff_by_seed"].values()) / 2)
    assert fp8["ok"] == (abs(fp8["mean"]) <= 0.01) and paired["baseline"]["target"] is None
    assert paired["nvfp4"]["n"] == 1
    # nothing left to run: a merge
    capsys.readouterr()
    merged, _ = _run(bench, tmp_path / "d", *conv, "--conv-seeds", "0,1", "--conv-reference", str(again_out),
                     str(tmp_path / "c" / "lowp.json"))
    assert "=== tiny-" not in capsys.readouterr().out
    assert [r["recipe"] for r in merged["convergence"]["runs"]] == [r["recipe"] for r in conv_report["runs"]]
    # a call for seed 1 only still puts --seed's baseline first: what the table and the plot compare other inits with
    later, _ = _run(bench, tmp_path / "f", *conv, "--conv-seeds", "1", "--conv-reference",
                    str(tmp_path / "c" / "lowp.json"))
    assert "=== tiny-" not in capsys.readouterr().out
    later_runs = later["convergence"]["runs"]
    assert later_runs[0]["recipe"] == "baseline" and later_runs[1]["recipe"] == "baseline_seed1"
    noise = next(s for s in later["convergence"]["summary"] if s["recipe"] == "baseline_seed1")
    assert noise["baseline_final"] == pytest.approx(sum(later_runs[0]["losses"][-3:]) / 3)
    with pytest.raises(SystemExit, match="steps"):
        _run(bench, tmp_path / "e", *conv, "--conv-steps", "4", "--conv-reference", str(first_out))


def test_convergence_settings_bench8_defaults_and_overrides(bench):
    """bench8: lr 1e-4, a tenth of the steps as warmup and fp32 masters at bf16; tiny: the main job's settings
    (examples/configs/tiny.yaml) and no masters; the --conv-* options override either, and the report keeps them."""
    from bench.lowp_convergence import convergence_settings

    b8 = convergence_settings(bench.parse_args(["--device", "cpu", "--small", "--preset", "bench8",
                                                      "--precision", "bf16-true", "--conv-steps", "300"]))
    assert (b8["lr"], b8["warmup"], b8["master"]) == (1e-4, 30, "fp32")
    fp32 = convergence_settings(bench.parse_args(["--device", "cpu", "--small", "--preset", "bench8"]))
    assert fp32["master"] == "none"  # 32-true: the parameters are the masters
    tiny = convergence_settings(bench.parse_args(["--device", "cpu", "--conv-steps", "300"]))
    assert (tiny["lr"], tiny["warmup"], tiny["master"]) == (3e-3, 20, "none")
    over = convergence_settings(bench.parse_args(["--device", "cpu", "--preset", "bench8", "--conv-lr", "3e-4",
                                                        "--conv-warmup", "20", "--conv-master", "none"]))
    assert (over["lr"], over["warmup"], over["master"]) == (3e-4, 20, "none")


def test_conv_model_overrides_the_bench8_shape_and_is_recorded(bench):
    """--conv-model KEY=VALUE (moe.KEY for the MoE block) rebuilds bench8 at another shape; the overrides go into the
    settings (so --conv-reference never merges reports of two shapes); bad items and the tiny preset are refused."""
    from bench.lowp_convergence import convergence_settings, parse_model_overrides

    assert parse_model_overrides(["hidden_size=512", "moe.num_experts=64", "moe.top_k=8", "rope_theta=1e4"]) == {
        "hidden_size": 512, "rope_theta": 1e4, "moe": {"num_experts": 64, "top_k": 8}}
    base = ["--device", "cpu", "--small", "--preset", "bench8"]
    plain = convergence_settings(bench.parse_args(base))
    assert "model_overrides" not in plain  # earlier reports' settings stay mergeable
    full = convergence_settings(bench.parse_args(["--device", "cpu", "--preset", "bench8", "--seq-len", "512"]))
    assert full["source"] == "bench/train_step.py qwen_config (8 layers)"  # the H200 reports' settings, unchanged
    assert plain["source"] != full["source"] and "--small" in plain["source"]  # never merged at equal seq_len
    s = convergence_settings(bench.parse_args([*base, "--conv-model", "num_layers=3", "--conv-model",
                                               "moe.num_experts=16", "--conv-model", "moe.top_k=4"]))
    cfg = s.pop("cfg")
    ref = plain.pop("cfg")
    assert (cfg.num_layers, cfg.moe.num_experts, cfg.moe.top_k) == (3, 16, 4)
    assert (cfg.hidden_size, cfg.moe.expert_hidden_size) == (ref.hidden_size, ref.moe.expert_hidden_size)
    assert s["model_overrides"] == ["num_layers=3", "moe.num_experts=16", "moe.top_k=4"]
    for bad, msg in ((["hidden"], "KEY=VALUE"), (["attn.x=1"], "moe.<field>"), (["no_such_field=1"], "--conv-model: unknown key .*no_such_field")):
        with pytest.raises(SystemExit, match=msg):
            convergence_settings(bench.parse_args([*base, *sum((["--conv-model", b] for b in bad), [])]))
    with pytest.raises(SystemExit, match="--preset bench8"):
        bench.parse_args(["--device", "cpu", "--conv-model", "hidden_size=64"])


def test_kernel_categories_sum_device_time_per_step():
    """Kernels by name: a flash kernel is attention, a GEMM whose name says FP8 an FP8 GEMM (also a CUTLASS rowwise
    one, whose name says "rowwise" like a cast does, and cuBLASLt's nvjet_sm90_q*), other FP8 kernels quantization;
    CPU ops and device-timeline annotations left out; ms per step over the profiled iterations, largest first."""
    from types import SimpleNamespace as E

    from bench.core.kernel_profile import kernel_categories

    cuda = "DeviceType.CUDA"
    events = [E(key="flash_bwd_dq_dk_dv_loop_kernel", self_device_time_total=3000.0, device_type=cuda),
              E(key="nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_TNT", self_device_time_total=6000.0, device_type=cuda),
              E(key="nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", self_device_time_total=600.0,
                device_type=cuda),
              E(key="Optimizer.step#AdamW.step", self_device_time_total=9000.0, device_type=cuda,
                is_user_annotation=True),
              E(key="multi_tensor_apply_kernel<FusedAdamMathFunctor>", self_device_time_total=900.0, device_type=cuda),
              E(key="cutlass::device_kernel<f8f8bf16_rowwise>", self_device_time_total=1500.0, device_type=cuda),
              E(key="_fused_rowwise_quantize_kernel", self_device_time_total=600.0, device_type=cuda),
              E(key="unrolled_elementwise_kernel<c10::Float8_e4m3fn>", self_device_time_total=150.0, device_type=cuda),
              E(key="index_copy_kernel", self_device_time_total=90.0, device_type=cuda),
              E(key="aten::mm", self_device_time_total=0.0, device_type="DeviceType.CPU"),
              E(key="vectorized_elementwise_kernel", self_device_time_total=300.0, device_type=cuda)]
    cats = kernel_categories(E(key_averages=lambda: events), iters=3)
    assert cats == pytest.approx({"bf16 GEMM": 2.0, "attention": 1.0, "fp8 GEMM": 0.7, "optimizer": 0.3,
                                  "quantize": 0.25, "other": 0.1, "copy / pad": 0.03})
    assert list(cats)[:3] == ["bf16 GEMM", "attention", "fp8 GEMM"]


def test_recipe_scope_puts_fp8_on_one_kind_of_gemm(bench):
    """``recipe:experts`` / ``recipe:dense``: the callback quantizes only that kind of GEMM; a scope that is not one
    of the two is refused with the choices."""
    from lightning_moe.config import ModelConfig
    from lightning_moe.models.transformer import MoETransformer

    args = bench.parse_args(["--device", "cpu", "--small", "--recipes",
                             "fp8_rowwise:experts,fp8_rowwise:dense,fp8_rowwise"])
    assert args.recipes == ("fp8_rowwise:experts", "fp8_rowwise:dense", "fp8_rowwise")
    converted = {}
    for recipe in args.recipes:
        cb = bench._callback(recipe, args)
        cb.device = torch.device("cpu")
        model = MoETransformer(ModelConfig.from_preset("tiny"))
        cb.transform_model(model)
        converted[recipe] = cb.converted
        assert cb.emulate  # CPU
    assert converted["fp8_rowwise:experts"] and all("experts" in n and "shared" not in n
                                                    for n in converted["fp8_rowwise:experts"])
    assert converted["fp8_rowwise:dense"] and not any(n.endswith("experts") for n in converted["fp8_rowwise:dense"])
    assert sorted(converted["fp8_rowwise:experts"] + converted["fp8_rowwise:dense"]) == sorted(converted["fp8_rowwise"])
    with pytest.raises(SystemExit, match=":dense or :experts"):
        bench.parse_args(["--device", "cpu", "--recipes", "fp8_rowwise:router"])
    # :keep=PATTERN (repeatable) keeps those modules in bf16, with a scope or without
    keep = bench.parse_args(["--device", "cpu", "--small", "--recipes",
                             "fp8_rowwise:dense:keep=*.wo:keep=*.wq,fp8_rowwise:keep=*.experts"]).recipes
    for recipe, gone in ((keep[0], ("wo", "wq")), (keep[1], ("experts",))):
        cb = bench._callback(recipe, args)
        cb.device = torch.device("cpu")
        cb.transform_model(MoETransformer(ModelConfig.from_preset("tiny")))
        assert cb.converted and not any(n.rsplit(".", 1)[-1] in gone for n in cb.converted), cb.converted
        base = converted["fp8_rowwise:dense" if "dense" in recipe else "fp8_rowwise"]
        assert sorted(cb.converted) == sorted(n for n in base if n.rsplit(".", 1)[-1] not in gone)
    for bad in ("fp8_rowwise:keep=", "fp8_rowwise:dense:experts:keep=*.wo"):
        with pytest.raises(SystemExit, match="keep=PATTERN"):
            bench.parse_args(["--device", "cpu", "--recipes", bad])
    # :emulate: that arm emulated on CUDA too, the others on the kernels (a distinct arm: it pairs with the same
    # baselines as the kernels' run of its recipe)
    cuda = bench.parse_args(["--recipes", "fp8_rowwise:emulate,fp8_rowwise,fp8_rowwise:experts:emulate"])
    assert [bench._emulate(r, cuda) for r in cuda.recipes] == [True, False, True]
    assert bench._callback("fp8_rowwise:experts:emulate", cuda).emulate
    assert not bench._callback("fp8_rowwise", cuda).emulate


def test_repeat_arm_is_the_baseline_again_and_gw_hp_is_a_recipe(bench, tmp_path):
    """``repeat``: the baseline's program again from the same init, compared with it and given no target (on CPU
    the kernels are deterministic: the same losses bit for bit); ``fp8_rowwise_gw_hp`` runs as a recipe with a
    target, its dense linears and experts converted."""
    report, _ = _run(bench, tmp_path, "--mode", "convergence", "--recipes", "repeat,fp8_rowwise_gw_hp")
    conv = report["convergence"]
    runs = {r["recipe"]: r for r in conv["runs"]}
    assert list(runs) == ["baseline", "repeat", "fp8_rowwise_gw_hp", "baseline_seed1"]
    assert runs["repeat"]["losses"] == runs["baseline"]["losses"] and "converted" not in runs["repeat"]
    assert runs["fp8_rowwise_gw_hp"]["converted"]
    summary = {s["recipe"]: s for s in conv["summary"]}
    rep = summary["repeat"]
    assert rep["rel_diff"] == 0.0 and rep["same_init"] and rep["target"] is None and rep["ok"] is None
    assert "nondeterminism" in rep["note"]
    assert summary["fp8_rowwise_gw_hp"]["target"] == 0.01 and summary["fp8_rowwise_gw_hp"]["same_init"]
    for r in conv["runs"]:  # where each run's time outside its steps went: stages that add up to its wall time
        phases = r["phases_s"]
        assert phases["steps"] == pytest.approx(sum(r["step_times_s"]))
        assert phases["build"] > 0 and phases["free"] >= 0 and min(phases.values()) >= 0
        assert sum(v for k, v in phases.items() if k != "free") == pytest.approx(r["wall_s"], rel=1e-9)


def test_conv_hp_loss_records_the_same_weights_in_high_precision(bench, tmp_path, capsys):
    """``--conv-hp-loss``: each quantized run also records, before every step, its batch's loss at its weights in
    high precision: at step 1 (the same init, the same batch) the baseline's loss, later the quantized run's weights
    in bf16; the extra forwards change nothing in the run (CPU is deterministic: the same losses bit for bit), and
    the report splits the difference into the forward's own cost and the weights'."""
    conv = ["--mode", "convergence", "--recipes", "fp8_rowwise"]
    with_hp, _ = _run(bench, tmp_path / "a", *conv, "--conv-hp-loss")
    without, _ = _run(bench, tmp_path / "b", *conv)
    runs = {r["recipe"]: r for r in with_hp["convergence"]["runs"]}
    fp8, base = runs["fp8_rowwise"], runs["baseline"]
    assert "hp_losses" not in base and "hp_losses" not in runs["baseline_seed1"]
    assert len(fp8["hp_losses"]) == len(fp8["losses"]) == 3 and fp8["hp_seconds"] > 0
    assert fp8["hp_losses"][0] == pytest.approx(base["losses"][0], rel=1e-6)
    assert fp8["hp_losses"][0] != fp8["losses"][0]  # the quantized forward differs from the high-precision one
    assert fp8["losses"] == next(r for r in without["convergence"]["runs"] if r["recipe"] == "fp8_rowwise")["losses"]
    s = next(s for s in with_hp["convergence"]["summary"] if s["recipe"] == "fp8_rowwise")
    assert s["forward_cost"] == pytest.approx((s["final"] - s["final_hp"]) / s["final_hp"])
    assert s["rel_diff_hp"] == pytest.approx((s["final_hp"] - s["baseline_final"]) / s["baseline_final"])
    paired = next(p for p in with_hp["convergence"]["paired"] if p["arm"] == "fp8_rowwise")
    assert paired["forward_cost_mean"] == pytest.approx(s["forward_cost"])
    assert "quantized forward's own cost" in capsys.readouterr().out
    assert "final_hp" not in next(s for s in without["convergence"]["summary"] if s["recipe"] == "fp8_rowwise")


def test_grad_group_names_a_parameter_by_its_role():
    """A parameter's group in the gradient check: its role over all layers, without the LightningModule's ``model.``
    prefix and the activation checkpointing wrapper's part."""
    from bench.lowp_convergence import grad_group

    assert grad_group("model.layers.3.attention.wq.weight") == "attention.wq"
    assert grad_group("model.layers.0.moe.experts.w2") == "experts.w2"
    assert grad_group("model.layers.2.moe.shared_experts.w1.weight") == "shared_experts.w1"
    assert grad_group("model.layers.0.feed_forward.w3.weight") == "feed_forward.w3"
    assert grad_group("model.layers.1.moe.router.weight") == "router"
    assert grad_group("model.layers.0.attention.q_norm.weight") == "norms"
    assert grad_group("model.layers.0.ffn_norm.weight") == "norms"
    assert grad_group("model.norm.weight") == "norms"
    assert grad_group("model.tok_embeddings.weight") == "embedding"
    assert grad_group("model.output.weight") == "head"
    assert grad_group("model.layers.3._checkpoint_wrapped_module.attention.wq.weight") == "attention.wq"
    assert grad_group("model.layers.1._checkpoint_wrapped_module.moe.experts.w1") == "experts.w1"
    assert grad_group("layers.1.moe.experts.w3") == "experts.w3"  # no prefix: the same group


def test_conv_grad_check_compares_each_step_gradient_with_high_precision(bench, tmp_path, capsys):
    """``--conv-grad-check 1,3 --conv-grad-window 1``: every run but the baselines compares its gradient at steps 1
    and 3 with the high-precision gradient of the same batch at the same weights. The repeat arm's program is the
    high-precision one (no error at all); fp8_rowwise's quantized groups have an error; the extra forward and
    backward change nothing in the run (CPU is deterministic: the same losses bit for bit). Over a window of 2
    steps the persistence of the error lies in [0, sqrt(2)] (Cauchy-Schwarz); a window the run ends in is kept."""
    checked, _ = _run(bench, tmp_path / "a", "--mode", "convergence", "--recipes", "fp8_rowwise,repeat",
                      "--conv-grad-check", "1,3", "--conv-grad-window", "1")
    printed = capsys.readouterr().out
    without, _ = _run(bench, tmp_path / "b", "--mode", "convergence", "--recipes", "fp8_rowwise")
    runs = {r["recipe"]: r for r in checked["convergence"]["runs"]}
    assert list(runs) == ["baseline", "fp8_rowwise", "repeat", "baseline_seed1"]
    assert "grad_check" not in runs["baseline"] and "grad_check" not in runs["baseline_seed1"]
    for name in ("fp8_rowwise", "repeat"):
        check = runs[name]["grad_check"]
        assert check["checked_steps"] == 2 and [s["step"] for s in check["steps"]] == [1, 3]
        assert [(w["start"], w["steps"]) for w in check["windows"]] == [(1, 1), (3, 1)]
        assert check["seconds"] > 0
    # repeat: the high-precision program is its program, the same gradient exactly
    rep = runs["repeat"]["grad_check"]
    for s in rep["steps"]:
        assert {"attention.wq", "experts.w1", "router", "norms", "embedding", "head"} <= set(s["groups"])
        for g, row in s["groups"].items():
            assert row["rel_err"] == 0.0 and row["proj"] == pytest.approx(1.0, abs=1e-12), (s["step"], g, row)
            assert row["cos"] == pytest.approx(1.0, abs=1e-9), (s["step"], g, row)
            assert row["adam_rel_err"] == 0.0 and row["adam_cos"] == pytest.approx(1.0, abs=1e-9), (s["step"], g)
    for w in rep["windows"]:
        assert w["groups"] and all(row["err_persist"] is None and row["mean_rel_err"] == 0.0
                                   and row["adam_mean_rel_err"] == 0.0 for row in w["groups"].values()), w
    # fp8_rowwise: the quantized GEMMs' gradients differ from the high-precision ones, yet point the same way
    fp8 = runs["fp8_rowwise"]["grad_check"]
    for s in fp8["steps"]:
        groups = s["groups"]
        assert {"head", "embedding"} <= set(groups)
        for g in ("attention.wq", "attention.wo", "experts.w1", "experts.w2"):
            assert groups[g]["rel_err"] > 0 and 0 < groups[g]["cos"] <= 1 + 1e-9, (s["step"], g, groups[g])
            assert groups[g]["adam_rel_err"] > 0 and 0 < groups[g]["adam_cos"] <= 1 + 1e-9, (s["step"], g)
        assert all(row["cos"] is None or -1 - 1e-9 <= row["cos"] <= 1 + 1e-9 for row in groups.values())
    for w in fp8["windows"]:  # one step: |e| / sqrt(|e|^2), 1; the window's Adam error is its step's
        (step,) = [s for s in fp8["steps"] if s["step"] == w["start"]]
        assert w["groups"]["experts.w1"]["adam_mean_rel_err"] == pytest.approx(
            step["groups"]["experts.w1"]["adam_rel_err"], rel=1e-2)  # bf16 accumulators of the experts
        assert w["groups"]["experts.w1"]["err_persist"] == pytest.approx(1.0, rel=1e-5)
        assert w["groups"]["experts.w1"]["grad_persist"] == pytest.approx(1.0, rel=1e-5)
    assert set(fp8["mean"]) == set(fp8["steps"][0]["groups"])
    assert fp8["mean"]["experts.w1"]["rel_err"] == pytest.approx(
        sum(s["groups"]["experts.w1"]["rel_err"] for s in fp8["steps"]) / 2)
    # the check changes nothing in the run
    plain = {r["recipe"]: r for r in without["convergence"]["runs"]}
    assert runs["fp8_rowwise"]["losses"] == plain["fp8_rowwise"]["losses"]
    assert runs["baseline"]["losses"] == plain["baseline"]["losses"] == runs["repeat"]["losses"]
    assert "grad_check" not in plain["fp8_rowwise"]
    assert "gradient check, fp8_rowwise" in printed and "gradient check, repeat" in printed
    assert "gradient check, baseline" not in printed
    # a window from step 2 of 3 steps, of which the 3-step run has 2 (the window it ends in is still reported):
    # the error's persistence between 0 and sqrt(2)
    window, _ = _run(bench, tmp_path / "c", "--mode", "convergence", "--recipes", "fp8_rowwise", "--noise-seed",
                     "0", "--conv-grad-check", "2", "--conv-grad-window", "3")
    runs2 = {r["recipe"]: r for r in window["convergence"]["runs"]}
    check2 = runs2["fp8_rowwise"]["grad_check"]
    assert check2["checked_steps"] == 2 and [s["step"] for s in check2["steps"]] == [2, 3]
    (w,) = check2["windows"]
    assert (w["start"], w["steps"]) == (2, 2)
    for g in ("attention.wq", "experts.w1", "experts.w2", "router"):
        row = w["groups"][g]
        assert 0 < row["err_persist"] <= math.sqrt(2) + 1e-6, (g, row)
        assert 0 < row["grad_persist"] <= math.sqrt(2) + 1e-6, (g, row)
        assert row["mean_rel_err"] > 0 and row["adam_mean_rel_err"] > 0
    assert runs2["fp8_rowwise"]["losses"] == plain["fp8_rowwise"]["losses"]
    assert "adam_rel_err" in printed and "adam_mean_rel_err" in printed


@pytest.mark.parametrize("opt", ["torch", "master"])
def test_adam_denominator_is_the_one_the_optimizer_divides_by(opt):
    """With beta1 = 0 and no weight decay AdamW's step is lr * g / (sqrt(v_hat) + eps) exactly, so each step's
    parameter change recovers the denominator the gradient check puts the errors over, from no state (the first
    step) and from the state of earlier steps; the optimizer's state is only read."""
    from bench.lowp_convergence import adam_denominator
    from lightning_moe.optim.master import MasterAdamW

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5))
    kw = dict(lr=1e-2, betas=(0.0, 0.95), eps=1e-6, weight_decay=0.0)
    optim = torch.optim.AdamW([w], foreach=False, **kw) if opt == "torch" else MasterAdamW([w], fused=False, **kw)
    for step in range(3):
        g = torch.randn(6, 5) * (1 + 10 * step)
        w.grad = g.clone()
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in optim.state.get(w, {}).items()}
        d = adam_denominator(g, optim.state.get(w, {}), 0.95, 1e-6)
        now = optim.state.get(w, {})
        assert now.keys() == state.keys() and all(torch.equal(now[k], v) for k, v in state.items())
        before = w.detach().clone()
        optim.step()
        torch.testing.assert_close(before - w.detach(), 1e-2 * g / d, rtol=1e-4, atol=1e-7)
    assert adam_denominator(g, {}, None, None) is None
    assert adam_denominator(g, {"exp_avg_sq": torch.zeros(3)}, 0.95, 1e-6) is None  # not this gradient's moment


def test_grad_check_refuses_gradient_accumulation():
    """A step of several micro-batches has one gradient; the check's high-precision pass sees one batch."""
    from types import SimpleNamespace

    from bench.lowp_convergence import GradientCheck

    with pytest.raises(ValueError, match="accumulate_grad_batches=1, got 2"):
        GradientCheck([1]).setup(SimpleNamespace(accumulate_grad_batches=2), None, "fit")
    GradientCheck([1]).setup(SimpleNamespace(accumulate_grad_batches=1), None, "fit")
    with pytest.raises(ValueError, match="steps start at 1"):
        GradientCheck([0])
    with pytest.raises(ValueError, match="windows of 8 steps overlap"):
        GradientCheck([1, 5])
    assert GradientCheck([1, 9]).checked == list(range(1, 17))


class _Killed(BaseException):
    """What a call killed from outside looks like to the bench: it is not an Exception, nothing catches it."""


def test_a_call_killed_mid_convergence_leaves_its_finished_runs(bench, tmp_path, monkeypatch):
    out = tmp_path / "lowp.json"
    real, calls = bench._run, []

    def dies_on_the_second_run(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise _Killed
        return real(*a, **kw)

    monkeypatch.setattr(bench, "_run", dies_on_the_second_run)
    conv = ["--mode", "convergence", "--recipes", "fp8_rowwise"]
    with pytest.raises(_Killed):
        bench.main([*SMOKE, *conv, "--out", str(out)])
    partial = json.loads(out.read_text())["convergence"]
    assert partial["partial"] is True and [r["recipe"] for r in partial["runs"]] == ["baseline"]
    assert len(partial["runs"][0]["losses"]) == 3 and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(bench, "_run", real)
    again, _ = _run(bench, tmp_path, *conv, "--conv-reference", str(out))  # reads it, runs only what is missing
    runs = {r["recipe"]: r for r in again["convergence"]["runs"]}
    assert runs["baseline"]["from"] == str(out) and "from" not in runs["fp8_rowwise"]
    assert "partial" not in again["convergence"]


def test_a_convergence_mode_that_fails_keeps_the_runs_it_finished(bench, tmp_path, monkeypatch):
    real, calls = bench._run, []

    def fails_on_the_second_run(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(*a, **kw)

    monkeypatch.setattr(bench, "_run", fails_on_the_second_run)
    report, _ = _run(bench, tmp_path, "--mode", "convergence", "--recipes", "fp8_rowwise")
    conv = report["convergence"]
    assert "out of memory" in conv["error"] and [r["recipe"] for r in conv["runs"]] == ["baseline"]


@pytest.mark.parametrize("share", ["in-order", "proportional"])
def test_conv_share_gives_runs_all_that_is_left_or_a_share(bench, tmp_path, monkeypatch, share):
    """``--conv-share in-order`` (the default) lets each run, in order, use all the time left (Lightning's
    ``max_time`` is the call's remaining time less the run's expected time outside its steps), so runs complete one
    after another; ``proportional`` gives each a share by its expected cost (the first of three runs, one of them
    quantizing, well under half)."""
    real, limits = bench._run, []

    def records_max_time(*a, **kw):
        limits.append(kw["trainer_kwargs"]["max_time"].total_seconds())
        return real(*a, **kw)

    monkeypatch.setattr(bench, "_run", records_max_time)
    extra = ["--mode", "convergence", "--recipes", "fp8_rowwise", "--time-limit", "200"]
    if share == "proportional":
        extra += ["--conv-share", "proportional"]
    report, _ = _run(bench, tmp_path, *extra)
    assert [r["recipe"] for r in report["convergence"]["runs"]] == ["baseline", "fp8_rowwise", "baseline_seed1"]
    assert len(limits) == 3
    if share == "in-order":  # all that is left less the CPU margin (3 s) or the measured time outside the steps
        assert limits[0] > 190 and limits[1] > limits[2] > 150
    else:  # weights 1 : 2.5 : 1 of what is left after three 3-s margins: the first gets about 43 s
        assert 30 < limits[0] < 60 and limits[1] > limits[0]
