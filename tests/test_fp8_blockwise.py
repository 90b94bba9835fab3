"""FP8 blockwise (1x128 activations, 128x128 weights) in emulation: the tile quantizer against its definition, the
linear's forward / backward error against fp32 bounded and smaller than tensorwise FP8's on a matrix with outliers,
the grouped GEMM (through the experts' padded seam, uneven and empty groups) equal to a per-group loop of the
linear, and, on an sm90 GPU, torchao's kernels against the emulation (and the fused SwiGLU + rowwise quantization
kernel compiled, storing FP8)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.callbacks.low_precision import LowPrecisionGroupedMM
from lightning_moe.lowp.fp8_blockwise import (
    emulated_fp8_blockwise_grouped_mm, emulated_fp8_blockwise_linear, qdq_tiles)


def _qdq_loop(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The definition, tile by tile: scale = 448 / amax (float64, amax >= 1e-12), e4m3 round trip."""
    out = torch.empty_like(t, dtype=torch.float32)
    for i in range(0, t.shape[0], rows):
        for j in range(0, t.shape[1], cols):
            tile = t[i:i + rows, j:j + cols].detach().float()
            s = float(448.0 / max(float(tile.abs().max()), 1e-12))
            s = torch.tensor(s, dtype=torch.float32)
            out[i:i + rows, j:j + cols] = (tile * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s
    return out


def _outliers(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[3, 5], x[200, 17] = 1e5, -3e4  # beyond e4m3's range from the rest: one scale per tensor flushes the rest
    return x


def _qdq_tensorwise(t: torch.Tensor) -> torch.Tensor:
    return _qdq_loop(t, t.shape[0], t.shape[1])


@pytest.mark.parametrize("rows, cols", [(1, 128), (128, 128), (128, 1)])
def test_tiles_match_the_definition(rows, cols):
    x = _outliers((300, 256), 0)  # 300 rows: a partial last tile
    assert torch.equal(qdq_tiles(x, rows, cols), _qdq_loop(x, rows, cols))
    assert torch.equal(qdq_tiles(torch.zeros(4, 128), 1, 128), torch.zeros(4, 128))


def test_linear_error_is_bounded_and_below_tensorwise_with_outliers():
    x = _outliers((256, 512), 1).requires_grad_(True)
    w = (torch.randn(384, 512, generator=torch.Generator().manual_seed(2)) * 0.05).requires_grad_(True)
    dy = _outliers((256, 384), 3)  # gradients have outliers too
    ref = [x @ w.t(), dy @ w, dy.t() @ x]  # fp32: y, dx, dw
    y = emulated_fp8_blockwise_linear(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    # tensorwise FP8 (one scale per tensor) of the same three GEMMs
    tw = [_qdq_tensorwise(x) @ _qdq_tensorwise(w).t(), _qdq_tensorwise(dy) @ _qdq_tensorwise(w),
          _qdq_tensorwise(dy).t() @ _qdq_tensorwise(x)]
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    # the typical row: outlier rows dominate a global norm, the damage tensorwise scaling does is to the others
    row_rel = lambda a, b: float(((a - b).norm(dim=-1) / b.norm(dim=-1)).median())  # noqa: E731
    for what, got, t, r in zip(("y", "dx", "dw"), (y, dx, dw), tw, ref):
        got, r = got.detach(), r.detach()
        assert rel(got, r) < 0.05, what
        e_block, e_tensor = row_rel(got, r), row_rel(t, r)
        assert 1e-3 < e_block < 0.05, (what, e_block)  # e4m3's 3 mantissa bits, and no worse
        assert e_block < 0.5 * e_tensor, (what, e_block, e_tensor)


@pytest.mark.parametrize("sizes", [[5, 0, 130, 3], [128, 256], [0, 0, 7, 0]])
def test_grouped_through_the_padded_seam_equals_a_loop_of_linears(sizes):
    E, K, N = len(sizes), 256, 128
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(sizes), K, generator=g).requires_grad_(True)
    w_ENK = (torch.randn(E, N, K, generator=g) * 0.05).requires_grad_(True)
    dy = torch.randn(sum(sizes), N, generator=g)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    y = LowPrecisionGroupedMM("fp8_blockwise", emulate=True)(x, w_ENK.transpose(-2, -1), offs)
    dx, dw = torch.autograd.grad(y, (x, w_ENK), dy)
    ys, dxs, dws = [], [], []
    for e, (x_e, dy_e) in enumerate(zip(torch.split(x.detach(), sizes), torch.split(dy, sizes))):
        x_e = x_e.clone().requires_grad_(True)
        w_e = w_ENK[e].detach().clone().requires_grad_(True)
        y_e = emulated_fp8_blockwise_linear(x_e, w_e)
        gx, gw = torch.autograd.grad(y_e, (x_e, w_e), dy_e) if len(x_e) else (x_e, torch.zeros_like(w_e))
        ys.append(y_e.detach()), dxs.append(gx), dws.append(gw)
    torch.testing.assert_close(y.detach(), torch.cat(ys), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, torch.cat(dxs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, torch.stack(dws), rtol=1e-5, atol=1e-5)


def test_dims_not_multiples_of_128_are_a_clear_error():
    with pytest.raises(ValueError, match="multiples of 128"):
        emulated_fp8_blockwise_linear(torch.randn(4, 64), torch.randn(128, 64))
    with pytest.raises(ValueError, match="multiples of 128"):
        emulated_fp8_blockwise_grouped_mm(torch.randn(4, 128), torch.randn(1, 128, 96),
                                          torch.tensor([4], dtype=torch.int32))


@pytest.mark.parametrize("deep_gemm, experts, emulate, warns", [
    (False, True, False, True), (True, True, False, False), (False, False, False, False), (False, True, True, False)])
def test_forced_blockwise_experts_without_deep_gemm_warn_that_they_are_slow(monkeypatch, deep_gemm, experts, emulate,
                                                                               warns):
    """torchao's blockwise grouped fallback ran the bench8 step 6.7x slower than bf16 on an H200: a user forcing it
    hears so at the hardware check, with what to do instead; nothing warns where the fast path exists."""
    import importlib.util
    import warnings

    from lightning_moe.lowp import recipes

    # imported before CUDA is faked (their import probes the real device)
    pytest.importorskip("torchao.prototype.blockwise_fp8_training.linear")
    pytest.importorskip("torchao.prototype.moe_training")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if deep_gemm else None) if name == "deep_gemm" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        recipes.check_hardware("fp8_blockwise", emulate, "cuda", experts=experts)
        recipes.check_hardware("fp8_rowwise", emulate, "cuda", experts=experts)  # rowwise has its fast grouped GEMM
    slow = [w for w in got if "deep_gemm" in str(w.message)]
    assert len(slow) == int(warns), [str(w.message) for w in got]
    if warns:
        assert "experts=False" in str(slow[0].message) and "recipe='auto'" in str(slow[0].message)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _sm90(), reason="torchao's blockwise FP8 kernels need an sm90 GPU (emulation: tests above)")
def test_torchao_kernels_match_the_emulation_on_gpu():
    pytest.importorskip("torchao.prototype.blockwise_fp8_training.linear")
    from lightning_moe.lowp.fp8_blockwise import fp8_blockwise_grouped_mm, fp8_blockwise_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 1024, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(768, 1024, device="cuda", generator=g) * 0.03).bfloat16().requires_grad_(True)
    dy = torch.randn(512, 768, device="cuda", generator=g).bfloat16()
    outs = []
    for fn in (fp8_blockwise_linear, emulated_fp8_blockwise_linear):
        y = fn(x, w)
        outs.append((y.float(), *(t.float() for t in torch.autograd.grad(y, (x, w), dy))))
    for a, b in zip(*outs):  # same quantized operands; accumulation order and bf16 outputs differ
        assert float((a - b).norm() / b.norm()) < 1e-2
    offs = torch.tensor([128, 128, 384, 512], device="cuda", dtype=torch.int32)
    w_E = (torch.randn(4, 768, 1024, device="cuda", generator=g) * 0.03).bfloat16().requires_grad_(True)
    outs = []
    for fn in (fp8_blockwise_grouped_mm, emulated_fp8_blockwise_grouped_mm):
        y = fn(x, w_E.transpose(-2, -1), offs)
        outs.append((y.float(), *(t.float() for t in torch.autograd.grad(y, (x, w_E), dy))))
    for a, b in zip(*outs):
        assert float((a - b).norm() / b.norm()) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU (interpreter: "
                    "tests/test_moe_kernels.py)")
