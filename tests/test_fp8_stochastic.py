"""Stochastically rounded FP8 weights (``LowPrecisionTraining(stochastic_weights=True)``,
``lightning_moe.lowp.fp8_stochastic``): the rounded weight lies on the grid of the cast that follows (which then
quantizes it exactly, both layouts, the Triton casts included), is unbiased with SR's error size, leaves grid values
alone; the dense FP8 linear's product is unbiased over draws where round-to-nearest's is not; one draw per optimizer
step with the weight cache; the callback wires it and refuses the layouts that would round to nearest silently."""

from __future__ import annotations

import copy

import pytest
import torch

from _memory import reference_model, step, tokens
from lightning_moe.callbacks import LowPrecisionTraining
from lightning_moe.callbacks.low_precision import LowPrecisionGroupedMM
from lightning_moe.lowp import fp8_fused as ff
from lightning_moe.lowp import fp8_linear as fl
from lightning_moe.lowp import fp8_stochastic
from lightning_moe.lowp.fp8_fused import Fp8WeightCache, _next_generation
from lightning_moe.lowp.fp8_grouped import fp8_scale, qdq_fp8, quantize_rowwise
from lightning_moe.lowp.fp8_stochastic import stochastic_round_e4m3
from lightning_moe.moe import kernels
from test_low_precision import _config

pytest.importorskip("torchao.float8", reason="the fp8 dense linears use torchao (the ao extra)")


