"""FP8 quantization fused into the experts' own passes (lightning_moe.lowp.fp8_fused) against the unfused FP8 rowwise
path (LowPrecisionGroupedMM quantizing each GEMM's high-precision input), in emulation: the PyTorch reference on CPU
and the Triton kernels under Triton's interpreter (TRITON_INTERPRET=1, set before triton is first imported). fp32
operands, so "equal" means equal to fp32 rounding: both paths quantize the same values bit for bit."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels.py imports it on first use)

import importlib.util

import pytest
import torch

from lightning_moe.callbacks.low_precision import LowPrecisionGroupedMM, LowPrecisionTraining
from lightning_moe.config import MoEConfig
from lightning_moe.lowp import fp8_fused
from lightning_moe.lowp.fp8_grouped import pad_layout, quantize_rowwise
from lightning_moe.moe import kernels
from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.recompute import apply_recompute

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
SIZES = [[5, 0, 13, 3], [16, 16, 0, 32], [0, 0, 7, 0], [1, 2, 3, 40]]


def _close(a, b, tol=1e-5):
    """Equal to fp32 rounding, relative to the reference's scale."""
    assert a.shape == b.shape and a.dtype == b.dtype
    scale = b.abs().max().clamp(min=1e-30)
    assert ((a - b).abs().max() / scale).item() <= tol, ((a - b).abs().max() / scale).item()


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


@pytest.fixture(params=["torch", pytest.param("triton", marks=needs_triton)])
def backend(request, monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, request.param)
    return request.param


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("weights", [False, True])
def test_swiglu_down_matches_the_unfused_rowwise_path(backend, sizes, weights):
    """Forward output and every gradient (g, u, row weights, w2) of the SwiGLU that quantizes for the down GEMM equal
    the unfused path's: swiglu(), then the rowwise GEMM quantizing h again (both on the reference / both on the
    kernels); and both differ from the bf16-free fp32 product (FP8 numerics are really exercised)."""
    torch.manual_seed(0)
    E, F, D = len(sizes), 32, 48
    R = sum(sizes)
    g, u = torch.randn(R, F) * 2, torch.randn(R, F) * torch.logspace(-2, 2, R)[:, None]
    p = torch.rand(R) if weights else None
    w = torch.randn(E, D, F) * 0.1  # the [E, D, F] down weight; the GEMM gets its [E, F, D] view
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    dy = torch.randn(R, D)
    seam = LowPrecisionGroupedMM("fp8_rowwise", emulate=True, cache_weights=False)
    outs = {}
    for name in ("fused", "unfused"):
        gi, ui, wi = _leaves(g, u, w)
        pi = _leaves(p)[0] if weights else None
        if name == "fused":
            y = seam.swiglu_down(gi, ui, pi, wi.transpose(-2, -1), offs)
        else:
            y = seam(kernels.swiglu(gi, ui, pi), wi.transpose(-2, -1), offs)
        y.backward(dy)
        outs[name] = [y, gi.grad, ui.grad, wi.grad] + ([pi.grad] if weights else [])
    for a, b in zip(outs["fused"], outs["unfused"]):
        _close(a, b)
    if R:
        exact = torch._grouped_mm(kernels.swiglu_reference(g, u, p), w.transpose(-2, -1), offs=offs)
        assert not torch.allclose(outs["fused"][0], exact, rtol=1e-3, atol=1e-3)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_quant_into_the_padded_layout(monkeypatch, dtype):
    """dest_R / rows: the kernel's rows land where pad_layout puts them, zeros elsewhere; bit for bit the unpadded
    results."""
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    torch.manual_seed(1)
    offs = torch.tensor([3, 3, 20], dtype=torch.int32)
    g, u = (torch.randn(20, 24).to(dtype) for _ in range(2))
    p = torch.rand(20)
    P, _, dest = pad_layout(offs, 20, 16)
    flat = kernels.swiglu_quant_rowwise(g, u, p, q_dtype=torch.float32)
    padded = kernels.swiglu_quant_rowwise(g, u, p, q_dtype=torch.float32, dest_R=dest, rows=P)
    for a, b in zip(padded, flat):
        assert a.shape[0] == P and torch.equal(a[dest], b)
        rest = torch.ones(P, dtype=torch.bool)
        rest[dest] = False
        assert not a[rest].any()


@needs_triton
@pytest.mark.parametrize("D", [16, 48, 1100])
def test_gather_quant_rowwise_is_the_gather_then_the_rowwise_quantization(monkeypatch, D):
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    torch.manual_seed(2)
    T, k = 7, 2
    x = torch.randn(T, D) * torch.logspace(-3, 3, T)[:, None]
    x[3] = 0.0  # an all-zero token
    asg = torch.tensor([4, -1, 0, 13, 7, 2, -1, 9, 6, 1])  # assignments of the rows; -1: padding rows
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    P, _, dest = pad_layout(offs, asg.numel(), 16)
    q, s = kernels.gather_quant_rowwise(x, asg, k, dest, P, q_dtype=torch.float32)
    rows = kernels.gather_rows(x, asg, k)
    q_ref, s_ref = quantize_rowwise(rows, torch.float32)
    assert torch.equal(q[dest], q_ref) and torch.equal(q[dest] * s[dest, None], q_ref * s_ref[:, None])
    valid = asg >= 0
    assert torch.equal(s[dest][valid], s_ref[valid])  # padding rows: zeros whatever their scale
    assert q.sum() == q[dest].sum()  # the rest is zeros