def test_fused_swiglu_quant_stores_fp8_on_gpu(monkeypatch):
    """Compiled, the fused SwiGLU + rowwise quantization stores float8_e4m3fn: the same values as its fp32 output
    and as the emulated rowwise recipe."""
    from lightning_moe.lowp.fp8_grouped import _qdq_along
    from lightning_moe.moe import _triton_kernels, kernels

    if _triton_kernels.INTERPRET:
        pytest.skip("Triton's interpreter is on in this session: run this file on its own")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    g, u = (torch.randn(300, 768, device="cuda").mul(3).bfloat16() for _ in range(2))
    p = torch.rand(300, device="cuda")
    h, q8, s8 = kernels.swiglu_quant_rowwise(g, u, p)
    _, q32, s32 = kernels.swiglu_quant_rowwise(g, u, p, q_dtype=torch.float32)
    assert q8.dtype == torch.float8_e4m3fn and torch.equal(q8.float(), q32) and torch.equal(s8, s32)
    assert torch.equal(q8.float() * s8[:, None], _qdq_along(h, -1))


def test_token_counts_not_multiples_of_128_are_padded_for_torchao(monkeypatch):
    """torchao's blockwise linear takes only multiples of 128 tokens (it asserted on the H200 sweep's M=64): the
    wrapper pads with zero rows, which gives the emulation's numbers (outputs and both gradients), here with torchao's
    kernel replaced by the emulation behind the same contract."""
    linear = pytest.importorskip("torchao.prototype.blockwise_fp8_training.linear")
    from lightning_moe.lowp.fp8_blockwise import fp8_blockwise_linear

    calls = []

    class ContractEmulation(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, block, dtype, use_triton):
            assert x.dim() == 2 and x.shape[0] % block == 0, "torchao: first dimension must be divisible by 128"
            calls.append(tuple(x.shape))
            ctx.save_for_backward(x, w)
            return emulated_fp8_blockwise_linear(x, w).detach()

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            with torch.enable_grad():
                x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
                dx, dw = torch.autograd.grad(emulated_fp8_blockwise_linear(x_, w_), (x_, w_), dy)
            return dx, dw, None, None, None

    monkeypatch.setattr(linear, "fp8_blockwise_mm", ContractEmulation)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 256, generator=g, requires_grad=True)  # 100 tokens
    w = (torch.randn(128, 256, generator=g) * 0.05).requires_grad_(True)
    dy = torch.randn(2, 50, 128, generator=g)
    outs = []
    for fn in (fp8_blockwise_linear, emulated_fp8_blockwise_linear):
        y = fn(x, w)
        outs.append((y, *torch.autograd.grad(y, (x, w), dy)))
    assert calls == [(128, 256)]
    for a, b in zip(*outs):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-6)