def _weight(seed: int = 0, shape=(64, 256)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[3] *= 1e-4  # a row of tiny values: subnormals on its own grid
    w[:, 5] *= 40  # a column far larger than the rest
    return w.to(torch.bfloat16)


def _rtn(w: torch.Tensor, dim: int) -> torch.Tensor:
    return qdq_fp8(w.float(), fp8_scale(w.float().abs().amax(dim=dim, keepdim=True)))


def _on_triton(w: torch.Tensor, monkeypatch) -> torch.Tensor:
    """``w`` where the Triton kernels run: compiled on a GPU machine, Triton's interpreter on CPU (conftest turns it on
    only where there is no GPU)."""
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    return w.to("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dim", [-1, 0])
def test_rounded_weight_is_on_the_casts_grid_unbiased_and_sr_sized(dim):
    w = _weight()
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([stochastic_round_e4m3(w, dim, gen).float() for _ in range(1500)])
    assert draws.dtype == torch.float32 and stochastic_round_e4m3(w, dim, gen).dtype == torch.bfloat16
    one = draws[0]
    if dim == -1:
        q, s = quantize_rowwise(one)
        again = q.float() * s[:, None]
    else:
        q, s = quantize_rowwise(one.t().contiguous())
        again = (q.float() * s[:, None]).t()
    assert torch.equal(again, one)  # round-to-nearest of it is exact: the cast adds no second rounding
    assert bool(((one == 0) | (torch.sign(one) == torch.sign(w.float()))).all())  # signs kept (or rounded to 0)
    rtn_err = (_rtn(w, dim) - w.float()).abs()
    bias = (draws.mean(0) - w.float()).abs()
    assert bias.mean() < 0.1 * rtn_err.mean()  # unbiased (1500 draws: ~2.6% of RTN's error is the noise)
    ratio = ((one - w.float()).pow(2).mean() / rtn_err.pow(2).mean()).sqrt()
    assert 1.2 < ratio < 1.6  # SR's rms error: sqrt(2) x round-to-nearest's for uniformly placed values
    grid = _rtn(w, dim).to(torch.bfloat16)
    assert torch.equal(stochastic_round_e4m3(grid, dim, gen), grid)  # values on the grid stay


@pytest.mark.slow
@pytest.mark.parametrize("dim", [-2, -1])
def test_kernel_rounds_each_element_to_a_neighbour_in_any_layout(dim, monkeypatch):
    """The Triton pass on the experts' operand, a transposed [E, K, N] view: each value is the grid value below or
    above w * scale (over the scale), with the probability that keeps the mean; the result keeps w's strides."""
    g = torch.Generator().manual_seed(13)
    w_ENK = (torch.randn(3, 24, 40, generator=g) * 0.02).to(torch.bfloat16)
    w_ENK[1, 2] *= 50  # one large row of expert 1
    w_EKN = _on_triton(w_ENK, monkeypatch).transpose(-2, -1)
    draws = [stochastic_round_e4m3(w_EKN, dim, g) for _ in range(300)]
    assert draws[0].shape == w_EKN.shape and draws[0].stride() == w_EKN.stride()
    d = torch.stack(draws).float().cpu()
    w = w_EKN.float().cpu()
    scale = fp8_scale(w.abs().amax(dim=dim, keepdim=True))
    a = (w * scale).abs()
    spacing = torch.exp2(torch.floor(torch.log2(a.clamp(min=2.0 ** -9)))).mul(2.0 ** -3).clamp(min=2.0 ** -9)
    below = torch.floor(a / spacing) * spacing
    above = torch.where(below == a, below, below + spacing)
    got = (d * scale).abs()
    assert bool(((got == below) | (got == above)).all())
    p_up = (a - below) / spacing
    freq_up = (got == above).float().mean(0) - (above == below).float()  # draws that went up (grid values: 0)
    assert (freq_up - p_up).abs().mean() < 0.03  # 300 draws: ~0.018 of noise; round-to-nearest: ~0.25
    assert torch.equal(ff._qdq_along(draws[0].float(), dim), draws[0].float())  # on the cast's grid


def test_same_seed_same_draw_and_the_module_generator_follows_the_global_seed():
    w = _weight(2)
    a = stochastic_round_e4m3(w, -1, torch.Generator().manual_seed(5))
    assert torch.equal(a, stochastic_round_e4m3(w, -1, torch.Generator().manual_seed(5)))
    fp8_stochastic._GENERATORS.clear()
    torch.manual_seed(11)
    b = stochastic_round_e4m3(w, -1)
    fp8_stochastic._GENERATORS.clear()
    torch.manual_seed(11)
    assert torch.equal(b, stochastic_round_e4m3(w, -1)) and not torch.equal(b, stochastic_round_e4m3(w, -1))


def test_linear_product_is_unbiased_over_draws_where_nearest_is_not():
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    w = _weight(4).float()
    xq = _rtn(x, -1)
    exact = xq @ w.t()  # the product with the quantized x and the unrounded weight
    nearest = fl.fp8_linear(x, w, recipe="rowwise", emulate=True)
    sr = torch.stack([fl.fp8_linear(x, w, recipe="rowwise", emulate=True, sr_weights=True) for _ in range(400)])
    assert torch.allclose(nearest, xq @ _rtn(w, -1).t(), rtol=1e-5, atol=1e-6)
    err_nearest = (nearest - exact).pow(2).mean().sqrt()
    err_mean_sr = (sr.mean(0) - exact).pow(2).mean().sqrt()
    assert err_mean_sr < 0.2 * err_nearest  # the draws average out; nearest's error does not
    with pytest.raises(ValueError, match="recipe='rowwise' only"):
        fl.fp8_linear(x, w, recipe="tensorwise", emulate=True, sr_weights=True)


def test_experts_grouped_product_is_unbiased_over_draws_where_nearest_is_not():
    g = torch.Generator().manual_seed(12)
    E, K, N = 3, 64, 48
    offs = torch.tensor([16, 48, 64], dtype=torch.int32)  # 16-aligned groups (the FP8 grouped GEMM's rule)
    x = torch.randn(64, K, generator=g)
    w_ENK = (torch.randn(E, N, K, generator=g) * 0.02)
    w_EKN = w_ENK.transpose(-2, -1)  # the experts' operand: a column-major view
    ops = ff._Ops(emulate=True, sr_weights=True)
    fwd, dgrad = ops.w_fwd(w_EKN)[0], ops.w_dgrad(w_EKN)[0]
    assert fwd.shape == (E, K, N) and dgrad.shape == (E, N, K)
    assert torch.equal(fwd, ff._qdq_along(fwd, -2)) and torch.equal(dgrad, ff._qdq_along(dgrad, -1))  # on the grids
    xq = ff._qdq_along(x, -1)
    exact = torch._grouped_mm(xq, w_EKN, offs=offs)
    nearest = ff.fp8_rowwise_grouped_mm(x, w_EKN, offs, emulate=True)
    draws = torch.stack([ff.fp8_rowwise_grouped_mm(x, w_EKN, offs, emulate=True, sr_weights=True)
                         for _ in range(300)])
    err_nearest = (nearest - exact).pow(2).mean().sqrt()
    assert (draws.mean(0) - exact).pow(2).mean().sqrt() < 0.25 * err_nearest
    with pytest.raises(ValueError, match="rowwise grouped GEMM"):
        LowPrecisionGroupedMM("fp8_tensorwise", True, sr_weights=True)
    assert "sr_weights=True" in repr(LowPrecisionGroupedMM("fp8_rowwise", True, sr_weights=True))


def test_one_draw_per_optimizer_step_with_the_weight_cache():
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(6))
    w = _weight(7).float()
    cache = Fp8WeightCache()
    y1 = fl.fp8_linear(x, w, recipe="rowwise", emulate=True, sr_weights=True, weight_cache=cache)
    y2 = fl.fp8_linear(x, w, recipe="rowwise", emulate=True, sr_weights=True, weight_cache=cache)
    assert torch.equal(y1, y2) and cache.hits == 1
    _next_generation(None, (), {})  # what an optimizer step does
    y3 = fl.fp8_linear(x, w, recipe="rowwise", emulate=True, sr_weights=True, weight_cache=cache)
    assert not torch.equal(y1, y3)


