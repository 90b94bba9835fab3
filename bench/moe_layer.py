#!/usr/bin/env python
"""MoE layer forward + backward on one device: lightning_moe vs the bare grouped GEMM, transformers and torchtitan.

One piece (about 690 lines): every implementation is timed by the same step on the same x, dy and weights, and the
table's ratios mean something only with that shared setup beside them.

DESIGN "Benchmarks" / issue 10. Every implementation is measured in the same process, on the same input ``x``
[1, T, D] and the same output gradient ``dy`` (fixed random, bf16 on CUDA), with the same expert weights where it
can be arranged (our layer's weights are copied into the peers), one model alive at a time. A step is
``y = layer(x); y.backward(dy)`` with every gradient set to None first; ``--warmup`` untimed steps, then
``--iters`` timed ones (CUDA events around each step; perf_counter on CPU); the median is reported.

Per shape (``--shapes``, all three by default):

``ours_learned``   ``lightning_moe.moe.layer.MoELayer`` of the preset's MoE config, bf16 (the router weight and
                   expert bias stay fp32, as in the model after ``.to(bfloat16)``), routing as initialised
                   (``--router-steps`` SGD steps on the router first, default 0).
``ours_rows_kept`` ours_learned re-planned with ``regather_rows=False, weights_applied_by="combine"``: the
                   dispatcher's row copy kept for the backward and the combine weights applied in the combine (the
                   layer before 2026-12-01).
``ours_forced``    the same layer with ``MoEConfig.force_balance`` (round-robin assignment).
``ours_compiled``  ours_learned with the router and shared experts compiled (``MoEParallelStrategy(compile=True)``), CUDA only.
``bare``           only the GEMMs of the routed expert work, through autograd on ``torch._grouped_mm``: gate, up and
                   down projections on rows already grouped by expert (3 grouped GEMMs forward; 6 backward:
                   dx for gate and up, dh for down, and the three weight gradients), with the per-expert counts our
                   layer produced on this input (its routing record's ``tokens_per_expert``), our layer's weights, no
                   SwiGLU, no routing, no permutation. ``bare_balanced``: the same with equal counts.
                   With shared experts (DeepSeek-V3): ``bare_shared`` (the shared expert's 3 + 6 dense GEMMs) and
                   ``bare_routed+shared`` (both in one step), the denominator of the DeepSeek-V3 target.
``experts_only``   our ``GroupedExperts`` (grouped GEMMs + SwiGLU, autograd) on the same grouped rows: splits the
                   gap to bare into "inside the experts" and "routing + permutation + combine".
``hf_<impl>``      the transformers block of the same shape (Qwen3MoeSparseMoeBlock / DeepseekV3MoE /
                   MixtralSparseMoeBlock), built from ``lightning_moe.models.hf.config_to_hf`` of the same config,
                   our weights copied in, dtypes as the transformers model keeps them (DeepSeek-V3's gate and
                   correction bias fp32), once per experts implementation (``--hf-impls``; "eager" is the per-expert
                   loop, "grouped_mm" what transformers 5 models pick by default).
``torchtitan``     ``torchtitan.models.common.moe.MoE`` of the same shape (our weights copied in, bf16; its router
                   gate is bf16 too, since the module is not under FSDP mixed precision); ``torchtitan_forced`` with
                   its ``_debug_force_load_balance``. "unavailable: <reason>" when it does not import.

Numerics (``ours`` section of the JSON): on the first ``--check-tokens`` tokens, our layer as benchmarked (bf16,
grouped GEMM) and the same weights in fp32 through the grouped GEMM, each against the fp32 per-expert loop
(``GroupedExperts.forward_loop``), output and input gradient: max |diff| / max |reference|. Each peer's output on
the full input is compared with ours (same weights; a routing tie or a bf16 router moves a few tokens).

Targets (issue 10) printed next to the ratios: qwen3 <= 1.25x bare, deepseek_v3 <= 1.15x bare routed+shared,
mixtral <= 1.05x bare; learned / forced <= 1.1.

Run (repository root; torchtitan optional):
    python -m bench moe_layer --out bench/results/moe_layer_h200.json          # H200: well under 4 minutes
    python -m bench moe_layer --shapes qwen3 --profile --out /tmp/moe.json     # + top-20 kernels and a trace
    python -m bench moe_layer --device cpu --small                              # smoke test of every section
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/moe_layer.py ...` runs `python -m bench moe_layer ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import dataclasses
import importlib
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from bench.core.device import building, reset_memory, sync
from bench.core.env import environment
from bench.core.schema import save as save_result
from bench.core.text import err as _err, fmt as _fmt, log, md_table
from bench.core.timer import time_steps
from bench.peers import hf as hf_peer, torchtitan as titan_peer

DEFAULT_OUT = "bench/results/moe_layer.json"

# name -> preset, transformers model_type, tokens, the ratio the target is on, the target
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": dict(preset="qwen3_moe_30b_a3b", hf="qwen3_moe", tokens=16384, denom="bare", target=1.25),
    "deepseek_v3": dict(preset="deepseek_v3", hf="deepseek_v3", tokens=8192, denom="bare_routed+shared",
                        target=1.15),
    "mixtral": dict(preset="mixtral_8x7b", hf="mixtral", tokens=8192, denom="bare", target=1.05),
}
FORCED_TARGET = 1.1
# --small: the same routing features at toy sizes (D and F multiples of 16 bytes so the grouped GEMM runs)
SMALL: dict[str, dict[str, Any]] = {
    "qwen3": dict(hidden_size=256, moe={"num_experts": 16, "top_k": 4, "expert_hidden_size": 128}),
    "deepseek_v3": dict(hidden_size=256, moe={"num_experts": 16, "top_k": 4, "expert_hidden_size": 64,
                                              "num_groups": 4, "group_topk": 2, "shared_expert_hidden_size": 64}),
    "mixtral": dict(hidden_size=256, moe={"num_experts": 4, "top_k": 2, "expert_hidden_size": 256}),
}
SMALL_TOKENS = 256


def guarded(res: dict[str, Any], fn: Callable[[], None]) -> None:
    """Run ``fn``; an exception is recorded in ``res`` (error + traceback) instead of stopping the benchmark."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report, don't crash: the other sections still run
        res["error"] = _err(e)
        res["traceback"] = traceback.format_exc()
        log(res["traceback"])


