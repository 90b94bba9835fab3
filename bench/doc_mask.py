#!/usr/bin/env python
"""Document-masked attention vs full causal attention in a training step on one GPU (issue 22).

One piece (about 550 lines): the kernel rotation, the budget planner and the table all read the same per-case run
records; split, a run's order and its budget would sit in different files.

The same packed batches twice: the embedded corpus (Python's standard library, one document per file) under the
byte tokenizer, packed into windows by ``TextDataModule``; once plain (full causal attention over the window: SDPA
``is_causal``, cuDNN on Hopper) and once with ``document_mask=True`` (``position_ids`` restarting per document:
attention block-causal per document, through ``attn_impl`` = auto, split, varlen or flex). Tokens per step are equal,
so the ratio of tokens/s is the ratio of step times. One training run per case (``bench/train_step.py``'s
``run_ours``: Lightning Trainer, bf16-true, fused AdamW, eager) rotates the kernels step by step, each batch once per
kernel, so every kernel times the same windows on the same model and GPU state ("causal" drops the batch's
``position_ids``). ``--warmup`` untimed steps per kernel first (flex compiles in its first), then ``--steps`` timed
ones. The figure a target is judged on is the *paired* ratio (:func:`paired_ratio`): summed step times over the
batches both kernels timed, leaving out the batches on which either paid a one-time cost. A median would not do:
one-document batches (no gain possible) and many-document ones alternate, and the median step lands on one kind.

Cases (``--cases``), each with causal and the document-masked kernels (``--impls``) that can run it; under
``--time-limit`` a case's extra kernels (after its first; flex: a compile of a new shape, the slowest first step) run
only while every later case's target kernel still fits in the time left (estimated, then measured):

* ``qwen@4096``: the 8-layer Qwen3-30B-A3B-shaped bench model, batch 4 x 4096 (target: doc mask >= 0.97x causal);
* ``qwen@16384``: the same, batch 1 x 16384 (target >= 1.03x);
* ``dsv3@4096``: ``bench/deepseek_v3_step.py``'s DeepSeek-V3 shape (MLA, 192 / 128 head dims), batch 2 x 4096
  (target >= 0.97x; varlen needs one head dim, so flex only).

Also printed: the fraction of the causal attention work (sum over documents of n(n+1)/2 against S(S+1)/2) that
document masking leaves for each sequence length, over all training windows; and a correctness check on a small
model after timing (flex's only while time is left): each document-masked kernel's loss and gradients against the
SDPA reference on one packed batch (bf16 on CUDA, relative error of the loss and of the flattened gradient).

``--profile``: each kernel's first timed step runs under torch.profiler and ``torch.cuda.set_sync_debug_mode("warn")``
(that step left out of the mean): the top-15 CUDA kernels by device time, the warnings of synchronizing CUDA calls in
forward + backward and the CUDA runtime's synchronize / blocking memcpy calls of the step.

Run (repository root):
    python -m bench doc_mask --time-limit 330 --profile --out bench/results/doc_mask_h200.json  # one H200: <= 5.5 min
    python -m bench doc_mask --impls split,varlen,flex --steps 20 --time-limit 420  # the kernels side by side
    python -m bench doc_mask --device cpu --small --impls sdpa --steps 2 --warmup 0 --out /tmp/dm.json  # CPU smoke
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/doc_mask.py ...` runs `python -m bench doc_mask ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402

from bench import train_step as ts  # noqa: E402

log = ts.log
TARGETS = {"qwen@4096": 0.97, "qwen@16384": 1.03, "dsv3@4096": 0.97}
BATCH = {"qwen@4096": 4, "qwen@16384": 1, "dsv3@4096": 2}
SMALL_SEQ = {"qwen@4096": 128, "qwen@16384": 256, "dsv3@4096": 64}
RESERVE_S = 15.0
OUTLIER = 1.5  # a step over 1.5x its kernel's median paid a one-time cost (paired_ratio)


def case_config(case: str, small: bool) -> Any:
    model, _, seq = case.partition("@")
    if model == "qwen":
        ns = argparse.Namespace(small=small, layers=2 if small else 8, seq_len=SMALL_SEQ[case] if small else int(seq))
        return ts.qwen_config(ns)
    if model == "dsv3":
        from bench import deepseek_v3_step as ds

        return ds.model_config(small)
    raise ValueError(f"unknown case {case!r}; cases: {', '.join(TARGETS)}")


def case_shape(case: str, small: bool) -> tuple[int, int]:
    """(seq_len, batch_size)."""
    return (SMALL_SEQ[case] if small else int(case.partition("@")[2])), BATCH[case]


def work_fraction(seq_len: int, max_tokens: Optional[int] = None) -> dict[str, Any]:
    """The causal attention work left by document masking, over every training window of the embedded corpus."""
    from lightning_moe.data import TextDataModule

    dm = TextDataModule(seq_len=seq_len, document_mask=True, val_fraction=0.0, shuffle=False, max_tokens=max_tokens)
    dm.setup()
    ds = dm.train_dataset
    n = len(ds)
    pos_NS = torch.stack([ds[i]["position_ids"] for i in range(n)])
    doc_NS = (pos_NS == 0).cumsum(1)
    lengths = torch.zeros(n, seq_len + 1, dtype=torch.float64).scatter_add_(
        1, doc_NS, torch.ones_like(doc_NS, dtype=torch.float64))
    masked = (lengths * (lengths + 1) / 2).sum(1)
    full = seq_len * (seq_len + 1) / 2
    return {"seq_len": seq_len, "windows": n, "fraction": float(masked.mean() / full),
            "docs_per_window": float((lengths > 0).sum(1).double().mean()),
            "single_document_windows": float(((lengths > 0).sum(1) == 1).double().mean())}


def check_kernels(impls: list[str], device: torch.device, small: bool) -> list[dict[str, Any]]:
    """Loss and gradients of each kernel against SDPA on one packed batch of a small GQA and a small MLA model."""
    from lightning_moe.config import ModelConfig
    from lightning_moe.models.transformer import MoETransformer
    from lightning_moe.module import shift_labels

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    for attention, fields in (("gqa", dict(num_heads=8, num_kv_heads=2, head_dim=64, qk_norm="head")),
                              ("mla", dict(attention="mla", qk_norm="none", num_heads=4, q_lora_rank=64,
                                           kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                           v_head_dim=64))):
        cfg = ModelConfig.from_preset("tiny", hidden_size=256, num_layers=2, max_seq_len=512,
                                      moe={"num_experts": 8, "top_k": 2, "expert_hidden_size": 128}, **fields)
        torch.manual_seed(0)
        model = MoETransformer(cfg).to(device)
        model.init_weights()
        model.to(dtype)
        B, S = 2, 512
        ids = torch.randint(0, cfg.vocab_size, (B, S), device=device)
        lengths = [[100, 37, 250, 125], [512]]
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)
        labels = shift_labels(ids, None, pos)

        def run(impl: str) -> tuple[torch.Tensor, torch.Tensor]:
            model.config.attn_impl = impl
            model.zero_grad()
            loss = model(ids, labels_BS=labels, position_ids_BS=pos, loss_impl="torch").loss_sum
            loss.backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
            return loss.detach().float(), grads

        ref_loss, ref_grad = run("sdpa")
        for impl in impls:
            row: dict[str, Any] = {"check": f"{attention} {impl} vs sdpa", "dtype": str(dtype).replace("torch.", "")}
            try:
                if device.type != "cuda" and impl not in ("split", "sdpa"):
                    raise RuntimeError("flex / varlen training needs CUDA (no CPU backward / kernel)")
                loss, grad = run(impl)
                row["loss_rel_err"] = float((loss - ref_loss).abs() / ref_loss.abs())
                row["grad_rel_err"] = float((grad - ref_grad).norm() / ref_grad.norm())
                row["ok"] = row["loss_rel_err"] < 1e-2 and row["grad_rel_err"] < 3e-2
            except Exception as e:  # noqa: BLE001 (reported in the table)
                row["error"] = ts._err(e)
                row["ok"] = False
            out.append(row)
            log(f"check {row['check']}: " + (row.get("error") or
                f"loss rel err {row['loss_rel_err']:.2e}, grad rel err {row['grad_rel_err']:.2e}"))
        del model
        ts.reset_memory(device)
    return out


def deadline_guard(deadline: Optional[float], stats: dict[str, Any]) -> Any:
    import lightning as L

    class Guard(L.Callback):
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if deadline is not None and time.perf_counter() > deadline and not trainer.should_stop:
                stats["stopped_by_time_limit_after_steps"] = trainer.global_step
                trainer.should_stop = True

    return Guard()


class RepeatedBatches:
    """A dataloader's batches, each yielded ``times`` times (shallow copies: the kernel rotation edits its copy), so
    that every kernel of a rotation times the same windows."""

    def __init__(self, loader: Any, times: int) -> None:
        self.loader, self.times = loader, times

    def __iter__(self) -> Any:
        for batch in self.loader:
            for _ in range(self.times):
                yield dict(batch)

    def __len__(self) -> int:
        return len(self.loader) * self.times


def kernel_rotation(kernels: list[str], warmup: int, profile: bool) -> Any:
    """A callback: step i runs ``kernels[i % n]`` ("causal": the batch's ``position_ids`` and ``document_segments``
    dropped, so the model runs unpacked causal attention; else that ``attn_impl`` on the packed batch). The first
    ``warmup`` steps of each kernel are untimed (its first compiles); with ``profile`` the first timed step of each
    kernel runs under torch.profiler and CUDA's sync debug mode (its time then left out of the mean)."""
    import lightning as L

    class KernelRotation(L.Callback):
        def __init__(self) -> None:
            self.kinds: list[str] = []  # the kernel of every step, in order
            self.profiled: dict[str, dict[str, Any]] = {}
            self._prof: Any = None
            self._warned: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            kind = kernels[len(self.kinds) % len(kernels)]
            self.kinds.append(kind)
            if kind == "causal":
                batch.pop("position_ids", None)
                batch.pop("document_segments", None)
            else:
                pl_module.model.config.attn_impl = kind
            if profile and len(self.kinds) > warmup * len(kernels) and kind not in self.profiled:
                self._start(kind)

        def on_before_optimizer_step(self, *_: Any) -> None:
            self._stop_sync_count()

        def on_train_batch_end(self, *_: Any) -> None:
            if self._prof is not None:
                self._stop_sync_count()
                self._prof.__exit__(None, None, None)
                self.profiled[self.kinds[-1]].update(profile_summary(self._prof))
                self._prof = None

        def _start(self, kind: str) -> None:
            import warnings

            from torch.profiler import ProfilerActivity, profile as torch_profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiled[kind] = {"step": len(self.kinds) - 1}
            self._prof = torch_profile(activities=acts)
            self._prof.__enter__()
            self._warned = warnings.catch_warnings(record=True)
            self.profiled[kind]["_log"] = self._warned.__enter__()
            warnings.simplefilter("always")
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")

        def _stop_sync_count(self) -> None:
            """Forward and backward: the window of the sync count (the optimizer and the bench's own timing
            syncs after it are the same for every kernel)."""
            if self._warned is None:
                return
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")
            entry = self.profiled[self.kinds[-1]]
            records = entry.pop("_log")
            self._warned.__exit__(None, None, None)
            self._warned = None
            syncs = [str(w.message) for w in records if "synchroniz" in str(w.message).lower()]
            entry["sync_warnings"] = len(syncs)
            entry["sync_warning_sites"] = sorted({m.splitlines()[0][:120] for m in syncs})[:5]

    return KernelRotation()


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy(")


def profile_summary(prof: Any, top: int = 15) -> dict[str, Any]:
    """The top CUDA kernels of a profiled step (by device time) and its host-sync calls (the CUDA runtime's
    synchronize and blocking memcpy rows)."""
    kernels, syncs = [], {}
    for e in prof.key_averages():
        name = e.key
        if any(name.startswith(c.strip(" (")) and (name == c.strip(" (") or c[-1] in " (") for c in SYNC_CALLS):
            syncs[name] = syncs.get(name, 0) + e.count
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        if str(getattr(e, "device_type", "")).endswith("CUDA") and device_us > 0:
            kernels.append({"kernel": name[:90], "ms": device_us / 1e3, "calls": e.count})
    kernels.sort(key=lambda k: -k["ms"])
    return {"top_kernels": kernels[:top], "cuda_ms": sum(k["ms"] for k in kernels), "sync_calls": syncs}


def case_kernels(case: str, impls: list[str]) -> list[str]:
    """The document-masked kernels that can run ``case`` (varlen needs one head dim: not MLA's)."""
    return [i for i in impls if not (case.startswith("dsv3") and i == "varlen")]


# seconds, for the budget before anything is measured (the H200 log of 2026-12-02: ~35 s per run of 12 steps, most of
# it building; a flex compile of a new shape is the slowest first step); measured values replace them as runs finish
ESTIMATE = {"build_s": 35.0, "step_s": 0.6, "compile_s": 60.0}


def case_cost(kernels: list[str], args: argparse.Namespace, est: dict[str, float]) -> float:
    steps = (args.warmup + args.steps) * len(kernels)
    return est["build_s"] + steps * est["step_s"] + est["compile_s"] * sum(k == "flex" for k in kernels)


def plan(cases: list[str], impls: list[str], args: argparse.Namespace, left: Optional[float],
         est: dict[str, float]) -> list[str]:
    """The kernels of the first case of ``cases`` in the time ``left``: causal and its first kernel always, the others
    (flex: a compile) only if every later case's target kernel still fits after them."""
    first, *later = cases
    usable = case_kernels(first, impls)
    must = ["causal", *usable[:1]]
    if left is None:
        return ["causal", *usable]
    need_later = sum(case_cost(["causal", *case_kernels(c, impls)[:1]], args, est) for c in later)
    kernels = list(must)
    for extra in usable[1:]:
        if left - case_cost(kernels + [extra], args, est) >= need_later:
            kernels.append(extra)
    return kernels


def run_case(case: str, kernels: list[str], args: argparse.Namespace, device: torch.device,
             deadline: Optional[float]) -> list[dict[str, Any]]:
    """One training run of ``case`` rotating ``kernels`` step by step over the same packed batches (each batch once
    per kernel); returns a row per kernel: its mean step time over its timed steps."""
    import lightning_moe.data as data

    cfg = case_config(case, args.small)
    seq_len, batch = case_shape(case, args.small)
    stats: dict[str, Any] = {}
    n = len(kernels)
    total = (args.warmup + args.steps) * n
    ns = argparse.Namespace(steps=total, warmup=args.warmup * n, precision=args.precision, out=args.out,
                            profile=False, loss_impl="auto")
    rotation = kernel_rotation(kernels, args.warmup, args.profile)

    class RotatedText(data.TextDataModule):
        def train_dataloader(self) -> Any:
            return RepeatedBatches(super().train_dataloader(), n)

    plain = data.TextDataModule
    data.TextDataModule = RotatedText  # run_ours builds the datamodule by this name
    try:
        masked = next((k for k in kernels if k != "causal"), "sdpa")
        res = ts.run_ours(case, cfg, seq_len, batch, ns, args.lr, device, None, timed=True,
                          extra_callbacks=(rotation, deadline_guard(deadline, stats)),
                          module_kwargs={"attn_impl": masked},
                          data_kwargs={"document_mask": True, "max_tokens": args.max_tokens})
    finally:
        data.TextDataModule = plain
    times = res.get("step_times_s") or []
    rows = []
    for kind in kernels:
        profiled = rotation.profiled.get(kind, {})
        steps = [i for i, k in enumerate(rotation.kinds[:len(times)]) if k == kind]
        timed_steps = [i for i in steps[args.warmup:] if i != profiled.get("step")]
        timed = [times[i] for i in timed_steps]
        first = times[steps[0]] if steps else None
        row: dict[str, Any] = {"case": case, "kernel": kind, "seq_len": seq_len, "batch_size": batch,
                               "timed_steps": len(timed), "first_step_s": first, "run_wall_s": res.get("wall_s"),
                               "peak_gib": res.get("peak_gib"), "ok": res.get("ok"), **stats}
        if "error" in res:
            row["error"] = res["error"]
        if timed:
            row["step_time_mean_s"] = sum(timed) / len(timed)
            row["step_time_min_s"] = min(timed)
            row["step_time_median_s"] = statistics.median(timed)
            # the median: a kernel's one-time costs (a flex compile, the first run of a new row-run shape) land on
            # whichever timed step first meets a batch that needs them; the mean, with them, is reported beside it
            row["tokens_per_s"] = batch * seq_len / row["step_time_median_s"]
            row["tokens_per_s_mean"] = batch * seq_len / row["step_time_mean_s"]
            row["step_time_by_batch_s"] = {str(i // n): times[i] for i in timed_steps}  # step i ran batch i // n
        elif "error" not in res:
            row["error"] = "no timed step (time limit)"
        if profiled:
            row["profile"] = {k: v for k, v in profiled.items() if k != "step"}
        rows.append(row)
    return rows


def measured(rows: list[dict[str, Any]], args: argparse.Namespace, est: dict[str, float]) -> None:
    """Replace the budget's estimates by what a finished case took."""
    timed = [r for r in rows if r.get("step_time_mean_s")]
    if not timed or rows[0].get("run_wall_s") is None:
        return
    step = max(r["step_time_mean_s"] for r in timed)
    flex = [r["first_step_s"] - r["step_time_mean_s"] for r in timed if r["kernel"] == "flex" and r["first_step_s"]]
    steps = (args.warmup + args.steps) * len(rows)
    est["step_s"] = step
    est["build_s"] = max(5.0, rows[0]["run_wall_s"] - steps * step - sum(flex))
    if flex:
        est["compile_s"] = max(flex)


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in runs:
        if r.get("kernel") in (None, "causal") or "tokens_per_s" not in r:
            continue
        base = next((b for b in runs if b.get("case") == r["case"] and b.get("kernel") == "causal"
                     and "tokens_per_s" in b), None)
        if base is None:
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        target = TARGETS.get(r["case"])
        mean = (r["tokens_per_s_mean"] / base["tokens_per_s_mean"]
                if "tokens_per_s_mean" in r and "tokens_per_s_mean" in base else None)
        paired, dropped = paired_ratio(base.get("step_time_by_batch_s") or {}, r.get("step_time_by_batch_s") or {})
        judged = paired if paired is not None else ratio
        out.append({"case": r["case"], "kernel": r["kernel"], "ratio": ratio, "ratio_of_means": mean,
                    "paired_ratio": paired, "paired_dropped_batches": dropped,
                    "target": target, "met": target is not None and judged >= target})
    return out


def paired_ratio(base: dict[str, float], other: dict[str, float],
                 outlier: float = OUTLIER) -> tuple[Optional[float], int]:
    """tokens/s of ``other`` over ``base`` on the batches both timed: the ratio of their summed step times, leaving
    out every batch on which either kernel paid a one-time cost (a step over ``outlier`` x that kernel's median: a
    flex compile, a first cuDNN plan). The same batches on both sides, so a mix of one- and many-document batches
    (whose steps differ by design) counts as it falls, unlike a median, which lands on one kind of batch."""
    common = sorted(set(base) & set(other), key=int)
    if not common:
        return None, 0
    mb, mo = statistics.median(base[b] for b in common), statistics.median(other[b] for b in common)
    kept = [b for b in common if base[b] <= outlier * mb and other[b] <= outlier * mo]
    if not kept:
        return None, len(common)
    return sum(base[b] for b in kept) / sum(other[b] for b in kept), len(common) - len(kept)


def table(report: dict[str, Any]) -> str:
    lines = ["", "attention work left by document masking (embedded corpus, byte tokenizer):"]
    lines += [f"  seq {w['seq_len']:>6}: {w['fraction']:.3f} of causal ({w['docs_per_window']:.2f} documents per "
              f"window, {w['single_document_windows']:.0%} of windows one document, {w['windows']} windows)"
              for w in report["work_fraction"]]
    for r in report["runs"]:
        prof = r.get("profile")
        if not prof:
            continue
        lines += ["", f"profile {r['case']} {r['kernel']} (one timed step): CUDA {prof.get('cuda_ms', 0):.1f} ms, "
                      f"sync warnings in forward+backward {prof.get('sync_warnings', '-')}, sync calls "
                      f"{prof.get('sync_calls') or '{}'}"]
        lines += [f"    {'; '.join(prof['sync_warning_sites'])}"] if prof.get("sync_warning_sites") else []
        lines += [f"  {k['ms']:>8.2f} ms {k['calls']:>5}x  {k['kernel']}" for k in prof.get("top_kernels", [])]
    lines += ["", "kernel checks (loss / gradient vs SDPA):"]
    for c in report["checks"]:
        lines.append(f"  {c['check']:<24} " + (c.get("error") or f"loss {c['loss_rel_err']:.1e}  grad "
                                                 f"{c['grad_rel_err']:.1e}  {'ok' if c['ok'] else 'MISMATCH'}"))
    lines += ["", "tokens/s and step ms: the median timed step (mean: the mean timed step, one-time costs included)",
              f"{'case':<12} {'kernel':<8} {'tokens/s':>10} {'step ms':>8} {'mean ms':>8} {'1st s':>6} "
              f"{'peak GiB':>8}  status"]
    for r in report["runs"]:
        if "skipped" in r:
            lines.append(f"{r['case']:<12} {r['kernel']:<8} {'-':>10} {'-':>8} {'-':>8} {'-':>6} {'-':>8}  "
                         f"{r['skipped']}")
            continue
        tps, step, mean, first, peak = (r.get(k) for k in ("tokens_per_s", "step_time_median_s", "step_time_mean_s",
                                                           "first_step_s", "peak_gib"))
        status = r.get("error") or ("ok" if r.get("ok") else "loss not falling")
        status += f" ({r['timed_steps']} timed steps)"
        if r.get("stopped_by_time_limit_after_steps") is not None:
            status += f" (time limit: stopped after {r['stopped_by_time_limit_after_steps']} steps)"
        peak_text = f"{peak if peak is not None else float('nan'):>8.1f}"
        lines.append(f"{r['case']:<12} {r['kernel']:<8} {tps or 0:>10.0f} {1e3 * (step or 0):>8.1f} "
                     f"{1e3 * (mean or 0):>8.1f} {first or 0:>6.1f} {peak_text}  {status}")
    lines += ["", "document mask / causal tokens/s (one run per case, kernels rotated step by step over the same "
                  "batches):"]
    lines += ["  paired: summed step times over the same batches, batches with a one-time cost (a step over "
              f"{OUTLIER}x its kernel's median) left out on both sides; the target is judged on it"]
    for q in report["ratios"]:
        of_means = f"; of the means {q['ratio_of_means']:.3f}x" if q.get("ratio_of_means") else ""
        paired = q.get("paired_ratio")
        head = (f"paired {paired:.3f}x ({q['paired_dropped_batches']} batches left out); median {q['ratio']:.3f}x"
                if paired is not None else f"median {q['ratio']:.3f}x")
        lines.append(f"  {q['case']:<12} {q['kernel']:<8} {head}{of_means}  (target >= {q['target']}: "
                     f"{'met' if q['met'] else 'NOT met'})")
    lines.append(f"total {report.get('total_wall_s', 0):.0f} s")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--impls", default="auto,varlen,flex",
                   help="document-masked kernels (attn_impl), in priority order")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each kernel")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each kernel first (flex compiles)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--time-limit", type=float, default=330.0, help="seconds for the whole call (0 = none)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap of the packed corpus (default: all 8 MB)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="small models and sequences (CPU smoke test)")
    p.add_argument("--precision", default=None, help="default bf16-true (cuda), 32-true (cpu)")
    p.add_argument("--profile", action="store_true",
                   help="profile each kernel's first timed step: top-15 CUDA kernels and host syncs")
    p.add_argument("--no-checks", action="store_true", help="skip the small-model correctness checks")
    p.add_argument("--out", default="bench/results/doc_mask.json")
    args = p.parse_args(argv)
    if args.precision is None:
        args.precision = "bf16-true" if args.device == "cuda" else "32-true"
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    kernels = ("split", "auto", "varlen", "flex", "sdpa")
    unknown = [c for c in args.cases if c not in TARGETS] + [i for i in args.impls if i not in kernels]
    if unknown:
        raise ValueError(f"unknown cases or kernels {unknown}; cases: {list(TARGETS)}, kernels: {', '.join(kernels)}")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0 (per kernel)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = ts.pick_device(args.device)
    if device is None:
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report: dict[str, Any] = {"args": vars(args), "env": ts.environment(device), "runs": [], "checks": [],
                              "work_fraction": [], "budget": []}
    deadline = _T_START + args.time_limit - RESERVE_S if args.time_limit else None
    out = Path(args.out)

    def save() -> None:
        report["ratios"] = ratios(report["runs"])
        report["total_wall_s"] = time.perf_counter() - _T_START
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))

    for seq in sorted({case_shape(c, args.small)[0] for c in args.cases}):
        report["work_fraction"].append(work_fraction(seq, args.max_tokens))
    est = dict(ESTIMATE)
    for i, case in enumerate(args.cases):
        left = None if deadline is None else deadline - time.perf_counter()
        kernels = plan(args.cases[i:], args.impls, args, left, est)
        report["budget"].append({"case": case, "left_s": left, "estimate": dict(est), "kernels": kernels})
        try:
            rows = run_case(case, kernels, args, device, deadline)
            measured(rows, args, est)
        except Exception as e:  # noqa: BLE001 (reported, the other cases go on)
            rows = [{"case": case, "kernel": k, "error": ts._err(e), "traceback": traceback.format_exc()}
                    for k in kernels]
        skipped = [k for k in case_kernels(case, args.impls) if k not in kernels]
        rows += [{"case": case, "kernel": k, "skipped": f"time budget ({left:.0f}s left; estimated "
                  f"{case_cost(kernels + [k], args, est) - case_cost(kernels, args, est):.0f}s more)"}
                 for k in skipped]
        report["runs"] += rows
        save()
    if not args.no_checks:  # after the timing: the flex checks compile two more shapes, run while time is left
        left = None if deadline is None else deadline - time.perf_counter()
        impls = [i for i in args.impls if i != "flex" or left is None or left > 2 * est["compile_s"]]
        report["checks"] = check_kernels(impls, device, args.small)
        report["checks"] += [{"check": f"{a} flex vs sdpa", "error": "skipped: time limit", "ok": True}
                             for a in ("gqa", "mla") if "flex" in args.impls and "flex" not in impls]
    text = table(report)
    log(text)
    out.with_suffix(".log").write_text(text + "\n")
    save()
    return 0 if all(c["ok"] for c in report["checks"] if "error" not in c) else 1
