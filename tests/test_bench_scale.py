"""bench/scale.py on a CPU: its smoke run on 2 gloo ranks started by torchrun (ep=2 and tp=2,ep=2 with dp_shard=1,
the transformers + FSDP2 peer, the profile path) beside the one-process reference, then the --compare table, whose
ratios must be the ones the JSON files give; and in process the all-to-all exposure arithmetic on a synthetic trace,
the argument checks, the run order, the time limit and the deadline callback."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import _lane as lane
from bench.core import comm_trace
from _bench import has_transformers

REPO = Path(__file__).resolve().parent.parent
POLICY = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _has_transformers() -> bool:
    return has_transformers("Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def sc():
    """The suite's module (importing it sets no environment variable)."""
    import bench.scale

    return bench.scale


@lane.job
def _smoke(d: Path, env: dict) -> dict:
    """Both calls at once (the 2-rank one leaves a core idle much of the time): the torchrun call with two layouts,
    the peer and --profile, and the one-process reference with learned and forced routing."""
    env = dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **POLICY)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    common = ["--device", "cpu", "--steps", "3"]
    calls = {
        "w2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "bench", "scale",
               *common, "--layouts", "ep=2;tp=2,ep=2", "--routing", "learned", "--peer", "--profile",
               "--pg-timeout", "60", "--out", str(d / "w2.json")],
        "w1": [sys.executable, "-m", "bench", "scale", *common, "--routing", "learned,forced", "--no-shared-overlap",
               "--out", str(d / "w1.json")],
    }
    procs = {}

    def call(name: str) -> None:  # output to a file: a full pipe would block a rank
        with open(d / f"{name}.log", "w") as log:
            try:
                procs[name] = lane.run(calls[name], cwd=REPO, env=env, timeout=240, stdout=log,
                                       stderr=subprocess.STDOUT).returncode
            except subprocess.TimeoutExpired:
                procs[name] = "timed out after 240 s"

    threads = [threading.Thread(target=call, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {}
    for name in calls:
        text = (d / f"{name}.log").read_text()
        assert procs[name] == 0, f"{name} exited {procs[name]}:\n{text[-6000:]}"
        out[name] = json.loads((d / f"{name}.json").read_text())
        out[name + "_log"] = text
    out["dir"] = d
    return out


@pytest.fixture(scope="module")
def smoke():
    return lane.result(_smoke)


def _rows(table: str) -> list[dict[str, str]]:
    lines = [ln for ln in table.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[1:]]


def test_smoke_runs_record_per_gpu_figures(smoke):
    w2, w1 = smoke["w2"], smoke["w1"]
    assert w2["world"] == 2 and w1["world"] == 1
    assert w2["env"]["policy_env"] == POLICY
    kinds = [(r["kind"], r["layout"], r["routing"]) for r in w2["runs"]]
    assert kinds == [("ours", "ep=2", "learned"), ("peer", "FSDP2 dp=2", "learned"), ("ours", "tp=2,ep=2", "learned")]
    hf = w2["runs"][1]
    if _has_transformers():
        assert hf["impl"].startswith("transformers") and "FSDP2" in hf["impl"] and hf["params"] > 0
    else:  # the peer is skipped with the reason, not a failure
        assert "transformers cannot be imported" in hf["skipped"]
    ran = [r for r in w2["runs"] if not r.get("skipped")]
    assert [(r["layout"], r["routing"]) for r in w1["runs"]] == [("none", "learned"), ("none", "forced")]
    # MoELayer.overlap_shared_experts as each call set it (default on; the reference ran with --no-shared-overlap)
    assert [r["overlap_shared_experts"] for r in w2["runs"] if r["kind"] == "ours"] == [True, True]
    assert [r["overlap_shared_experts"] for r in w1["runs"]] == [False, False]
    dims = {r["layout"]: r["dims"] for r in w2["runs"] if r["kind"] == "ours"}
    assert dims["ep=2"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 2, "etp": 1, "edp_shard": 1}
    assert (dims["tp=2,ep=2"]["dp_shard"], dims["tp=2,ep=2"]["tp"], dims["tp=2,ep=2"]["ep"]) == (1, 2, 2)
    for r in ran + w1["runs"]:
        assert r["ok"] and not r.get("error") and not r.get("profile_error"), r.get("traceback") or r
        assert r["tokens_per_s_per_gpu"] > 0 and r["tflops_per_gpu"] > 0 and r["mfu"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_gpu"] * r["world"])
        assert len(r["losses"]) == 3 and r["loss_last"] < r["loss_first"]
        assert r["batch_per_gpu"] == 2 and r["seq_len"] == 64
        # the per-GPU rate is the per-GPU tokens over the mean of the slowest rank's timed steps
        timed = r["step_times_s"][r["warmup"]:r["warmup"] + r["timed_steps"]]
        assert r["timed_steps"] == (1 if r["world"] == 2 else 2)  # --profile keeps the last step untimed
        assert r["tokens_per_s_per_gpu"] == pytest.approx(2 * 64 * len(timed) / sum(timed))
    # the same 2 x 64 tokens per GPU: tp=2 peers share their data shard's samples
    micro = {r["layout"]: r["micro_batch_per_data_shard"] for r in ran}
    assert micro["ep=2"] == 2 and micro["tp=2,ep=2"] == 4
    for i, r in enumerate(w2["runs"]):
        if r.get("skipped"):
            continue
        prof = r["profile"]
        assert len(prof["by_rank"]) == 2 and all(p["kernels"] == 0 and p["profiled_steps"] == 1
                                                 for p in prof["by_rank"])
        assert prof["a2a_exposed_share"] is None and "CPU run" in prof["note"]
        stem = smoke["dir"] / f"w2.run{i}"
        assert Path(f"{stem}.rank0.trace.json").exists() and not Path(f"{stem}.rank1.trace.json").exists()
    assert "total wall time" in smoke["w2_log"] and "| ep=2 | learned |" in smoke["w2_log"]


def test_compare_prints_the_ratios_of_the_files(sc, smoke, capsys):
    d = smoke["dir"]
    table_md = d / "table.md"
    assert sc.main(["--compare", str(d / "w1.json"), str(d / "w2.json"), "--table-out", str(table_md)]) == 0
    printed = capsys.readouterr().out
    assert table_md.read_text().strip() == printed.strip()
    rows = {(r["GPUs"], r["layout"], r["routing"]): r for r in _rows(printed)}
    ref = {r["routing"]: r for r in smoke["w1"]["runs"]}
    peer = next((r for r in smoke["w2"]["runs"] if r["kind"] == "peer" and not r.get("skipped")), None)
    assert rows[("1", "none (1 GPU) [shared experts not overlapped]", "forced")]["vs 1 GPU"] == "-"
    for r in smoke["w2"]["runs"]:
        if r["kind"] != "ours":
            continue
        row = rows[("2", r["layout"], r["routing"])]
        ratio = r["tokens_per_s_per_gpu"] / ref[r["routing"]]["tokens_per_s_per_gpu"]
        assert row["vs 1 GPU"] == f"{ratio:.1%}"
        assert row["tokens/s/GPU"] == f"{r['tokens_per_s_per_gpu']:,.0f}"
        if peer is not None:
            assert row[f"vs {sc.PEER}"] == f"{r['tokens_per_s_per_gpu'] / peer['tokens_per_s_per_gpu']:.2f}x"
        assert ("vs 1 GPU >= 95%" in row["missed"]) == (ratio < 0.95)


def _trace(path: Path, kernels: list[tuple[str, int, float, float]]) -> Path:
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": s, "dur": dur, "args": {"device": 0, "stream": st}}
              for n, st, s, dur in kernels]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000})  # not a kernel
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_exposure_arithmetic_on_a_synthetic_trace(sc, tmp_path, capsys):
    # compute on stream 7: [0, 100) and [150, 200); an all-to-all on the NCCL stream 20: [80, 180) overlaps 20 + 30;
    # a second one [300, 340) is fully exposed; an all-gather (stream 21) [190, 260) overlaps 10 of the compute on
    # stream 7 and 10 of a copy on stream 20 (which cannot overlap stream 20's own all-to-all kernels)
    trace = _trace(tmp_path / "t.json", [
        ("sm90_xmma_gemm_bf16", 7, 0, 100), ("void elementwise_kernel", 7, 150, 50),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, 80, 100),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, 300, 40),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 21, 190, 70),
        ("void at::native::copy_kernel", 20, 250, 40),
    ])
    a = comm_trace.analyse_trace(trace, 2)
    assert a["kernels"] == 6 and a["comm_kernels"] == 3 and a["comm_streams"] == ["20", "21"]
    assert a["compute_ms_per_step"] == pytest.approx(190 / 1e3 / 2)
    assert a["a2a"]["kernels"] == 2 and a["a2a"]["ms_per_step"] == pytest.approx(140 / 1e3 / 2)
    assert a["a2a"]["exposed_ms_per_step"] == pytest.approx(90 / 1e3 / 2)  # 140 - 20 - 30
    assert a["a2a"]["exposed_share"] == pytest.approx(90 / 140)
    # all NCCL: [80, 180) + [190, 260) + [300, 340) = 210, overlapped 20 + 30 + 10 + 10
    assert a["nccl"]["ms_per_step"] == pytest.approx(210 / 1e3 / 2)
    assert a["nccl"]["exposed_share"] == pytest.approx(140 / 210)
    assert set(a["comm_ms_per_step_by_kernel"]) == {"ncclDevKernel_SendRecv", "ncclDevKernel_AllGather_RING_LL"}
    # the rank summary: means over ranks, the share of the (unprofiled) step time
    other = comm_trace.comm_exposure(comm_trace.trace_kernels(_trace(tmp_path / "u.json", [
        ("gemm", 1, 0, 100), ("ncclDevKernel_SendRecv", 2, 50, 100)])), 2)  # 50 of 100 exposed
    s = comm_trace.profile_summary([a, other], step_time_s=0.5)
    assert s["a2a_exposed_share"] == pytest.approx((90 / 140 + 0.5) / 2)
    assert s["a2a_exposed_share_max"] == pytest.approx(90 / 140)
    # rank mean of the exposed ms per step (45 and 25 us) over the 500 ms step
    assert s["a2a_exposed_step_share"] == pytest.approx((45 + 25) / 2 / 1e3 / 500)
    assert comm_trace.profile_summary([{"error": "boom"}], 0.5)["error"] == "rank 0: boom"
    # the command line prints the same analysis
    assert sc.main(["--analyse-trace", str(trace), "--profile-steps", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["a2a"] == a["a2a"]


@pytest.mark.parametrize("argv, world, match", [
    (["--layouts", "ep=2,etp=2"], 2, "ep\\*etp"),
    (["--layouts", "ep=3"], 2, "ep"),
    (["--layouts", "ep=2;xp=2"], 2, "unknown keys"),
    (["--layouts", "ep2"], 2, "layout 'ep2'"),
    (["--routing", "learned,greedy"], 2, "--routing"),
    (["--routing", "learned", "--forced-balance"], 2, "--forced-balance"),
    (["--model", "deepseek_v3", "--peer"], 2, "--model qwen3"),
    (["--skip-ours"], 2, "nothing to run"),
    (["--steps", "3", "--warmup", "2", "--profile"], 2, "no step would be timed"),
    (["--loss-impl", "fast"], 1, "--loss-impl"),
    (["--time-limit", "-1"], 1, "--time-limit"),
    (["--model", "deepseek_v3", "--seq-len", "4096"], 1, "max_seq_len"),
])
def test_user_errors_are_value_errors(sc, argv, world, match):
    with pytest.raises(ValueError, match=match):
        sc.parse_args(["--device", "cpu", *argv], world=world)


def test_defaults_plan_and_models(sc):
    a = sc.parse_args(["--device", "cpu"], world=1)
    assert (a.layouts, a.routing, a.steps, a.warmup, a.precision) == ("none", "learned", 4, 1, "32-true")
    a = sc.parse_args(["--device", "cpu", "--forced-balance"], world=2)
    assert a.layouts == "ep=2" and sc.routings(a) == ["forced"]
    a = sc.parse_args(["--device", "cpu", "--layouts", "ep=2; tp=2,ep=2", "--routing", "learned,forced", "--peer"],
                      world=2)
    assert sc.plan(a) == [("ours", "ep=2", "learned"), ("peer", "FSDP2 dp=2", "learned"), ("ours", "ep=2", "forced"),
                          ("ours", "tp=2,ep=2", "learned"), ("ours", "tp=2,ep=2", "forced")]
    assert sc.plan(sc.parse_args(["--device", "cpu", "--skip-ours", "--peer"], world=2)) == [
        ("peer", "FSDP2 dp=2", "learned")]
    # the GPU defaults: the issues' shapes, and every documented layout fits its world and model
    g = sc.parse_args(["--layouts", "ep=8;tp=2,ep=8"], world=8)
    assert (g.batch_per_gpu, g.seq_len, g.precision, g.steps, g.warmup) == (4, 4096, "bf16-true", 20, 5)
    assert sc.parse_args(["--model", "deepseek_v3", "--layouts", "ep=8"], world=8).batch_per_gpu == 2
    for world, lay in ((2, "ep=2;tp=2,ep=2;etp=2"), (4, "ep=4;tp=2,ep=2;ep=2,etp=2")):
        sc.parse_args(["--layouts", lay], world=world)
    qwen = sc.model_config("qwen3", False, 8, 4096)
    assert qwen.num_layers == 8 and qwen.moe.num_experts == 128 and qwen.moe.top_k == 8 and qwen.hidden_size == 2048
    dsv3 = sc.model_config("deepseek_v3", False, 8, 4096)
    assert (dsv3.num_layers, dsv3.moe.num_experts, dsv3.moe.num_groups, dsv3.moe.group_topk) == (3, 64, 8, 4)
    assert sc.model_flops("deepseek_v3", dsv3, 4096)["flops_per_token"] > 0
    forced = sc.with_routing(qwen, "forced")
    assert forced.moe.force_balance and not qwen.moe.force_balance and sc.with_routing(qwen, "learned") is qwen


def test_time_limit_skips_runs_and_still_writes_the_json(sc, tmp_path, monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "cut.json"
    # a limit below the reserve: every run is refused before it starts, the JSON and the table still come
    rc = sc.main(["--device", "cpu", "--routing", "learned,forced", "--time-limit", "1", "--out", str(out)])
    assert rc == 1
    runs = json.loads(out.read_text())["runs"]
    assert [r["routing"] for r in runs] == ["learned", "forced"]
    assert all("--time-limit" in r["skipped"] for r in runs)
    row = _rows(sc.table(runs))[0]
    assert row["ok"].startswith("skipped ours none (learned): --time-limit") and row["missed"] == "-"


def test_deadline_stops_fit_on_every_rank_together(sc):
    decisions = []

    def reduce_boolean_decision(decision, all=True):  # noqa: A002  (Lightning's name)
        decisions.append((decision, all))
        return True  # another rank is past the deadline

    trainer = SimpleNamespace(strategy=SimpleNamespace(reduce_boolean_decision=reduce_boolean_decision),
                              global_step=3, should_stop=False)
    stats = {}
    sc.deadline_stop(time.perf_counter() + 3600, stats).on_train_batch_end(trainer)
    assert trainer.should_stop and stats["stopped_by_time_limit_after_steps"] == 3
    assert decisions == [(False, False)]  # this rank was not past it: any rank's decision stops all
    trainer.should_stop = False
    sc.deadline_stop(None, {}).on_train_batch_end(trainer)  # no limit: no collective, no stop
    assert not trainer.should_stop and len(decisions) == 1