def clear_grads(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.grad = None


def fwd_bwd_step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One forward + backward of ``module`` against the output gradient ``dy``. Our MoE layer gets a fresh
    ``MoERecorder`` each forward, as in a training step (the model passes one): its routing record (counts, entropy,
    losses) is part of the layer's time; the aux / z losses are not added to the objective (the peers have none)."""
    from lightning_moe.moe.layer import MoELayer
    from lightning_moe.moe.record import MoERecorder

    params = [p for p in module.parameters() if p.requires_grad]
    record = isinstance(module, MoELayer)

    def step() -> torch.Tensor:
        clear_grads(x, *params)
        y = module(x, recorder=MoERecorder()) if record else module(x)
        y.backward(dy)
        return y

    return step


# ------------------------------------------------------------------------------------------------ our layer
def model_config(name: str, small: bool) -> Any:
    from lightning_moe.config import ModelConfig

    return ModelConfig.from_preset(SHAPES[name]["preset"], **(SMALL[name] if small else {}))


def build_ours(cfg: Any, device: torch.device, dtype: torch.dtype, seed: int,
               router_state: Optional[dict[str, torch.Tensor]] = None) -> Any:
    """Our layer, initialised on the device from ``seed`` (the same weights every call), then cast as the model
    casts it (``.to(dtype)``: the router keeps fp32)."""
    from lightning_moe.moe.layer import MoELayer

    torch.manual_seed(seed)
    with building(device, dtype):
        layer = MoELayer(cfg.moe, cfg.hidden_size, init_std=cfg.init_std)
    layer.to(device=device, dtype=dtype)
    if router_state is not None:
        layer.router.load_state_dict(router_state, strict=False)
    return layer.train()


def routing_summary(counts: torch.Tensor) -> dict[str, Any]:
    c = counts.detach().float().cpu()
    mean = float(c.mean())
    return {"tokens_per_expert_max": int(c.max()), "tokens_per_expert_min": int(c.min()),
            "tokens_per_expert_mean": mean, "max_over_mean": float(c.max()) / mean if mean else None,
            "empty_experts": int((c == 0).sum())}


def train_router(layer: Any, x: torch.Tensor, steps: int, lr: float) -> list[dict[str, Any]]:
    """``steps`` SGD steps on the router weight only (loss: mean(y * dy') + the layer's aux and z losses, a fresh
    random dy' each step), with the expert-bias update of aux-loss-free balancing after each."""
    from lightning_moe.moe.record import MoERecorder

    hist = []
    opt = torch.optim.SGD([layer.router.weight], lr=lr)
    gen = torch.Generator(device=x.device).manual_seed(1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        recorder = MoERecorder()
        y = layer(x, recorder=recorder)
        rec = recorder.records[0]
        d = torch.randn(y.shape, device=y.device, dtype=torch.float32, generator=gen)
        loss = (y.float() * d).mean() + rec.aux_loss + rec.z_loss
        loss.backward()
        opt.step()
        if rec.routing.bias_demand is not None:
            layer.router.update_expert_bias(rec.routing.bias_demand)
        hist.append({"loss": float(loss), **routing_summary(rec.routing.tokens_per_expert)})
        for p in layer.parameters():
            p.grad = None
    return hist


def numerics_check(layer: Any, cfg: Any, x: torch.Tensor, dy: torch.Tensor, n: int) -> dict[str, Any]:
    """Fast path vs the fp32 per-expert loop of the same weights on the first ``n`` tokens: max |diff| / max |ref|
    of the output and of dx (the routing is the same: the router computes in fp32 from the same x)."""
    from lightning_moe.moe.layer import MoELayer

    n = min(n, x.shape[1])
    xs = x[:, :n].detach()
    dys = dy[:, :n]
    with torch.device("meta"):
        ref = MoELayer(cfg.moe, cfg.hidden_size, init_std=cfg.init_std)
    ref = ref.to_empty(device=x.device).float()
    ref.load_state_dict(layer.state_dict())
    ref.train()
    for p in ref.parameters():
        p.requires_grad_(False)

    def run(mod: Any, xin: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xin = xin.detach().clone().requires_grad_(True)
        y = mod(xin)
        y.backward(g)
        return y.detach().float(), xin.grad.detach().float()

    def rel(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
        d = (a - b).abs().max().item()
        return {"max_abs_diff": d, "max_abs_ref": b.abs().max().item(), "rel": d / max(b.abs().max().item(), 1e-30)}

    ref.experts.use_grouped_mm = False
    y_ref, dx_ref = run(ref, xs.float(), dys.float())
    y_fast, dx_fast = run(layer, xs, dys)
    ref.experts.use_grouped_mm = True
    y_f32, dx_f32 = run(ref, xs.float(), dys.float())
    out = {"tokens": n, "reference": "fp32 GroupedExperts.forward_loop (per-expert matmuls), same weights",
           "bench_dtype_fast_vs_fp32_loop": {"y": rel(y_fast, y_ref), "dx": rel(dx_fast, dx_ref)},
           "fp32_fast_vs_fp32_loop": {"y": rel(y_f32, y_ref), "dx": rel(dx_f32, dx_ref)},
           "fp32_fast_fell_back_to_loop": bool(getattr(ref.experts, "_warned_fallback", False))}
    tol = 5e-2 if x.dtype in (torch.bfloat16, torch.float16) else 1e-4
    out["tolerance_bench_dtype"], out["tolerance_fp32"] = tol, 1e-4
    out["ok"] = bool(max(out["bench_dtype_fast_vs_fp32_loop"]["y"]["rel"], out["bench_dtype_fast_vs_fp32_loop"]["dx"]["rel"]) < tol
                     and max(out["fp32_fast_vs_fp32_loop"]["y"]["rel"], out["fp32_fast_vs_fp32_loop"]["dx"]["rel"]) < 1e-4)
    del ref
    return out


def profile_layer(step: Callable[[], Any], device: torch.device, trace_path: Path, iters: int = 3) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()  # one untimed step outside the profiler
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        sync(device)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20)


# ------------------------------------------------------------------------------------------------ bare GEMMs
def balanced_counts(rows: int, num_experts: int, device: torch.device) -> torch.Tensor:
    c = torch.full((num_experts,), rows // num_experts, dtype=torch.int64)
    c[: rows % num_experts] += 1
    return c.to(device)


def bare_step(experts: Any, counts: Optional[torch.Tensor], shared: Any, T: int, device: torch.device,
              dtype: torch.dtype, seed: int) -> Callable[[], None]:
    """Autograd over the GEMMs only, on leaves (the rows, the SwiGLU hidden h) so no elementwise op runs: per
    projection one forward GEMM and two backward GEMMs (input and weight gradient); gate and up take separate
    copies of the rows, so dx needs no accumulation. ``counts`` None: no routed part; ``shared``: also the shared
    expert's dense GEMMs on T tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, device=device, dtype=dtype, generator=gen)
        return t.requires_grad_(grad)

    parts: list[Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]]] = []
    leaves: list[torch.Tensor] = []
    if counts is not None:
        w1, w2, w3 = experts.w1, experts.w2, experts.w3
        R, D, Fh = int(counts.sum()), w1.shape[2], w1.shape[1]
        offs = torch.cumsum(counts.to(device), 0, dtype=torch.int32)
        xg, xu, h = rnd(R, D, grad=True), rnd(R, D, grad=True), rnd(R, Fh, grad=True)
        dg, du, dy = rnd(R, Fh), rnd(R, Fh), rnd(R, D)
        leaves += [w1, w2, w3, xg, xu, h]

        def routed() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            g = torch._grouped_mm(xg, w1.transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(xu, w3.transpose(-2, -1), offs=offs)
            y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
            return [g, u, y], [dg, du, dy]

        parts.append(routed)
    if shared is not None:
        s1, s2, s3 = shared.w1.weight, shared.w2.weight, shared.w3.weight
        D, Fs = s1.shape[1], s1.shape[0]
        sxg, sxu, sh = rnd(T, D, grad=True), rnd(T, D, grad=True), rnd(T, Fs, grad=True)
        sdg, sdu, sdy = rnd(T, Fs), rnd(T, Fs), rnd(T, D)
        leaves += [s1, s2, s3, sxg, sxu, sh]

        def dense() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            return [F.linear(sxg, s1), F.linear(sxu, s3), F.linear(sh, s2)], [sdg, sdu, sdy]

        parts.append(dense)

    def step() -> None:
        clear_grads(*leaves)
        outs, grads = [], []
        for part in parts:
            o, g = part()
            outs += o
            grads += g
        torch.autograd.backward(outs, grads)

    return step


def experts_only_step(experts: Any, counts: torch.Tensor, device: torch.device, dtype: torch.dtype,
                      seed: int) -> Callable[[], None]:
    """Our GroupedExperts (grouped GEMMs + SwiGLU, its autograd) on rows already grouped by expert."""
    gen = torch.Generator(device=device).manual_seed(seed)
    R = int(counts.sum())
    x = torch.randn(R, experts.dim, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    dy = torch.randn(R, experts.dim, device=device, dtype=dtype, generator=gen)
    params = list(experts.parameters())

    def step() -> None:
        clear_grads(x, *params)
        experts(x, counts).backward(dy)

    return step


def output_diff(y: torch.Tensor, y_ours: torch.Tensor) -> dict[str, float]:
    d = (y.detach().float() - y_ours.float()).abs()
    row = d.reshape(-1, d.shape[-1]).amax(-1)
    scale = max(y_ours.float().abs().max().item(), 1e-30)
    return {"max_abs_diff": d.max().item(), "rel": d.max().item() / scale,
            "tokens_differing_gt_1pct": float((row > 1e-2 * scale).float().mean().item())}


# ------------------------------------------------------------------------------------------------ one shape
def run_shape(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
              save: Callable[[], None], rep: dict[str, Any]) -> None:
    from lightning_moe.moe.record import MoERecorder

    spec = SHAPES[name]
    runs: dict[str, dict[str, Any]] = rep.setdefault("runs", {})
    cfg = model_config(name, args.small)
    T = args.tokens or (SMALL_TOKENS if args.small else spec["tokens"])
    m = cfg.moe
    rep.update({"preset": spec["preset"], "tokens": T, "hidden_size": cfg.hidden_size, "moe": dataclasses.asdict(m),
                "target": {"ratio": f"ours_learned / {spec['denom']}", "max": spec["target"]}})
    log(f"\n=== {name}: D {cfg.hidden_size}, F {m.expert_hidden_size}, {m.num_experts} experts top-{m.top_k}"
        f"{', shared F ' + str(m.shared_expert_hidden_size) if m.shared_expert_hidden_size else ''}, T {T}, {dtype} ===")
    seed = args.seed
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    dy = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, generator=gen)

    def record(key: str, res: dict[str, Any]) -> None:
        runs[key] = res
        log(_line(name, key, res))
        save()

    # ---- ours: learned, forced, numerics, then the bare GEMMs with our weights and counts
    reset_memory(device)
    layer = None
    counts = None
    y_ours = None
    router_state = None
    st: dict[str, Any] = {"impl": "lightning_moe MoELayer"}

    def build() -> None:
        nonlocal layer
        if not hasattr(m, "force_balance"):
            rep["force_balance"] = "unavailable: MoEConfig has no force_balance field"
        layer = build_ours(cfg, device, dtype, seed)
        st["experts_class"] = type(layer.experts).__name__
        st["use_grouped_mm"] = bool(getattr(layer.experts, "use_grouped_mm", False))
        st["router_weight_dtype"] = str(layer.router.weight.dtype).replace("torch.", "")
        st["expert_weight_dtype"] = str(layer.experts.w1.dtype).replace("torch.", "")
        st["params"] = sum(p.numel() for p in layer.parameters())
        st["router_steps"] = args.router_steps
        if args.router_steps:
            st["router_training"] = train_router(layer, x.detach(), args.router_steps, args.router_lr)

    guarded(st, build)
    rep["ours"] = st
    if layer is None:
        record("ours_learned", {"error": st.get("error", "build failed")})
        return

    res: dict[str, Any] = {}

    def learned() -> None:
        nonlocal counts, y_ours
        recorder = MoERecorder()
        with torch.no_grad():  # the timed steps route the same way (no weight moves between them)
            y_ours = layer(x, recorder=recorder).detach()
        res.update(time_steps(fwd_bwd_step(layer, x, dy), device, args.warmup, args.iters))
        counts = recorder.records[0].routing.tokens_per_expert.clone()
        res["routing"] = routing_summary(counts)
        res["tokens_per_expert"] = counts.tolist()
        res["fell_back_to_loop"] = bool(getattr(layer.experts, "_warned_fallback", False))

    guarded(res, learned)
    record("ours_learned", res)

    res = {}

    def rows_kept() -> None:
        # the layer as it was before the experts took the combine weights and gathered their own rows
        before = layer.plan.options
        layer.replan(regather_rows=False, weights_applied_by="combine")
        try:
            res.update(time_steps(fwd_bwd_step(layer, x, dy), device, args.warmup, args.iters))
        finally:
            layer.replan(**dataclasses.asdict(before))

    guarded(res, rows_kept)
    record("ours_rows_kept", res)

    res = {}

    def forced() -> None:
        if not hasattr(layer.router.config, "force_balance"):
            raise RuntimeError("MoEConfig has no force_balance option")
        layer.router.config.force_balance = True
        try:
            res.update(time_steps(fwd_bwd_step(layer, x, dy), device, args.warmup, args.iters))
            recorder = MoERecorder()
            with torch.no_grad():
                layer(x, recorder=recorder)
            res["routing"] = routing_summary(recorder.records[0].routing.tokens_per_expert)
        finally:
            layer.router.config.force_balance = False

    guarded(res, forced)
    record("ours_forced", res)

    if device.type == "cuda" and not args.skip_compiled:
        res = {}

        def compiled() -> None:
            # the training setup of MoEParallelStrategy(compile=True): router and shared experts compiled regions
            for mod in (layer.router, layer.shared_experts):
                if mod is not None:
                    mod.compile()
            res.update(time_steps(fwd_bwd_step(layer, x, dy), device, args.warmup, args.iters))

        guarded(res, compiled)
        record("ours_compiled", res)

    if args.profile:
        res = {}

        def prof() -> None:
            trace = Path(args.out).resolve().parent / f"moe_layer_trace_{name}.json"
            table = profile_layer(fwd_bwd_step(layer, x, dy), device, trace)
            log(f"\n--- profile: {name} ours_learned, 3 iterations (top 20 by self "
                f"{'CUDA' if device.type == 'cuda' else 'CPU'} time) ---\n{table}")
            res["trace"] = str(trace)
            res["table"] = table

        guarded(res, prof)
        rep["profile"] = res

    clear_grads(x, *layer.parameters())
    reset_memory(device)
    num: dict[str, Any] = {}
    guarded(num, lambda: num.update(numerics_check(layer, cfg, x, dy, args.check_tokens)))
    rep["numerics"] = num
    log(f"[{name}] numerics: {_numerics_line(num)}")
    reset_memory(device)

    R = T * m.top_k
    bal = balanced_counts(R, m.num_experts, device)
    shared = layer.shared_experts
    bare_runs = [("bare", "learned", False), ("bare_balanced", "balanced", False)]
    if shared is not None:
        bare_runs += [("bare_shared", None, True), ("bare_routed+shared", "learned", True),
                      ("bare_balanced_routed+shared", "balanced", True)]
    for key, kind, with_shared in bare_runs:
        res = {"counts": kind}
        c = bal if kind == "balanced" else counts if kind == "learned" else None
        if kind == "learned" and counts is None:
            res["error"] = "no counts from ours_learned"
        else:
            guarded(res, lambda c=c, sh=shared if with_shared else None: res.update(time_steps(
                bare_step(layer.experts, c, sh, T, device, dtype, seed + 2), device, args.warmup, args.iters)))
        clear_grads(*layer.parameters())
        reset_memory(device)
        record(key, res)
    if counts is not None:
        res = {"impl": "GroupedExperts forward + backward on grouped rows (GEMMs + SwiGLU)"}
        guarded(res, lambda: res.update(time_steps(experts_only_step(layer.experts, counts, device, dtype, seed + 3),
                                                   device, args.warmup, args.iters)))
        clear_grads(*layer.parameters())
        record("experts_only", res)

    router_state = {k: v.detach().clone() for k, v in layer.router.state_dict().items()}
    del layer
    reset_memory(device)

    # ---- peers: our weights (rebuilt from the seed) copied in, then ours freed before timing
    def peer(key: str, make: Callable[[Any], tuple[torch.nn.Module, dict[str, Any]]], compare: bool = True) -> None:
        res: dict[str, Any] = {}
        block = None

        def go() -> None:
            nonlocal block
            src = build_ours(cfg, device, dtype, seed, router_state)
            try:
                block, info = make(src)
            finally:
                del src
            res.update(info)
            reset_memory(device)
            if compare and y_ours is not None:
                with torch.no_grad():
                    res["vs_ours"] = output_diff(block(x), y_ours)
            res.update(time_steps(fwd_bwd_step(block, x, dy), device, args.warmup, args.iters))

        guarded(res, go)
        del block
        reset_memory(device)
        record(key, res)

    if not args.skip_hf:
        for impl in [s.strip() for s in args.hf_impls.split(",") if s.strip()]:
            peer(f"hf_{impl}", lambda src, impl=impl: hf_peer.moe_block(cfg, spec["hf"], impl, src, device, dtype))
    if not args.skip_torchtitan:
        try:
            importlib.import_module("torchtitan.models.common.moe")
            ok = True
        except Exception as e:  # noqa: BLE001
            ok = False
            for key in ("torchtitan", "torchtitan_forced"):
                record(key, {"unavailable": _err(e)})
        if ok:
            peer("torchtitan", lambda src: titan_peer.moe_block(cfg, src, device, dtype, forced=False))
            peer("torchtitan_forced", lambda src: titan_peer.moe_block(cfg, src, device, dtype, forced=True), compare=False)
    rep["ratios"] = ratios(name, runs)


# ------------------------------------------------------------------------------------------------ report
def ratios(name: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def ms(k: str) -> Optional[float]:
        return runs.get(k, {}).get("ms")

    out: dict[str, Any] = {}
    for k, r in runs.items():
        if r.get("ms") is None:
            continue
        for d in ("bare", "bare_routed+shared"):
            if ms(d):
                out.setdefault(k, {})[f"/{d}"] = r["ms"] / ms(d)
    spec = SHAPES[name]
    # ours as it trains: eager, or with the compiled regions when that ran and is faster
    ours = [v for v in (ms("ours_learned"), ms("ours_compiled")) if v]
    learned, forced, denom = (min(ours) if ours else None), ms("ours_forced"), ms(spec["denom"])
    out["target"] = {
        "ratio": f"min(ours_learned, ours_compiled)/{spec['denom']}", "value": learned / denom if learned and denom else None,
        "max": spec["target"],
        "learned/forced": learned / forced if learned and forced else None, "learned/forced_max": FORCED_TARGET}
    t = out["target"]
    t["met"] = None if t["value"] is None else t["value"] <= spec["target"]
    t["forced_met"] = None if t["learned/forced"] is None else t["learned/forced"] <= FORCED_TARGET
    return out


def _line(shape: str, key: str, r: dict[str, Any]) -> str:
    s = f"[{shape} | {key}] {_fmt(r.get('ms'), '.3f')} ms  peak {_fmt(r.get('peak_gib'), '.2f')} GiB"
    if r.get("routing"):
        s += f"  max/mean tokens per expert {_fmt(r['routing'].get('max_over_mean'), '.2f')}"
    if r.get("vs_ours"):
        s += f"  |y - y_ours|/max|y_ours| {r['vs_ours']['rel']:.2e}"
    if r.get("unavailable"):
        s += f"  unavailable: {r['unavailable']}"
    if r.get("error"):
        s += f"  ERROR {r['error']}"
    return s


def _numerics_line(n: dict[str, Any]) -> str:
    if n.get("error"):
        return "ERROR " + n["error"]
    a, b = n["bench_dtype_fast_vs_fp32_loop"], n["fp32_fast_vs_fp32_loop"]
    return (f"fast (bench dtype) vs fp32 loop: y {a['y']['rel']:.2e}, dx {a['dx']['rel']:.2e}; fp32 fast vs fp32 loop:"
            f" y {b['y']['rel']:.2e}, dx {b['dx']['rel']:.2e} (rel. to max|ref|, {n['tokens']} tokens)"
            f" -> {'ok' if n['ok'] else 'MISMATCH'}")


def _vs(v: Optional[dict[str, float]]) -> str:
    return "-" if not v else f"{v['rel']:.1e} ({v['tokens_differing_gt_1pct']:.1%})"


def table(shapes: dict[str, dict[str, Any]]) -> str:
    head = ["shape", "impl", "ms", "x bare", "x bare r+s", "peak GiB", "max/mean", "vs ours", "note"]
    rows = []
    for name, rep in shapes.items():
        q = rep.get("ratios", {})
        for k, r in rep.get("runs", {}).items():
            note = ("unavailable: " + r["unavailable"]) if r.get("unavailable") else \
                ("ERROR " + r["error"]) if r.get("error") else r.get("experts_implementation", "")
            rt = r.get("routing") or {}
            rows.append([name, k, _fmt(r.get("ms"), ".3f"), _fmt(q.get(k, {}).get("/bare"), ".2f"),
                         _fmt(q.get(k, {}).get("/bare_routed+shared"), ".2f"), _fmt(r.get("peak_gib"), ".2f"),
                         _fmt(rt.get("max_over_mean"), ".2f"), _vs(r.get("vs_ours")),
                         note[:90]])
    return md_table(head, rows)


def targets(shapes: dict[str, dict[str, Any]]) -> str:
    out = []
    for name, rep in shapes.items():
        t = rep.get("ratios", {}).get("target")
        if not t:
            continue
        met = {True: "MET", False: "MISSED", None: "n/a"}
        out.append(f"{name}: {t['ratio']} = {_fmt(t['value'], '.2f')}x (target <= {t['max']}x: {met[t['met']]});"
                   f" learned/forced = {_fmt(t['learned/forced'], '.2f')} (target <= {t['learned/forced_max']}:"
                   f" {met[t['forced_met']]}); numerics {'ok' if rep.get('numerics', {}).get('ok') else 'NOT ok'}")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3,deepseek_v3,mixtral", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=int, default=None, help="T for every shape (default: the shape's; 256 --small)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per implementation (default 20; 3 --small)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 1 --small)")
    p.add_argument("--router-steps", type=int, default=0, help="SGD steps on the router before timing (default 0)")
    p.add_argument("--router-lr", type=float, default=1e-2)
    p.add_argument("--check-tokens", type=int, default=256, help="tokens of the fp32 reference check")
    p.add_argument("--hf-impls", default="eager,grouped_mm",
                   help="transformers experts implementations to time ('eager' = the per-expert loop)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-compiled", action="store_true",
                   help="skip ours_compiled (router and shared experts under torch.compile, as compile=True trains)")
    p.add_argument("--skip-torchtitan", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler of ours_learned: top-20 kernels to stdout, a trace next to --out")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 (cuda), fp32 (cpu)")
    p.add_argument("--small", action="store_true", help="toy sizes of the three shapes (smoke test on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.iters is None:
        args.iters = 3 if args.small else 20
    if args.warmup is None:
        args.warmup = 1 if args.small else 5
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    bad = [s for s in args.shapes.split(",") if s.strip() not in SHAPES]
    if bad:
        p.error(f"unknown shapes {bad}; choose from {list(SHAPES)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        log("--device cuda but CUDA is not available; use --device cpu")
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t_all = time.perf_counter()
    env = environment(device)
    report: dict[str, Any] = {"args": vars(args), "env": env, "shapes": {}}
    log(json.dumps(env))

    def save() -> None:
        report["total_wall_s"] = time.perf_counter() - t_all
        save_result(args.out, report, "moe_layer")

    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        rep: dict[str, Any] = report["shapes"].setdefault(name, {})
        t0 = time.perf_counter()
        guarded(rep, lambda: run_shape(name, args, device, dtype, save, rep))
        rep["wall_s"] = time.perf_counter() - t0
        if "ratios" not in rep:
            rep["ratios"] = ratios(name, rep.get("runs", {}))
        reset_memory(device)
        save()

    save()
    log("\n" + "=" * 100)
    log(f"MoE layer forward + backward, {args.dtype}, {device} ({env.get('gpu', 'cpu')}); median of {args.iters} "
        f"after {args.warmup} warmup; 'x bare' = ms / bare routed grouped GEMMs with our learned counts; 'vs ours' ="
        f" max|y - y_ours| / max|y_ours| (tokens off by > 1% of it)")
    log(table(report["shapes"]))
    log(targets(report["shapes"]))
    log(f"total wall time {report['total_wall_s']:.0f}s; results in {args.out}")
    ok = all(not rep.get("error") and rep.get("numerics", {}).get("ok")
             and not any(r.get("error") for r in rep.get("runs", {}).values()) for rep in report["shapes"].values())
    return 0 if ok else 1
