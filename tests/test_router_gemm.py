"""The router's split-bf16 logits GEMM (lightning_moe.moe.router_gemm) against the fp32 reference.

On CPU ``mm_f32`` runs fp32 matmuls of the same bf16 terms the CUDA path feeds to tensor cores, so these tests
check the algebra (hi/lo split, stacked operands, which terms are kept); the GPU run is in bench/kernels_check.py.
"""

import torch
import torch.nn.functional as F

from lightning_moe.moe.router_gemm import router_logits, split_bf16, use_split_bf16


def _operands(T=96, D=256, E=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    w = torch.randn(E, D, generator=g) * 0.02
    return x, w


def test_split_bf16_recovers_16_bits():
    _, w = _operands()
    hi, lo = split_bf16(w)
    assert hi.dtype == lo.dtype == torch.bfloat16
    err = (hi.float() + lo.float() - w).abs() / w.abs()
    assert err.max() < 2.0**-15
    # hi alone is only bf16-accurate: the lo term matters
    assert ((hi.float() - w).abs() / w.abs()).max() > 2.0**-10


def test_split_linear_matches_fp32_forward_and_grads():
    x, w = _operands()
    g_TE = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(1))

    xr, wr = x.float().requires_grad_(), w.clone().requires_grad_()
    ref = F.linear(xr, wr)
    ref.backward(g_TE)

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = router_logits(xs, ws, split=True)
    out.backward(g_TE)

    assert out.dtype == torch.float32 and ws.grad.dtype == torch.float32 and xs.grad.dtype == torch.bfloat16
    scale = ref.abs().max()
    assert (out - ref).abs().max() / scale < 1e-5
    assert ((ws.grad - wr.grad).abs().max() / wr.grad.abs().max()) < 1e-5
    # the input gradient is rounded to bf16 at the end, like the reference's fp32 -> bf16 cast
    assert (xs.grad.float() - xr.grad).abs().max() / xr.grad.abs().max() < 2.0**-7
    # a bf16 weight alone would be far worse: the test can tell the terms apart
    bad = F.linear(x.float(), w.bfloat16().float())
    assert (bad - ref).abs().max() / scale > 10 * (out - ref).abs().max() / scale


def test_split_path_choice():
    x, w = _operands()
    assert not use_split_bf16(x, w)  # CPU: reference
    assert torch.equal(router_logits(x, w), F.linear(x.float(), w))


def test_router_forward_uses_router_logits_on_cpu_exactly():
    from lightning_moe.config import MoEConfig
    from lightning_moe.moe.router import TopKRouter

    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden_size=32)
    r = TopKRouter(cfg, 64)
    x = torch.randn(10, 64)
    res = r(x)
    ref = torch.softmax(F.linear(x, r.weight), -1).topk(2, -1).indices
    assert torch.equal(res.expert_ids.sort(-1).values, ref.sort(-1).values)