def _layer(fuse, D=32, F=48, **cfg):
    """A layer whose experts run the emulated FP8 rowwise grouped GEMM (fused or not); fuse None: bf16 experts."""
    torch.manual_seed(5)
    layer = MoELayer(MoEConfig(num_experts=4, top_k=2, expert_hidden_size=F, **cfg), D)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.normal_(0.0, 0.3)
    if fuse is not None:
        layer.replan(grouped_mm=LowPrecisionGroupedMM("fp8_rowwise", emulate=True, fuse=fuse, cache_weights=fuse))
    return layer


def _run(layer, x):
    layer.zero_grad()
    (xi,) = _leaves(x)
    y = layer(xi)
    y.square().sum().backward()
    return [y, xi.grad] + [prm.grad.clone() for prm in layer.parameters()]


@pytest.mark.parametrize("cfg", [dict(), dict(capacity_factor=0.75, pad_to_capacity=True)], ids=["dropless", "padded"])
def test_layer_fused_matches_unfused(backend, monkeypatch, cfg):
    """The whole MoE layer, forward and every gradient: fused (plan.fp8_fused; with the Triton kernels on one process
    the experts also gather their rows quantized, plan.regather_rows) vs the unfused FP8 rowwise path."""
    calls = []
    real = fp8_fused._Fp8GatherGateUp.apply
    monkeypatch.setattr(fp8_fused._Fp8GatherGateUp, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 12, 32)
    fused, unfused = _layer(True, **cfg), _layer(False, **cfg)
    assert fused.plan.fp8_fused and fused.plan.regather_rows
    assert not unfused.plan.fp8_fused and not unfused.plan.regather_rows
    a, b = _run(fused, x), _run(unfused, x)
    assert len(calls) == (1 if backend == "triton" else 0)  # the quantizing gather needs the kernels
    for t, ref in zip(a, b):
        _close(t, ref, 2e-5)
    assert not fused.replan(fuse_fp8_quant=False).fp8_fused  # the option keeps the unfused reference


def test_weight_cache_quantizes_once_per_step_and_refreshes_after_it():
    """With moe_act recomputed, the down weight's forward-layout FP8 copy is made once and reused by the recompute;
    the backward's layout once. An optimizer step (or an in-place change) invalidates them: the next step's results
    equal a run without the cache."""
    x = torch.randn(2, 12, 32)
    cached, plain = _layer(True), _layer(True)
    plain.replan(grouped_mm=LowPrecisionGroupedMM("fp8_rowwise", emulate=True, cache_weights=False))
    for layer in (cached, plain):
        apply_recompute(layer, ["moe_act"])
    cache = cached.experts.grouped_mm.weight_cache
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (cached, plain)]
    for step in range(3):
        if step == 2:
            for m in (cached, plain):
                with torch.no_grad():
                    m.experts.w2.mul_(1.5)  # outside the optimizer: the version counter still says so
        before = (cache.hits, cache.misses)
        a, b = _run(cached, x), _run(plain, x)
        for t, ref in zip(a, b):
            assert torch.isfinite(ref).all() and torch.equal(t, ref)
        # forward: w2 (fwd), recompute in the backward: w2 (fwd) again = a hit, w2 (dgrad): one more miss
        assert (cache.hits - before[0], cache.misses - before[1]) == (1, 2)
        for o in opts:
            o.step()


def test_callback_wires_the_fused_path_and_its_options():
    def experts_gmm(**kw):
        layer = _layer(None)
        LowPrecisionTraining(recipe="fp8_rowwise", emulate=True, dense=False, **kw).transform_model(layer)
        return layer

    layer = experts_gmm()
    gmm = layer.experts.grouped_mm
    assert layer.plan.fp8_fused and gmm.fused_fp8 and gmm.weight_cache is not None
    assert not experts_gmm(fuse_quant=False).plan.fp8_fused
    assert experts_gmm(cache_fp8_weights=False).experts.grouped_mm.weight_cache is None
    cb = LowPrecisionTraining(recipe="fp8_rowwise", emulate=True, dense=False)
    cb._edp_shard = 2  # FSDP shards the experts: no cache of unsharded FP8 copies
    layer = _layer(None)
    cb.transform_model(layer)
    assert layer.plan.fp8_fused and layer.experts.grouped_mm.weight_cache is None
    # the block-scaled recipes keep their own (unfused) grouped GEMM
    assert not LowPrecisionGroupedMM("fp8_blockwise", emulate=True).fused_fp8
