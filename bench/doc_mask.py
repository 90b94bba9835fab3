#!/usr/bin/env python
"""Document-masked attention vs full causal attention in a training step on one GPU (issue 22).

The same packed batches twice: the embedded corpus (Python's standard library, one document per file) under the
byte tokenizer, packed into windows by ``TextDataModule``; once plain (full causal attention over the window: SDPA
``is_causal``, flash) and once with ``document_mask=True`` (``position_ids`` restarting per document: attention
block-causal per document, through ``attn_impl`` = varlen or flex). Tokens per step are equal, so the ratio of
tokens/s is the ratio of step times. Every run goes through ``bench/train_step.py``'s ``run_ours`` (Lightning
Trainer, bf16-true, fused AdamW, eager).

Cases (``--cases``; the order is the priority under ``--time-limit``: first one number per target, then the other
kernel):

* ``qwen@4096``: the 8-layer Qwen3-30B-A3B-shaped bench model, batch 4 x 4096 (target: doc mask >= 0.97x causal);
* ``qwen@16384``: the same, batch 1 x 16384 (target >= 1.03x);
* ``dsv3@4096``: ``bench/deepseek_v3_step.py``'s DeepSeek-V3 shape (MLA, 192 / 128 head dims), batch 2 x 4096
  (target >= 0.97x; varlen needs one head dim, so flex only).

Also printed: the fraction of the causal attention work (sum over documents of n(n+1)/2 against S(S+1)/2) that
document masking leaves for each sequence length, over all training windows; and a correctness check on a small
model before timing: each document-masked kernel's loss and gradients against the SDPA reference on one packed batch
(bf16 on CUDA, relative error of the loss and of the flattened gradient).

Run (repository root):
    python -m bench doc_mask --time-limit 330 --out bench/results/doc_mask_h200.json     # one H200: <= 6 minutes
    python -m bench doc_mask --device cpu --small --steps 2 --warmup 0 --out /tmp/dm.json  # CPU smoke test
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/doc_mask.py ...` runs `python -m bench doc_mask ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402

from bench import train_step as ts  # noqa: E402

log = ts.log
TARGETS = {"qwen@4096": 0.97, "qwen@16384": 1.03, "dsv3@4096": 0.97}
BATCH = {"qwen@4096": 4, "qwen@16384": 1, "dsv3@4096": 2}
SMALL_SEQ = {"qwen@4096": 128, "qwen@16384": 256, "dsv3@4096": 64}
RESERVE_S = 20.0


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
            "docs_per_window": float((lengths > 0).sum(1).double().mean())}


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
            loss = model(ids, labels_BS=labels, position_ids_BS=pos, loss_impl="torch")
            loss.backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
            return loss.detach().float(), grads

        ref_loss, ref_grad = run("sdpa")
        for impl in impls:
            row: dict[str, Any] = {"check": f"{attention} {impl} vs sdpa", "dtype": str(dtype).replace("torch.", "")}
            try:
                if device.type != "cuda":
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


def run_case(case: str, impl: str, args: argparse.Namespace, device: torch.device,
             deadline: Optional[float]) -> dict[str, Any]:
    """One timed run: ``impl`` "causal" (no document mask) or an ``attn_impl`` with ``document_mask=True``."""
    cfg = case_config(case, args.small)
    seq_len, batch = case_shape(case, args.small)
    ns = argparse.Namespace(steps=args.steps, warmup=args.warmup, precision=args.precision, out=args.out,
                            profile=False, loss_impl="auto")
    doc = impl != "causal"
    res = ts.run_ours(case, cfg, seq_len, batch, ns, args.lr, device, None, timed=True,
                      deadline=deadline,
                      module_kwargs={"attn_impl": impl} if doc else None,
                      data_kwargs={"document_mask": doc, "max_tokens": args.max_tokens})
    res.update(case=case, kernel=impl)
    return res


def plan(cases: list[str], impls: list[str]) -> list[tuple[str, str]]:
    """(case, kernel) in priority order: causal and the first usable kernel of every case, then the others."""
    def usable(case: str) -> list[str]:
        return [i for i in impls if not (case.startswith("dsv3") and i == "varlen")]

    first = [(c, k) for c in cases for k in ["causal", *usable(c)[:1]]]
    return first + [(c, k) for c in cases for k in usable(c)[1:]]


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
        out.append({"case": r["case"], "kernel": r["kernel"], "ratio": ratio, "target": target,
                    "met": target is not None and ratio >= target,
                    "same_first_batch": r.get("first_batch_checksum") == base.get("first_batch_checksum")})
    return out


def table(report: dict[str, Any]) -> str:
    lines = ["", "attention work left by document masking (embedded corpus, byte tokenizer):"]
    lines += [f"  seq {w['seq_len']:>6}: {w['fraction']:.3f} of causal ({w['docs_per_window']:.2f} documents per "
              f"window, {w['windows']} windows)" for w in report["work_fraction"]]
    lines += ["", "kernel checks (loss / gradient vs SDPA):"]
    for c in report["checks"]:
        lines.append(f"  {c['check']:<24} " + (c.get("error") or f"loss {c['loss_rel_err']:.1e}  grad "
                                                 f"{c['grad_rel_err']:.1e}  {'ok' if c['ok'] else 'MISMATCH'}"))
    lines += ["", f"{'case':<12} {'kernel':<8} {'tokens/s':>10} {'step ms':>8} {'peak GiB':>8}  status"]
    for r in report["runs"]:
        if "skipped" in r:
            lines.append(f"{r['case']:<12} {r['kernel']:<8} {'-':>10} {'-':>8} {'-':>8}  {r['skipped']}")
            continue
        tps = r.get("tokens_per_s")
        step = r.get("step_time_mean_s")
        peak = r.get("peak_gib")
        status = r.get("error") or ("ok" if r.get("ok") else "loss not falling")
        if r.get("stopped_by_time_limit_after_steps") is not None:
            status += f" (time limit: {r['stopped_by_time_limit_after_steps']} steps)"
        lines.append(f"{r['case']:<12} {r['kernel']:<8} {tps or 0:>10.0f} {1e3 * (step or 0):>8.1f} "
                     f"{peak if peak is not None else float('nan'):>8.1f}  {status}")
    lines += ["", "document mask / causal tokens/s:"]
    for q in report["ratios"]:
        warn = "" if q["same_first_batch"] else "  WARNING: batches differ"
        lines.append(f"  {q['case']:<12} {q['kernel']:<8} {q['ratio']:.3f}x  (target >= {q['target']}: "
                     f"{'met' if q['met'] else 'NOT met'}){warn}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--impls", default="varlen,flex", help="document-masked kernels (attn_impl), in priority order")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="untimed steps at the start of each run (flex compiles)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--time-limit", type=float, default=330.0, help="seconds for the whole call (0 = none)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap of the packed corpus (default: all 8 MB)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="small models and sequences (CPU smoke test)")
    p.add_argument("--precision", default=None, help="default bf16-true (cuda), 32-true (cpu)")
    p.add_argument("--out", default="bench/results/doc_mask.json")
    args = p.parse_args(argv)
    if args.precision is None:
        args.precision = "bf16-true" if args.device == "cuda" else "32-true"
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    kernels = ("varlen", "flex", "sdpa")
    unknown = [c for c in args.cases if c not in TARGETS] + [i for i in args.impls if i not in kernels]
    if unknown:
        raise ValueError(f"unknown cases or kernels {unknown}; cases: {list(TARGETS)}, kernels: varlen, flex, sdpa")
    if args.steps <= args.warmup:
        raise ValueError("--steps must exceed --warmup (the timed steps come after it)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = ts.pick_device(args.device)
    if device is None:
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report: dict[str, Any] = {"args": vars(args), "env": ts.environment(device), "runs": [], "checks": [],
                              "work_fraction": []}
    deadline = _T_START + args.time_limit - RESERVE_S if args.time_limit else None
    out = Path(args.out)

    def save() -> None:
        report["ratios"] = ratios(report["runs"])
        report["total_wall_s"] = time.perf_counter() - _T_START
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))

    for seq in sorted({case_shape(c, args.small)[0] for c in args.cases}):
        report["work_fraction"].append(work_fraction(seq, args.max_tokens))
    report["checks"] = check_kernels(args.impls, device, args.small)
    save()
    slowest = 0.0
    for case, kernel in plan(args.cases, args.impls):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left < slowest:
            report["runs"].append({"case": case, "kernel": kernel, "skipped": f"time limit ({left:.0f}s left, the "
                                   f"slowest run took {slowest:.0f}s)"})
            continue
        t0 = time.perf_counter()
        try:
            r = run_case(case, kernel, args, device, deadline)
        except Exception as e:  # noqa: BLE001 (reported, the other runs go on)
            r = {"case": case, "kernel": kernel, "error": ts._err(e), "traceback": traceback.format_exc()}
        slowest = max(slowest, time.perf_counter() - t0)
        report["runs"].append(r)
        save()
    text = table(report)
    log(text)
    out.with_suffix(".log").write_text(text + "\n")
    save()
    return 0 if all(c["ok"] for c in report["checks"] if "error" not in c) else 1
