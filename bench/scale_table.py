"""The scaling suite's table (``python -m bench scale``): ``vs 1 GPU`` and ``vs the peer`` of every run, the
targets it missed, the markdown table with its conventions, and the one-line summary of a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from bench import train_step as ts

PEER = "transformers+FSDP2"
# targets (issue 12 at 2 GPUs, issue 15 at 8): (name, applies to a run?, value key, limit, higher is better)
TARGETS: list[tuple[str, Callable[[dict], bool], str, float, bool]] = [
    ("vs 1 GPU >= 95%", lambda r: r["world"] == 2, "vs_one_gpu", 0.95, True),
    ("vs 1 GPU >= 90% (forced)", lambda r: r["world"] >= 4 and r["routing"] == "forced", "vs_one_gpu", 0.90, True),
    ("vs peer >= 1.6x", lambda r: r["routing"] == "learned", "vs_peer", 1.6, True),
    ("a2a exposed < 25%", lambda r: r["world"] == 2, "a2a_exposed_share", 0.25, False),
    ("TFLOP/s/GPU >= 340", lambda r: r["world"] == 8 and r["model"].startswith("qwen3"), "tflops_per_gpu", 340.0,
     True),
]


def _fmt(v: Any, spec: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, spec) + suffix


def _same_batch(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("model", "batch_per_gpu", "seq_len", "precision"))


def add_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``vs_one_gpu`` and ``vs_peer`` of every timed run of ours (the last matching reference listed wins), and
    ``missed`` targets."""
    timed = [r for r in runs if r.get("tokens_per_s_per_gpu") and not r.get("skipped")]
    for r in runs:
        for key in ("vs_one_gpu", "vs_peer", "missed"):
            r.pop(key, None)
        if r.get("kind") != "ours" or not any(r is x for x in timed):
            continue
        one = [x for x in timed if x["kind"] == "ours" and x["world"] == 1 and x["routing"] == r["routing"]
               and _same_batch(x, r)]
        peer = [x for x in timed if x["kind"] == "peer" and x["world"] == r["world"] and _same_batch(x, r)]
        if one and r["world"] > 1:
            r["vs_one_gpu"] = r["tokens_per_s_per_gpu"] / one[-1]["tokens_per_s_per_gpu"]
        if peer:
            r["vs_peer"] = r["tokens_per_s_per_gpu"] / peer[-1]["tokens_per_s_per_gpu"]
        r["missed"] = [name for name, applies, key, limit, higher in TARGETS
                       if applies(r) and r.get(key) is not None and (r[key] < limit if higher else r[key] >= limit)]
    return runs


def _status(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return r["skipped"][:100]
    if r.get("error"):
        return "FAIL: " + r["error"][:80]
    cut = " (time limit: fewer steps)" if r.get("stopped_by_time_limit_after_steps") else ""
    prof = " (profile FAILED)" if r.get("profile_error") else ""
    return ("yes" if r.get("ok") else "NO (" + ts._why(r) + ")") + cut + prof


TABLE_HEAD = ["model", "GPUs", "layout", "routing", "tokens/s/GPU", "TFLOP/s/GPU", "MFU", "peak GiB", "vs 1 GPU",
              f"vs {PEER}", "a2a ms/step", "a2a exposed", "exposed / step", "loss first -> last", "ok", "missed"]


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in sorted(runs, key=lambda r: (r["model"], r["world"], r["kind"] != "ours")):
        rows.append([
            r["model"], str(r["world"]), ("none (1 GPU)" if r["world"] == 1 and r["kind"] == "ours" else r["layout"])
            + (" [transformers]" if r["kind"] == "peer" else "")
            + (" [shared experts not overlapped]" if r.get("overlap_shared_experts") is False else ""), r["routing"],
            _fmt(r.get("tokens_per_s_per_gpu"), ",.0f"), _fmt(r.get("tflops_per_gpu"), ".1f"),
            _fmt(r.get("mfu"), ".1%"), _fmt(r.get("peak_gib"), ".1f"), _fmt(r.get("vs_one_gpu"), ".1%"),
            _fmt(r.get("vs_peer"), ".2f", "x"), _fmt(r.get("a2a_ms_per_step"), ".1f"),
            _fmt(r.get("a2a_exposed_share"), ".1%"), _fmt(r.get("a2a_exposed_step_share"), ".1%"),
            f"{_fmt(r.get('loss_first'), '.3f')} -> {_fmt(r.get('loss_last'), '.3f')}", _status(r),
            ", ".join(r.get("missed", [])) or ("none" if "missed" in r and r["world"] > 1 else "-"),
        ])
    return rows


def table(runs: list[dict[str, Any]]) -> str:
    """The markdown table of ``runs`` (ratios added), with the conventions under it."""
    add_ratios(runs)
    rows = table_rows(runs)
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "|".join("---" for _ in TABLE_HEAD) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in row) + " |" for row in rows]
    lines += ["", "tokens/s/GPU = global tokens per step / slowest rank's step time / GPUs; vs 1 GPU: our one-process "
              "run, same model, routing and per-GPU batch; vs the peer: same world and batch; a2a: NCCL all-to-all "
              "kernels (profiled steps, rank mean), exposed = not overlapped by compute kernels, as a share of the "
              "all-to-all time and of the step time.",
              "targets: " + "; ".join(name for name, *_ in TARGETS) + " (issue 12 at 2 GPUs, issue 15 at 4-8)."]
    return "\n".join(lines)


def load_runs(paths: list[str]) -> list[dict[str, Any]]:
    runs = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        for r in report.get("runs", []):
            runs.append({**r, "file": str(path)})
    return runs


def summary_line(r: dict[str, Any]) -> str:
    return (f"[{r['model']} | {r['kind']} {r['layout']} | {r['routing']} | {r['world']} GPU] "
            f"tokens/s/GPU {_fmt(r.get('tokens_per_s_per_gpu'), ',.0f')}  "
            f"TFLOP/s/GPU {_fmt(r.get('tflops_per_gpu'), '.1f')}  peak {_fmt(r.get('peak_gib'), '.1f')} GiB  "
            f"a2a exposed {_fmt(r.get('a2a_exposed_share'), '.1%')}  loss {_fmt(r.get('loss_first'), '.3f')} -> "
            f"{_fmt(r.get('loss_last'), '.3f')}  ok={r.get('ok')}" + (f"  ERROR {r['error']}" if r.get("error") else "")
            + (f"  PROFILE ERROR {r['profile_error']}" if r.get("profile_error") else ""))
