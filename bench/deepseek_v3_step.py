#!/usr/bin/env python
"""DeepSeek-V3-shaped training step on one GPU: lightning_moe vs ``transformers``' DeepseekV3ForCausalLM (issue 13).

One piece (about 670 lines): its numbered phases share one model config, one time budget and one report, and read
top to bottom in the order the call runs them.

One call, one process, one model alive at a time:

0. Measures the bf16 matmul rate (8192^3, the MFU denominator, as ``bench/train_step.py`` does) and the device copy
   bandwidth (a 2 GiB bf16 ``copy_``, CUDA events; bytes read + written / time), the optimizer step's bound.
1. lightning_moe: the ``deepseek_v3`` preset reduced to fit one H200 -- 3 layers (the first dense), 64 routed experts
   top-8 in 8 groups / top-4 groups, one shared expert, MLA with q-LoRA 1536, kv-LoRA 512, 128 heads (8.54B
   parameters) -- batch 2 x 4096 tokens, bf16-true, fused AdamW, through the Lightning Trainer and a one-GPU
   ``MoEParallelStrategy`` (``bench/train_step.py``'s ``run_ours``); once per ``--ours-variants`` entry.
2. ``transformers.DeepseekV3ForCausalLM`` with the same config (``config_to_hf``; sdpa attention, ``grouped_mm``
   experts asked for explicitly, the router kept in fp32 as ``from_pretrained`` keeps it), built in bf16 on the GPU
   from the same seed, in a plain loop with fused AdamW, the same hyper-parameters and batches. It runs right after
   the first variant of ours, so a time limit never drops the comparison.
3. After each model's last step, with its gradients and optimizer state still alive: the fused AdamW step alone,
   timed with CUDA events over ``--opt-reps`` repetitions (median), against its memory-bandwidth bound = bytes moved
   (params + grads + exp_avg + exp_avg_sq read, params + both moments written, in their actual dtypes) / the
   measured copy bandwidth.
4. A table (also written next to ``--out`` as ``.log``) and a JSON file (``--out``).

MFU (model FLOPs; the same numerator for both models): per token, 3 x the forward matmul FLOPs counted from the real
shapes -- MLA's q down- and up-projection (q-LoRA), kv down-projection (latent + shared rope key) and up-projection
(k nope + v per head), output projection; attention QK^T with q/k head dim 192 (128 nope + 64 rope) and PV with v head
dim 128, counted CAUSALLY (S/2 keys per query on average: half the S^2 terms); the router, the top-k routed experts,
the shared expert, the first layer's dense MLP and the LM head. Norms, RoPE, softmax and the embedding lookup are not
counted. The JSON also has ``mfu_noncausal`` (all S keys). Denominator: the measured bf16 matmul rate of this run.

Run (repository root):
    python -m bench deepseek_v3_step --ours-variants auto+compile,auto --profile --out deepseek_v3_step.json
        # H200: about 3-4 minutes (the default --time-limit 420 s caps the call at about 7)
    python -m bench deepseek_v3_step --smoke --profile --out /tmp/ds.json     # CPU smoke test (seconds)
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/deepseek_v3_step.py ...` runs `python -m bench deepseek_v3_step ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import time

_T_START = time.perf_counter()  # the time limit covers the whole call, imports included

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import torch  # noqa: E402

from bench import train_step as ts  # noqa: E402
from bench.core.device import GIB, sync  # noqa: E402
from bench.core.schema import save as save_result  # noqa: E402
from bench.peers.hf import deepseek_v3_model  # noqa: E402

log = ts.log
LABEL = "deepseek-v3-3L-64e"
# after a run is stopped by the time limit: its teardown, the optimizer timing, the table and the JSON
TIME_RESERVE_S = 25.0
PROFILE_STEPS = 3


# ---------------------------------------------------------------------------------------------------- config
def model_config(smoke: bool) -> Any:
    """The reduced ``deepseek_v3`` preset (8.54B parameters), or a tiny one of the same structure for ``--smoke``."""
    from lightning_moe.config import ModelConfig

    if not smoke:
        return ModelConfig.from_preset("deepseek_v3", num_layers=3, moe={"num_experts": 64, "first_k_dense": 1})
    # same features (q-LoRA, YaRN, groups with top_k == 2 * group_topk as transformers needs, a shared expert,
    # first layer dense); sizes multiples of 16 bytes for torch._grouped_mm
    return ModelConfig.from_preset(
        "deepseek_v3", num_layers=3, vocab_size=512, hidden_size=64, num_heads=4, num_kv_heads=4,
        dense_hidden_size=128, max_seq_len=128, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32},
        moe={"num_experts": 16, "top_k": 4, "num_groups": 4, "group_topk": 2, "expert_hidden_size": 32,
             "shared_expert_hidden_size": 32, "first_k_dense": 1},
    )


def step_flops(cfg: Any, seq_len: int) -> dict[str, Any]:
    """Model FLOPs per token of a training step (3 x forward), from the real shapes; see the module docstring."""
    D, H, L, V = cfg.hidden_size, cfg.num_heads, cfg.num_layers, cfg.vocab_size
    m = cfg.moe
    qk, v, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    if cfg.attention != "mla":
        raise ValueError(f"this benchmark counts MLA's matmuls; the config has attention={cfg.attention!r}")
    n_moe = cfg.num_moe_layers
    # multiply-adds per token of each weight matmul (= the weight's elements one token uses)
    macs: dict[str, int] = {}
    if cfg.q_lora_rank is None:
        macs["mla_q_proj"] = L * D * H * qk
    else:
        macs["mla_q_down"] = L * D * cfg.q_lora_rank
        macs["mla_q_up"] = L * cfg.q_lora_rank * H * qk
    macs["mla_kv_down"] = L * D * (cfg.kv_lora_rank + rope)
    macs["mla_kv_up"] = L * cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + v)
    macs["mla_out"] = L * H * v * D
    macs["dense_mlp"] = (L - n_moe) * 3 * D * cfg.dense_hidden_size
    macs["router"] = n_moe * D * m.num_experts
    macs["routed_experts"] = n_moe * m.top_k * 3 * D * m.expert_hidden_size
    macs["shared_expert"] = n_moe * 3 * D * m.shared_expert_hidden_size
    macs["lm_head"] = D * V
    # QK^T over qk dims and PV over v dims for each of H heads, against S keys (all) or S/2 on average (causal)
    attn_full = L * H * (qk + v) * seq_len
    weights = sum(macs.values())
    return {
        "weight_macs_per_token": weights,
        "forward_flops_by_component": {**{k: 2 * x for k, x in macs.items()},
                                       "attention_causal": attn_full, "attention_noncausal": 2 * attn_full},
        "flops_per_token_causal": 3 * 2 * (weights + attn_full / 2),
        "flops_per_token": 3 * 2 * (weights + attn_full),  # non-causal; train_step.timing_summary's "mfu"
        "convention": "3 x forward matmul FLOPs from MLA's real shapes (q/k head dim "
                      f"{qk} = {cfg.qk_nope_head_dim} nope + {rope} rope, v head dim {v}, q/kv LoRA down+up, output "
                      "projection), router, routed experts top-k, shared expert, dense MLP, LM head; attention causal "
                      "(S/2 keys per query)",
    }


def expert_bias_entries(cfg: Any) -> int:
    """Entries that ``ModelConfig.count_params`` counts but both models hold as buffers (the expert bias)."""
    return cfg.moe.num_experts * cfg.num_moe_layers if cfg.moe.expert_bias else 0


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a DTensor's numel is its global size


# ------------------------------------------------------------------------------------------- device timings
def time_fn(fn: Callable[[], Any], reps: int, device: torch.device) -> list[float]:
    """Seconds per call: CUDA events around each call (device time, no host sync between calls) on a GPU,
    ``perf_counter`` on a CPU."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_copy_bandwidth(device: torch.device, reps: int = 20) -> dict[str, Any]:
    """Bytes read + written per second by one large ``copy_`` (2 GiB bf16 on CUDA; 64 MiB on a CPU, a placeholder)."""
    nbytes = 2 * GIB if device.type == "cuda" else 64 * 2**20
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t = statistics.median(time_fn(functools.partial(dst.copy_, src), reps, device))
    del src, dst
    ts.reset_memory(device)
    return {"tensor_bytes": nbytes, "reps": reps, "seconds": t, "bytes_per_s": 2 * nbytes / t}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard: the bytes this device moves


