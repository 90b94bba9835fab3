"""The fused FP8 path (lightning_moe.lowp.fp8_fused) on its real kernels: compiled Triton quantizers storing float8,
torchao's quantizers and torch._scaled_grouped_mm (sm90), against the unfused torchao path. Skipped without an sm90 GPU
and torchao; run this file on its own (tests/test_fp8_fused.py forces Triton's interpreter for the CPU tests):
``python -m pytest -q tests/test_fp8_fused_gpu.py``."""

import importlib.util

import pytest
import torch

from lightning_moe.config import MoEConfig
from lightning_moe.moe import kernels
from lightning_moe.moe.layer import MoELayer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0)
    or importlib.util.find_spec("torchao") is None, reason="needs an sm90 GPU and torchao")


def _bf16_experts_layer() -> MoELayer:
    """The seeded CUDA layer both tests run: 16 experts of 192 over D=256, top-4, bf16 experts."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(num_experts=16, top_k=4, expert_hidden_size=192), 256).cuda()
    layer.experts.to(torch.bfloat16)
    return layer


@pytest.mark.parametrize("weights_by", ["experts", "combine"])
def test_fused_layer_matches_the_unfused_torchao_path(monkeypatch, weights_by):
    from lightning_moe.callbacks.low_precision import LowPrecisionGroupedMM
    from lightning_moe.moe import _triton_kernels

    if _triton_kernels.INTERPRET:
        pytest.skip("Triton's interpreter is on in this session: run this file on its own")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    layer = _bf16_experts_layer()
    layer.replan(weights_applied_by=weights_by)
    x = torch.randn(1, 1000, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    out = {}
    for fuse in (True, False):
        plan = layer.replan(grouped_mm=LowPrecisionGroupedMM("fp8_rowwise", emulate=False, fuse=fuse))
        assert plan.fp8_fused == fuse and plan.regather_rows == fuse
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        out[fuse] = [y, xi.grad] + [p.grad.clone() for p in layer.parameters()]
    for a, b in zip(out[True], out[False]):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert err <= 2.0**-6, err  # the same FP8 operands; bf16 rounding of the summed input gradients differs


def test_gw_hp_on_its_kernels_matches_its_emulation_and_keeps_the_rowwise_forward(monkeypatch):
    """``fp8_rowwise_gw_hp`` on the real kernels (fused and unfused: bf16 grouped GEMMs for the weight gradients,
    FP8 dgrad without fast accumulation) equals its emulation to bf16 / accumulation rounding; its forward is
    ``fp8_rowwise``'s bit for bit and its expert weight gradients are not; the dense linear's likewise."""
    from lightning_moe.callbacks.low_precision import GW_HP, LowPrecisionGroupedMM
    from lightning_moe.lowp import fp8_linear as fl
    from lightning_moe.moe import _triton_kernels

    if _triton_kernels.INTERPRET:
        pytest.skip("Triton's interpreter is on in this session: run this file on its own")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    layer = _bf16_experts_layer()
    x = torch.randn(1, 1000, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    out = {}
    for name, recipe, emulate, fuse in (("fused", GW_HP, False, True), ("unfused", GW_HP, False, False),
                                        ("emulated", GW_HP, True, True), ("rowwise", "fp8_rowwise", False, True)):
        layer.replan(grouped_mm=LowPrecisionGroupedMM(recipe, emulate=emulate, fuse=fuse))
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        out[name] = [y, xi.grad, layer.experts.w1.grad.clone(), layer.experts.w2.grad.clone()]

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    for a, b in zip(out["fused"], out["unfused"]):  # the same kernels
        assert rel(a, b) <= 2.0**-6, rel(a, b)
    # against the emulation's fp32 products: the weight gradients (bf16 GEMMs) to bf16 rounding; the FP8 GEMMs
    # differ by 2.8% of the largest output (rowwise alike: bench/results/gw_hp_errs_h200.log), with fast
    # accumulation and without it (bench/results/precise_gpu_tests_h200.log): the quantization, not the accumulation
    errs = [rel(a, b) for a, b in zip(out["fused"], out["emulated"])]
    assert max(errs[2:]) <= 2.0**-6 and max(errs[:2]) <= 2.0**-4, errs
    assert torch.equal(out["fused"][0], out["rowwise"][0])
    assert rel(out["fused"][3], out["rowwise"][3]) > 1e-3
    M, K, N = 4096, 1024, 512
    xd, wd = torch.randn(M, K, device="cuda").bfloat16(), (torch.randn(N, K, device="cuda") * 0.05).bfloat16()
    dyd = torch.randn(M, N, device="cuda").bfloat16()
    res = {}
    for emulate in (False, True):
        xi, wi = xd.clone().requires_grad_(), wd.clone().requires_grad_()
        fl.fp8_linear(xi, wi, recipe="rowwise", emulate=emulate, wgrad_hp=True).backward(dyd)
        res[emulate] = (xi.grad, wi.grad)
    assert rel(res[False][0], res[True][0]) <= 1e-2 and rel(res[False][1], res[True][1]) <= 1e-2
    assert rel(res[False][1], dyd.t() @ xd) <= 1e-2  # the high-precision weight gradient


def test_precise_accumulation_leaves_only_the_output_rounding():
    """``fast_accum=False`` (``_Ops`` of the grouped and of the dense GEMM): against the fp32 product of the same FP8
    operands the error is the bf16 output's rounding alone, below the fast-accumulating GEMM's. Measured on an H200
    (bench/results/accum_errs_h200.log): rms 1.66e-3 precise = bf16 rounding, 1.7-2.1e-3 fast."""
    from lightning_moe.lowp import fp8_fused as ff
    from lightning_moe.lowp import fp8_linear as fl

    def rms(y, ref):
        return ((y.float() - ref).norm() / ref.norm()).item()

    torch.manual_seed(0)
    E, M_e, K, N = 16, 1024, 2048, 768
    ops = ff._Ops(emulate=False)
    a = ops.rows(torch.randn(E * M_e, K, device="cuda").bfloat16())
    b = ops.w_fwd((torch.randn(E, K, N, device="cuda") * 0.02).bfloat16())
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * M_e
    ref = torch._grouped_mm(a[0].float() * a[1][:, None], b[0].float() * b[1][:, None, :], offs=offs)
    fast, precise = (rms(ops.mm(a, b, offs, torch.bfloat16, fast_accum=f), ref) for f in (True, False))
    rounding = rms(ref.bfloat16(), ref)
    assert precise <= 1.05 * rounding < fast, (precise, rounding, fast)
    dense = fl._Ops("rowwise", emulate=False)
    xo = dense.x_fwd(torch.randn(8192, 4096, device="cuda").bfloat16())
    wo = dense.w_fwd((torch.randn(2048, 4096, device="cuda") * 0.02).bfloat16())
    ref = (xo[0].float() * xo[1].float()) @ (wo[0].float() * wo[1].float()).t()
    errs = []
    for f in (True, False):
        dense.fast_accum = f
        errs.append(rms(dense.forward(xo, wo, torch.bfloat16), ref))
    assert errs[1] <= 1.05 * rms(ref.bfloat16(), ref) < errs[0], errs


def test_each_kernel_operand_is_the_emulations_quantization():
    """Each FP8 operand the grouped GEMM gets on the kernels (torchao's Triton quantizers: x rowwise, the forward's w
    per (expert, n), the dgrad's w per (expert, k); the wgrad's per (group, column) operands through its GEMM),
    dequantized, against :mod:`lightning_moe.lowp.fp8_grouped`'s emulation of it. The MoE layer's output differs from
    its emulation by 2.8% of its largest value while the GEMMs alone add only output rounding (the test above), so one
    of these quantizations must differ from the emulation's: this names which. Printed: the fraction of elements
    that differ and the largest difference relative to the operand's largest value."""
    from lightning_moe.lowp import fp8_fused as ff
    from lightning_moe.lowp import fp8_grouped as fg

    torch.manual_seed(0)
    E, M_e, K, N = 8, 256, 512, 384
    kern, emu = ff._Ops(emulate=False, bwd_fast_accum=False, fwd_fast_accum=False), ff._Ops(emulate=True)
    # rows and columns of very different magnitudes, as activations and gradients have
    x = (torch.randn(E * M_e, K, device="cuda") * torch.logspace(-3, 2, E * M_e, device="cuda")[:, None]).bfloat16()
    w = (torch.randn(E, K, N, device="cuda") * torch.logspace(-2, 0, N, device="cuda")).bfloat16()
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * M_e

    def compare(name, deq, ref):
        assert deq.shape == ref.shape, (name, deq.shape, ref.shape)
        diff = (deq - ref).abs()
        frac, rel = (diff > 0).float().mean().item(), (diff.max() / ref.abs().max()).item()
        print(f"{name:8s} elements differing {frac:.2e}  max diff / max value {rel:.2e}")
        return frac, rel

    q, s = kern.rows(x)
    res = {"rows": compare("rows", q.float() * s[:, None], emu.rows(x)[0])}
    q, s = kern.w_fwd(w)
    res["w_fwd"] = compare("w_fwd", q.float() * s[:, None, :], emu.w_fwd(w)[0])
    q, s = kern.w_dgrad(w)
    res["w_dgrad"] = compare("w_dgrad", q.float() * s[:, None, :], emu.w_dgrad(w)[0])
    dy = (torch.randn(E * M_e, N, device="cuda") * torch.logspace(-2, 1, E * M_e, device="cuda")[:, None]).bfloat16()
    dw = kern.wgrad(x, dy, offs, torch.bfloat16).float()
    ref = fg.emulated_wgrad(x, dy, offs, E)
    res["wgrad"] = compare("wgrad", dw, ref)
    # a quantization that matches differs in a few ties at most; the wgrad through its GEMM by the bf16 output's
    # rounding (2**-8 of an element at most)
    assert all(f <= 1e-3 for f, _ in (res["rows"], res["w_fwd"], res["w_dgrad"])), res
    assert res["wgrad"][1] <= 2.0**-7, res