def _assert_kernel_operands_are_the_draws(w: torch.Tensor) -> None:
    """The linear's FP8 weight operands (forward per row, input gradient per column) dequantize to exactly the
    stochastic rounding of the same generator state: the cast after it rounds nothing."""
    ops = fl._Ops("rowwise", emulate=False, sr_weights=True)
    for layout, dim in (("fwd", -1), ("dgrad", 0)):
        fp8_stochastic._GENERATORS.clear()
        torch.manual_seed(21)
        q, s = ops.w_fwd(w) if layout == "fwd" else ops.w_dgrad(w)
        fp8_stochastic._GENERATORS.clear()
        torch.manual_seed(21)
        want = stochastic_round_e4m3(w, dim).float()
        got = q.float() * (s.reshape(-1, 1) if layout == "fwd" else s.reshape(1, -1))
        assert torch.equal(got, want), layout


def test_triton_casts_quantize_the_rounded_weight_exactly(monkeypatch):
    _assert_kernel_operands_are_the_draws(_on_triton(_weight(8), monkeypatch))


def test_callback_wires_it_and_refuses_what_would_round_to_nearest():
    cfg = _config(recipe="fp8_rowwise")
    ids = tokens(cfg)
    base = reference_model(cfg)
    model = copy.deepcopy(base)
    cb = LowPrecisionTraining("fp8_rowwise", emulate=True, stochastic_weights=True)
    assert "stochastic_weights=True" in repr(cb)
    cb.transform_model(model)
    linears = [m for m in model.modules() if isinstance(m, fl.Fp8Linear)]
    assert linears and all(m.lowp_sr_weights for m in linears) and "sr_weights" in repr(linears[0])
    grouped = [m.grouped_mm for m in model.modules() if isinstance(getattr(m, "grouped_mm", None),
                                                                  LowPrecisionGroupedMM)]
    assert grouped and all(gm.sr_weights and gm._numerics()["sr_weights"] for gm in grouped)
    experts_only = copy.deepcopy(base)
    LowPrecisionTraining("fp8_rowwise", emulate=True, dense=False, stochastic_weights=True).transform_model(experts_only)
    assert not any(isinstance(m, fl.Fp8Linear) for m in experts_only.modules())
    plain = copy.deepcopy(base)
    LowPrecisionTraining("fp8_rowwise", emulate=True).transform_model(plain)
    a, b = step(model, ids), step(plain, ids)
    assert all(torch.isfinite(torch.tensor(a["losses"])))
    assert a["losses"] != b["losses"]  # the draws differ from the nearest values
    for kw in ({"recipe": "fp8_tensorwise"}, {"recipe": "fp8_blockwise"},
               {"recipe": "fp8_rowwise", "fused_dense": False}, {"recipe": "auto"}):
        with pytest.raises(ValueError, match="stochastically rounded weights"):
            LowPrecisionTraining(stochastic_weights=True, emulate=True, **kw)
    compiled = LowPrecisionTraining("fp8_rowwise", emulate=True, stochastic_weights=True)
    compiled._compile_regions = ("attention",)  # what MoEParallelStrategy(compile=True) tells setup()
    with pytest.raises(ValueError, match="would run torchao's Float8Linear"):
        compiled.transform_model(copy.deepcopy(base))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the FP8 kernels need an sm90+ GPU")
def test_kernels_quantize_the_rounded_weight_exactly_on_gpu():
    w = _weight(9, shape=(512, 1024)).cuda()
    _assert_kernel_operands_are_the_draws(w)
    w_EKN = _weight(10, shape=(4 * 256, 512)).cuda().reshape(4, 256, 512).transpose(-2, -1)  # [E, K, N] view
    kern, emul = ff._Ops(emulate=False, sr_weights=True), ff._Ops(emulate=True, sr_weights=True)
    for make in ("w_fwd", "w_dgrad"):
        fp8_stochastic._GENERATORS.clear()
        torch.manual_seed(41)
        q, sc = getattr(kern, make)(w_EKN)
        fp8_stochastic._GENERATORS.clear()
        torch.manual_seed(41)
        want = getattr(emul, make)(w_EKN)[0]
        assert torch.equal(q.float() * sc[:, None, :], want), make  # torchao's casts round nothing further
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wp = w.clone().requires_grad_()
    y = fl.fp8_linear(x, wp, recipe="rowwise", emulate=False, sr_weights=True)
    y.float().square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all() and torch.isfinite(wp.grad).all()