def optimizer_bytes(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Bytes an AdamW step moves: param, grad and every parameter-sized state tensor read; param and states written.
    With an fp32 master (MasterAdamW's ``"master"`` state) the master is read instead of the parameter: a bf16
    parameter moves 2 (grad) + 12 (master, moments) read + 12 + 2 (parameter) written = 28 bytes."""
    read = write = 0
    dtypes: dict[str, int] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            lp, lg = _local(p), _local(p.grad)
            state = opt.state.get(p, {})
            states = [_local(s) for s in state.values() if torch.is_tensor(s) and s.numel() == p.numel()]
            sb = sum(s.numel() * s.element_size() for s in states)
            pb = lp.numel() * lp.element_size()
            read += (0 if "master" in state else pb) + lg.numel() * lg.element_size() + sb
            write += pb + sb
            key = "/".join(str(t.dtype).replace("torch.", "") for t in (lp, lg, *states))
            dtypes[key] = dtypes.get(key, 0) + lp.numel()
    return {"read": read, "written": write, "total": read + write,
            "elements_by_dtypes(param/grad/states)": dtypes}


def time_optimizer_step(opt: torch.optim.Optimizer, device: torch.device, reps: int,
                        copy_bw: Optional[dict]) -> dict[str, Any]:
    """The optimizer step alone (median of ``reps`` after one untimed step), its bytes and its bandwidth bound.
    Parameters change; call it only when training is over."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    missing = [p for p in params if p.grad is None]
    for p in missing:  # a parameter without a gradient is skipped by the step: give it one (values don't matter)
        p.grad = torch.zeros_like(p)
    try:
        opt.step()
        sync(device)
        times = time_fn(opt.step, reps, device)
        moved = optimizer_bytes(opt)
    finally:
        for p in missing:
            p.grad = None
    out: dict[str, Any] = {"optimizer": type(opt).__module__ + "." + type(opt).__name__,
                           "fused": opt.defaults.get("fused"), "reps": reps, "times_s": times,
                           "seconds": statistics.median(times), "grads_filled_with_zeros": len(missing),
                           "bytes": moved}
    if copy_bw:
        out["bound_s"] = moved["total"] / copy_bw["bytes_per_s"]
        out["ratio_to_bound"] = out["seconds"] / out["bound_s"]
    return out


# ------------------------------------------------------------------------------------------------ time limit
class Budget:
    """``--time-limit``: a run starts only when the slowest run so far would still fit, and a started run stops
    stepping at the deadline (its timing then covers fewer steps, which the result says)."""

    def __init__(self, limit_s: float, start: Optional[float] = None, reserve_s: float = TIME_RESERVE_S) -> None:
        self.limit_s = limit_s
        self.slowest_s = 0.0
        self.start = _T_START if start is None else start  # perf_counter() at the start of the call
        self.reserve_s = reserve_s  # kept after the deadline for the last run's teardown and the report

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def deadline(self) -> Optional[float]:
        return None if not self.limit_s else self.start + self.limit_s - self.reserve_s

    def refusal(self, what: str) -> Optional[str]:
        """Why ``what`` must not start (None when it may)."""
        if not self.limit_s:
            return None
        left = self.limit_s - self.reserve_s - self.elapsed()
        if left > self.slowest_s:
            return None
        return (f"skipped {what}: --time-limit {self.limit_s:.0f}s, {self.elapsed():.0f}s used, the slowest run so "
                f"far took {self.slowest_s:.0f}s")

    def ran(self, seconds: float) -> None:
        self.slowest_s = max(self.slowest_s, seconds)


def _past(deadline: Optional[float]) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def skipped(impl: str, reason: str) -> dict[str, Any]:
    log(f"\n{reason}")
    return {"model": LABEL, "impl": impl, "skipped": reason}


# ----------------------------------------------------------------------------------------------------- ours
def ours_guard(deadline: Optional[float], device: torch.device, args: argparse.Namespace,
               copy_bw: Optional[dict], stats: dict[str, Any]) -> Any:
    """A callback: stops fit at the deadline; at the end of fit (the last step's gradients and the optimizer state
    still alive) records the training peak memory and parameter count and times the optimizer step. Keeps no
    reference to the trainer, model or optimizer, so they are freed with the run."""
    import lightning as L

    class Guard(L.Callback):
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if _past(deadline) and not trainer.should_stop:
                stats["stopped_by_time_limit_after_steps"] = trainer.global_step
                log(f"  --time-limit: stopping after {trainer.global_step} steps")
                trainer.should_stop = True

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            stats["peak_gib_training"] = ts.peak_gib(device)
            stats["params"] = count_parameters(pl_module)
            try:
                stats["optimizer_step"] = time_optimizer_step(trainer.optimizers[0], device, args.opt_reps, copy_bw)
            except Exception as e:  # the training numbers still count
                stats["optimizer_step"] = {"error": ts._err(e), "traceback": traceback.format_exc()}

    return Guard()


def profile_window(args: argparse.Namespace) -> tuple[int, int]:
    """(first profiled step, number of profiled steps): the last steps, so that the timed ones run unprofiled."""
    n = min(PROFILE_STEPS, args.steps - args.warmup - 1)
    return args.steps - n, n


def run_ours(cfg: Any, variant: str, args: argparse.Namespace, device: torch.device, peak: Optional[dict],
             copy_bw: Optional[dict], fpt: dict, deadline: Optional[float], profile: bool) -> dict[str, Any]:
    """``bench/train_step.py``'s ``run_ours`` (Lightning Trainer, one-GPU ``MoEParallelStrategy``) with this
    benchmark's callbacks; timing over the unprofiled steps after the warmup."""
    from lightning_moe.strategies import MoEParallelStrategy

    stats: dict[str, Any] = {}
    callbacks = [ours_guard(deadline, device, args, copy_bw, stats)]
    timed_end, prof = args.steps, None
    if profile:
        start, n = profile_window(args)
        timed_end = start
        prof = ts.step_profiler(start, n, Path(args.out).with_suffix(".trace.json"))
        callbacks.append(prof)
    ns = argparse.Namespace(steps=args.steps, warmup=args.warmup, precision=args.precision, out=args.out,
                            profile=False, loss_impl="auto")  # profiling is ours to place (the last steps)
    res = ts.run_ours(LABEL, cfg, args.seq_len, args.batch_size, ns, args.lr, device, peak, timed=False,
                      strategy=MoEParallelStrategy(), extra_callbacks=tuple(callbacks), variant=variant)
    if prof is not None:
        prof.finish()  # stopped inside the window: close the profiler anyway
        res["profile_top"] = prof.table
    res.update(stats)
    if stats.get("peak_gib_training") is not None:
        res["peak_gib"] = stats["peak_gib_training"]  # not the optimizer timing's
    res["timed"] = True
    res["flops"] = fpt
    res.update(ts.timing_summary(res["step_times_s"][:timed_end], args.warmup, args.batch_size * args.seq_len,
                                 fpt, peak))
    log(summary_line(res))
    return res


# ------------------------------------------------------------------------------------------------ transformers
def _hf_impls(model: Any) -> tuple[str, str]:
    c = model.config
    return str(getattr(c, "_experts_implementation", "?")), str(getattr(c, "_attn_implementation", "?"))


def hf_loop(model: Any, opt: Any, sched: Any, args: argparse.Namespace, device: torch.device,
            deadline: Optional[float], res: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Plain PyTorch steps on the Lightning run's batches (same data module, same order); the last step's gradients
    are kept for the optimizer timing."""
    from lightning_moe.data import TextDataModule

    dm = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = ts.cycle(loader)
    losses: list[float] = []
    times: list[float] = []
    for step in range(args.steps):
        if step and _past(deadline):
            res["stopped_by_time_limit_after_steps"] = step
            log(f"  --time-limit: stopping after {step} steps")
            break
        batch = next(it)
        if step == 0:
            res["first_batch_checksum"] = int(batch["input_ids"].sum())
        ids = batch["input_ids"].to(device, non_blocking=True)
        sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)  # before the forward (as train_step.py's loop, after its step)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        sched.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(out.loss.detach()))  # DeepseekV3ForCausalLM adds no aux loss: the LM loss
        res["aux_loss_returned"] = getattr(out, "aux_loss", None) is not None
        del out
        if step in (0, args.steps - 1) or args.steps <= 10:
            log(f"  step {step}: loss {losses[-1]:.4f} ({times[-1]:.3f}s)")
    return losses, times


def run_hf(cfg: Any, args: argparse.Namespace, device: torch.device, peak: Optional[dict],
           copy_bw: Optional[dict], fpt: dict, deadline: Optional[float]) -> dict[str, Any]:
    try:
        import transformers
        from transformers import DeepseekV3ForCausalLM  # noqa: F401
    except ImportError as e:
        return skipped("hf DeepseekV3ForCausalLM", f"skipped transformers: it cannot be imported ({ts._err(e)})")
    res: dict[str, Any] = {"model": LABEL, "impl": "hf", "transformers": transformers.__version__,
                           "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps, "lr": args.lr}
    log(f"\n=== {LABEL}: transformers {transformers.__version__} DeepseekV3ForCausalLM, {args.steps} steps ===")
    losses: list[float] = []
    times: list[float] = []
    model = opt = sched = None
    t_start = time.perf_counter()
    torch.manual_seed(0)  # the seed ours uses (weights differ: other init order and layouts)
    ts.reset_memory(device)
    try:
        dtype = torch.bfloat16 if "bf16" in args.precision else torch.float32
        model = deepseek_v3_model(cfg, device, dtype)
        experts, attn = _hf_impls(model)
        if experts != "grouped_mm" and hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("grouped_mm")  # the config kwarg was not honoured: ask the model
            experts, attn = _hf_impls(model)
        res.update(build_s=time.perf_counter() - t_start, experts_impl=experts, attn_impl=attn,
                   impl=f"hf {experts} ({attn})", params=count_parameters(model),
                   fp32_params=sum(p.numel() for p in model.parameters() if p.dtype == torch.float32))
        if experts != "grouped_mm":
            raise RuntimeError(f"transformers chose the {experts!r} experts implementation, not grouped_mm")
        log(f"built in {res['build_s']:.1f}s: {res['params']:,} parameters, experts={experts}, attn={attn}")
        opt, sched = ts.hf_optimizer(model, args.lr, args.steps, device)
        losses, times = hf_loop(model, opt, sched, args, device, deadline, res)
        res["peak_gib"] = ts.peak_gib(device)  # before the optimizer timing
        try:
            res["optimizer_step"] = time_optimizer_step(opt, device, args.opt_reps, copy_bw)
        except Exception as e:
            res["optimizer_step"] = {"error": ts._err(e), "traceback": traceback.format_exc()}
    except Exception as e:  # report, don't crash: the table still comes
        res["error"] = ts._err(e)
        res["traceback"] = traceback.format_exc()
        log(res["traceback"])
        res.setdefault("peak_gib", ts.peak_gib(device))
    res.update(wall_s=time.perf_counter() - t_start, losses=losses, step_times_s=times, flops=fpt)
    res.update(ts.loss_checks(losses))
    if "error" in res:
        res["ok"] = False
    if losses:
        res["loss_first"], res["loss_last"] = losses[0], losses[-1]
    res.update(ts.timing_summary(times, args.warmup, args.batch_size * args.seq_len, fpt, peak))
    release(model, opt)
    del model, opt, sched
    ts.reset_memory(device)
    res["allocated_after_free_gib"] = ts.allocated_gib(device)
    log(summary_line(res))
    return res


def release(model: Any, opt: Any) -> None:
    """Frees the model's and optimizer's device memory even if something still holds the objects (a hook, a cache):
    train_step.py's transformers run once left 31 GiB allocated after its ``del``, and the runs after this one need
    the whole GPU."""
    if opt is not None:
        opt.state.clear()
    if model is not None:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.grad = None
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)


# ---------------------------------------------------------------------------------------------------- report
def summary_line(r: dict[str, Any]) -> str:
    o = r.get("optimizer_step") or {}
    s = (f"[{r['impl']}] tokens/s {ts._fmt(r.get('tokens_per_s'), ',.0f')}  MFU {ts._fmt(r.get('mfu_causal'), '.1%')}"
         f"  peak {ts._fmt(r.get('peak_gib'), '.2f')} GiB  loss {ts._fmt(r.get('loss_first'), '.4f')} -> "
         f"{ts._fmt(r.get('loss_last'), '.4f')}  optimizer step {_ms(o.get('seconds'))} ms "
         f"(bound {_ms(o.get('bound_s'))} ms, {ts._fmt(o.get('ratio_to_bound'), '.2f')}x)  ok={r.get('ok')}")
    return s + (f"  ERROR {r['error']}" if r.get("error") else "")


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{1e3 * s:.1f}"


def _status(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return "skipped"
    if r.get("error"):
        return "FAIL: " + r["error"][:100]
    cut = " (time limit: fewer steps)" if r.get("stopped_by_time_limit_after_steps") else ""
    return ("yes" if r.get("ok") else "NO (" + ts._why(r) + ")") + cut


def table(runs: list[dict[str, Any]]) -> str:
    head = ["impl", "params", "tokens/s", "MFU (causal)", "peak GiB", "loss first -> last", "opt step ms",
            "bound ms", "opt / bound", "ok"]
    rows = []
    for r in runs:
        o = r.get("optimizer_step") or {}
        rows.append([
            r["impl"], ts._fmt(r.get("params"), ","), ts._fmt(r.get("tokens_per_s"), ",.0f"),
            ts._fmt(r.get("mfu_causal"), ".1%"), ts._fmt(r.get("peak_gib"), ".1f"),
            f"{ts._fmt(r.get('loss_first'), '.3f')} -> {ts._fmt(r.get('loss_last'), '.3f')}",
            _ms(o.get("seconds")), _ms(o.get("bound_s")), ts._fmt(o.get("ratio_to_bound"), ".2f"), _status(r),
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def compare(cfg: Any, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Speed and memory ratios (ours / transformers) and the parameter counts with their difference explained."""
    ratios = ts.ratios(runs)
    peaks = {r["impl"]: r.get("peak_gib") for r in runs}
    for q in ratios:
        if peaks.get(q["ours"]) and peaks.get(q["hf"]):
            q["peak_memory_ratio"] = peaks[q["ours"]] / peaks[q["hf"]]
    ours = next((r["params"] for r in runs if r["impl"].startswith("lightning_moe") and r.get("params")), None)
    hf = next((r["params"] for r in runs if r["impl"].startswith("hf") and r.get("params")), None)
    total, bias = cfg.count_params()["total"], expert_bias_entries(cfg)
    params = {"config_count_params": total, "expert_bias_buffer_entries": bias, "ours": ours, "hf": hf,
              "hf_minus_ours": None if ours is None or hf is None else hf - ours}
    return {"ratios": ratios, "params": params}


def report_text(report: dict[str, Any], runs: list[dict[str, Any]], budget: Budget) -> str:
    peak, bw, fpt = report.get("matmul_peak"), report.get("copy_bandwidth"), report["flops"]
    p = report["comparison"]["params"]
    lines = [f"{LABEL}: batch {report['args']['batch_size']} x {report['args']['seq_len']} tokens per step, "
             f"precision {report['args']['precision']}, device {report['env'].get('gpu', report['env']['device'])}"]
    if peak:
        lines.append(f"MFU denominator: measured {peak['n']}^3 {peak['dtype']} matmul rate "
                     f"{peak['flops_per_s'] / 1e12:.1f} TFLOP/s")
    lines.append(f"MFU numerator: {fpt['flops_per_token_causal'] / 1e9:.2f} GFLOP/token = {fpt['convention']}; "
                 f"non-causal attention would give {fpt['flops_per_token'] / 1e9:.2f} (JSON: mfu_noncausal)")
    if bw:
        lines.append(f"optimizer bound: bytes moved (params + grads + exp_avg + exp_avg_sq read, params + both "
                     f"moments written, actual dtypes; with fp32 masters the master read instead of the parameter and "
                     f"written too) / measured copy bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s (read + write of a "
                     f"{bw['tensor_bytes'] / GIB:.2f} GiB copy); target opt / bound <= 1.3 (bf16 AdamW), <= 1.25 "
                     f"(+master)")
    lines.append(f"parameters: ours {ts._fmt(p['ours'], ',')}, transformers {ts._fmt(p['hf'], ',')} (difference "
                 f"{ts._fmt(p['hf_minus_ours'], ',')}); ModelConfig.count_params() = {p['config_count_params']:,} also "
                 f"counts the {p['expert_bias_buffer_entries']} expert-bias entries that both models keep as buffers "
                 f"(expert_bias / e_score_correction_bias), not parameters")
    lines += ["", table(runs), ""]
    lines += [r["skipped"] for r in runs if r.get("skipped")]
    for q in report["comparison"]["ratios"]:
        lines.append(f"ours / transformers: tokens/s {q['tokens_per_s_ratio']:.2f}x, peak memory "
                     f"{ts._fmt(q.get('peak_memory_ratio'), '.2f')}x  [{q['ours']} vs {q['hf']}]"
                     + ("" if q["same_first_batch"] else "  (WARNING: different first batches)"))
    lines.append(f"total wall time {budget.elapsed():.0f}s (--time-limit {budget.limit_s:.0f}s); "
                 f"JSON {report['args']['out']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per model (default 20; 2 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps at the start (default 5; 0 with --smoke)")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (64 with --smoke)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=None, help="default 3e-4 (3e-3 with --smoke)")
    p.add_argument("--precision", default=None, help="Lightning precision; default bf16-true (cuda), 32-true (cpu)")
    p.add_argument("--ours-variants", default="",
                   help="comma list of lightning_moe runs, each a loss_impl (auto, torch, chunked, liger) optionally "
                        "with +compile and/or +master (fp32 master weights and moments, MasterAdamW), e.g. "
                        "'auto+compile,auto+compile+master'; default: one run with loss_impl=auto")
    p.add_argument("--opt-reps", type=int, default=5, help="timed repetitions of the optimizer step alone")
    p.add_argument("--profile", action="store_true",
                   help=f"torch.profiler over the last {PROFILE_STEPS} steps of the first lightning_moe run (not timed)"
                        ": top kernels table + a Chrome trace next to --out")
    p.add_argument("--time-limit", type=float, default=420.0,
                   help="seconds for the whole call (0 = none): later runs are skipped, a running one stops stepping")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default cuda (cpu with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU test of every code path: a tiny config of the same structure, 2 steps")
    p.add_argument("--out", default="bench/results/deepseek_v3_step.json")
    args = p.parse_args(argv)
    fill_defaults(args)
    check_args(args)
    return args


def fill_defaults(args: argparse.Namespace) -> None:
    smoke = args.smoke
    for name, full, small in (("steps", 20, 2), ("warmup", 5, 0), ("seq_len", 4096, 64), ("lr", 3e-4, 3e-3),
                              ("device", "cuda", "cpu")):
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else full)
    if args.precision is None:
        args.precision = "bf16-true" if args.device == "cuda" else "32-true"


def variants(args: argparse.Namespace) -> list[str]:
    return [v.strip() for v in args.ours_variants.split(",") if v.strip()] or [""]


def check_args(args: argparse.Namespace) -> None:
    """User errors as ValueError, before anything is built."""
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 1:
        raise ValueError("--steps, --batch-size and --seq-len must be positive")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup {args.warmup} must be in [0, --steps {args.steps}): no step would be timed")
    if args.profile and args.steps < args.warmup + 2:
        raise ValueError(f"--profile needs --steps >= --warmup + 2 (profiled steps are not timed), got --steps "
                         f"{args.steps} --warmup {args.warmup}")
    if args.opt_reps < 1:
        raise ValueError(f"--opt-reps must be >= 1, got {args.opt_reps}")
    if args.time_limit < 0:
        raise ValueError(f"--time-limit must be >= 0 (0 = none), got {args.time_limit}")
    if args.skip_hf and args.skip_ours:
        raise ValueError("--skip-hf and --skip-ours together leave nothing to run")
    for v in variants(args):
        ts.parse_variant(v)  # ValueError naming the accepted loss_impls and suffixes


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(kind, variant) in run order: the peer right after the first variant of ours, so a time limit that stops
    later variants keeps the comparison."""
    ours = [] if args.skip_ours else [("ours", v) for v in variants(args)]
    hf = [] if args.skip_hf else [("hf", "grouped_mm")]
    return ours[:1] + hf + ours[1:]


def measure_device(device: torch.device, report: dict[str, Any]) -> tuple[Optional[dict], Optional[dict]]:
    """The MFU denominator and the copy bandwidth, each None (and reported) when its measurement fails."""
    out = []
    for key, fn in (("matmul_peak", ts.measure_matmul_peak), ("copy_bandwidth", measure_copy_bandwidth)):
        try:
            out.append(fn(device))
        except Exception as e:
            report[key + "_error"] = ts._err(e)
            log(f"{key} measurement failed: {ts._err(e)}")
            out.append(None)
        report[key] = out[-1]
    peak, bw = out
    if peak:
        log(f"matmul peak: {peak['n']}^3 {peak['dtype']}: {peak['flops_per_s'] / 1e12:.1f} TFLOP/s")
    if bw:
        log(f"copy bandwidth: {bw['bytes_per_s'] / 1e12:.3f} TB/s (read + write)")
    return peak, bw


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cfg = model_config(args.smoke)
    if args.seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the config's max_seq_len {cfg.max_seq_len}")
    device = ts.pick_device(args.device)
    if device is None:
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    budget = Budget(args.time_limit)
    fpt = step_flops(cfg, args.seq_len)
    report: dict[str, Any] = {"args": vars(args), "env": ts.environment(device), "config": dataclasses.asdict(cfg),
                              "flops": fpt, "runs": []}
    log(json.dumps(report["env"]))
    log(f"{LABEL}: {cfg.count_params()['total'] / 1e9:.3f}B parameters (ModelConfig), "
        f"{fpt['flops_per_token_causal'] / 1e9:.2f} GFLOP/token (causal)")
    peak, bw = measure_device(device, report)
    runs: list[dict[str, Any]] = report["runs"]
    out = Path(args.out)

    def save(text: Optional[str] = None) -> None:
        report["comparison"] = compare(cfg, runs)
        report["total_wall_s"] = budget.elapsed()
        out.parent.mkdir(parents=True, exist_ok=True)
        if text is not None:
            report["table"] = text
            out.with_suffix(".log").write_text(text + "\n")
        save_result(out, report, "deepseek_v3_step")

    profiled = False
    for kind, variant in plan(args):
        what = f"lightning_moe [{variant or 'auto'}]" if kind == "ours" else "transformers"
        reason = budget.refusal(what)
        if reason:
            runs.append(skipped("lightning_moe" if kind == "ours" else "hf", reason))
            continue
        t0 = time.perf_counter()
        if kind == "ours":
            r = run_ours(cfg, variant, args, device, peak, bw, fpt, budget.deadline(), args.profile and not profiled)
            profiled = True
        else:
            r = run_hf(cfg, args, device, peak, bw, fpt, budget.deadline())
        budget.ran(time.perf_counter() - t0)
        r["mfu_noncausal"] = r.pop("mfu", None)  # train_step's "mfu" key is its non-causal count
        runs.append(r)
        save()

    save()
    text = report_text(report, runs, budget)
    save(text)
    log("\n" + "=" * 100 + "\n" + text)
    ran = [r for r in runs if not r.get("skipped")]
    return 0 if ran and all(r.get("ok") for r in ran) else 1
