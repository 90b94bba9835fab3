"""The ``fp8_rowwise_gw_hp`` recipe: ``fp8_rowwise`` with the weight gradients as high-precision GEMMs (dense: our
eager linear's ``wgrad_hp``; experts: ``fp8_fused._Ops(wgrad_hp=True)``, fused and unfused) and the experts' input
gradients without fast accumulation. Checked in emulation (CPU; the Triton kernels under the interpreter) against
the plain rowwise path, whose forward and input gradients it keeps, and against fp32 products for the weight
gradients it changes."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels.py imports it on first use)

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.callbacks.low_precision import GW_HP, LowPrecisionGroupedMM, LowPrecisionTraining
from lightning_moe.config import ModelConfig, MoEConfig
from lightning_moe.lowp import fp8_linear as fl
from lightning_moe.lowp.fp8_fused import fp8_rowwise_grouped_mm
from lightning_moe.lowp.fp8_grouped import emulated_fp8_rowwise_grouped_mm, pad_groups
from lightning_moe.moe import kernels
from lightning_moe.moe.layer import MoELayer

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
SIZES = [[5, 0, 13, 3], [16, 16, 0, 32], [1, 2, 3, 40]]


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def _grads(fn, *leaves, dy):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.fixture(params=["torch", pytest.param("triton", marks=needs_triton)])
def backend(request, monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, request.param)
    return request.param


def test_dense_wgrad_hp_keeps_forward_and_dgrad_and_makes_dw_exact():
    torch.manual_seed(0)
    M, K, N = 40, 64, 48
    x, w, dy = torch.randn(M, K) * torch.logspace(-3, 0, M)[:, None], torch.randn(N, K) * 0.1, torch.randn(M, N)
    plain = _grads(lambda x, w: fl.fp8_linear(x, w, recipe="rowwise", emulate=True), x, w, dy=dy)
    hp = _grads(lambda x, w: fl.fp8_linear(x, w, recipe="rowwise", emulate=True, wgrad_hp=True), x, w, dy=dy)
    assert torch.equal(hp[0], plain[0]) and torch.equal(hp[1], plain[1])  # forward and dgrad: the same FP8 GEMMs
    exact = dy.t() @ x
    assert _rel(hp[2], exact) <= 1e-6 < 1e-3 < _rel(plain[2], exact)
    # the kernel path (torch._scaled_mm; a plain GEMM for dw) equals the emulation to bf16 rounding
    bf = [t.bfloat16() for t in (x, w, dy)]
    real = _grads(lambda x, w: fl.fp8_linear(x, w, recipe="rowwise", emulate=False, wgrad_hp=True), *bf[:2], dy=bf[2])
    emu = _grads(lambda x, w: fl.fp8_linear(x, w, recipe="rowwise", emulate=True, wgrad_hp=True), *bf[:2], dy=bf[2])
    for a, b in zip(real, emu):
        assert a.dtype == torch.bfloat16 and _rel(a, b) <= 1e-2
    with pytest.raises(ValueError, match="rowwise"):
        fl.fp8_linear(x, w, recipe="tensorwise", emulate=True, wgrad_hp=True)


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_pieces_equal_the_reference_and_wgrad_hp_is_exact(sizes):
    """``fp8_rowwise_grouped_mm`` with the defaults is the reference emulation of torchao's rowwise grouped GEMM;
    with ``wgrad_hp`` its forward and dx are unchanged and dw is the fp32 grouped product."""
    torch.manual_seed(1)
    E, K, N = len(sizes), 32, 48
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x_MK = torch.randn(int(offs[-1]), K) * torch.logspace(-2, 1, int(offs[-1]))[:, None]
    w_EKN, dy = torch.randn(E, K, N) * 0.1, torch.randn(int(offs[-1]), N)
    ref = _grads(lambda x, w: emulated_fp8_rowwise_grouped_mm(x, w, offs), x_MK, w_EKN, dy=dy)
    ours = _grads(lambda x, w: fp8_rowwise_grouped_mm(x, w, offs, emulate=True), x_MK, w_EKN, dy=dy)
    hp = _grads(lambda x, w: fp8_rowwise_grouped_mm(x, w, offs, emulate=True, wgrad_hp=True), x_MK, w_EKN, dy=dy)
    for a, b in zip(ours, ref):
        assert _rel(a, b) <= 1e-6
    assert torch.equal(hp[0], ours[0]) and torch.equal(hp[1], ours[1])
    exact = torch._grouped_mm(x_MK.t(), dy, offs=offs)
    assert _rel(hp[2], exact) <= 1e-6 < 1e-3 < _rel(ours[2], exact)


def _layer(recipe, fuse, D=32, Fh=48):
    torch.manual_seed(5)
    layer = MoELayer(MoEConfig(num_experts=4, top_k=2, expert_hidden_size=Fh), D)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.normal_(0.0, 0.3)
    if recipe is not None:
        layer.replan(grouped_mm=LowPrecisionGroupedMM(recipe, emulate=True, fuse=fuse, cache_weights=fuse))
    return layer


def _layer_grads(layer, x):
    xi = x.detach().clone().requires_grad_()
    y = layer(xi)
    y.square().sum().backward()
    return [y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.slow  # ~6 CPU s with the Triton interpreter
def test_layer_gw_hp_fused_equals_unfused_and_only_weight_grads_change(backend):
    x = torch.randn(2, 12, 32)
    fused, unfused, plain = (_layer(GW_HP, True), _layer(GW_HP, False), _layer("fp8_rowwise", True))
    assert fused.plan.fp8_fused and not unfused.plan.fp8_fused
    gmm = fused.experts.grouped_mm
    assert gmm.wgrad_hp and not gmm.bwd_fast_accum and gmm.fwd_fast_accum and not plain.experts.grouped_mm.wgrad_hp
    a, b, c = _layer_grads(fused, x), _layer_grads(unfused, x), _layer_grads(plain, x)
    for t, ref in zip(a, b):
        assert _rel(t, ref) <= 2e-5
    names = ["y", "x"] + [n for n, _ in fused.named_parameters()]
    for name, t, ref in zip(names, a, c):
        if name.startswith("experts.w"):  # the expert weights' gradients: the high-precision products
            assert _rel(t, ref) > 1e-3, name
        elif name in ("y",):
            assert torch.equal(t, ref)


def _tiny():
    from lightning_moe.models.transformer import MoETransformer

    torch.manual_seed(0)
    return MoETransformer(ModelConfig.from_preset("tiny", num_layers=2))


def test_callback_wires_gw_hp_with_the_forward_of_fp8_rowwise():
    """Every dense linear is our eager linear with ``wgrad_hp``, the attention norm still quantizes for the
    projections, the experts run the fused path with the hp numerics, torchao's linear (fused_dense=False) gets
    its ``rowwise_with_gw_hp`` config; the loss is ``fp8_rowwise``'s bit for bit (the same forward), the weight
    gradients are not."""
    from lightning_moe.lowp.fp8_linear import Fp8Linear, Fp8QuantRMSNorm

    tokens = torch.randint(0, 100, (2, 32))
    out = {}
    for recipe in ("fp8_rowwise", GW_HP):
        model = _tiny()
        cb = LowPrecisionTraining(recipe, emulate=True)
        cb.device = torch.device("cpu")
        cb.transform_model(model)
        att, last = model.layers["0"].attention, str(len(model.layers) - 1)
        assert isinstance(att.wq, Fp8Linear) and att.wq.lowp_wgrad_hp == (recipe == GW_HP)
        assert isinstance(model.layers["0"].attention_norm, Fp8QuantRMSNorm)
        gmm = model.layers[last].moe.experts.grouped_mm
        assert gmm.fused_fp8 and gmm.wgrad_hp == (recipe == GW_HP)
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        out[recipe] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert torch.equal(out[GW_HP][0], out["fp8_rowwise"][0])
    for name in ("layers.0.attention.wq.weight", f"layers.{last}.moe.experts.w2"):
        assert _rel(out[GW_HP][1][name], out["fp8_rowwise"][1][name]) > 1e-3, name
    torchao_model = _tiny()
    cb = LowPrecisionTraining(GW_HP, emulate=True, fused_dense=False, experts=False)
    cb.device = torch.device("cpu")
    pytest.importorskip("torchao.float8", reason="torchao's linear is the fused_dense=False path (ao extra)")
    cb.transform_model(torchao_model)
    wq = torchao_model.layers["0"].attention.wq
    assert type(wq).__name__ == "Float8Linear"
    assert wq.config.cast_config_grad_output_for_grad_weight.scaling_type.name == "DISABLED"


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_dense_dgrad_hp_keeps_forward_and_wgrad_and_makes_dx_exact(recipe):
    """``dgrad_hp``: the input gradient is the high-precision ``dy @ w``; the forward and the weight gradient are
    the plain recipe's bit for bit; with ``wgrad_hp`` too (rowwise) the whole backward is exact."""
    torch.manual_seed(1)
    M, K, N = 40, 64, 48
    x, w, dy = torch.randn(M, K), torch.randn(N, K) * 0.1, torch.randn(M, N) * torch.logspace(-3, 0, M)[:, None]
    plain = _grads(lambda x, w: fl.fp8_linear(x, w, recipe=recipe, emulate=True), x, w, dy=dy)
    hp = _grads(lambda x, w: fl.fp8_linear(x, w, recipe=recipe, emulate=True, dgrad_hp=True), x, w, dy=dy)
    assert torch.equal(hp[0], plain[0]) and torch.equal(hp[2], plain[2])
    exact = dy @ w
    assert _rel(hp[1], exact) <= 1e-6 < 1e-3 < _rel(plain[1], exact)
    if recipe == "rowwise":
        both = _grads(lambda x, w: fl.fp8_linear(x, w, recipe=recipe, emulate=True, dgrad_hp=True, wgrad_hp=True),
                      x, w, dy=dy)
        assert _rel(both[1], exact) <= 1e-6 and _rel(both[2], dy.t() @ x) <= 1e-6
        assert torch.equal(both[0], plain[0])  # FP8 in the forward only
    # the kernel path: a plain GEMM for dx, equal to the emulation to bf16 rounding
    bf = [t.bfloat16() for t in (x, w, dy)]
    real = _grads(lambda x, w: fl.fp8_linear(x, w, recipe=recipe, emulate=False, dgrad_hp=True), *bf[:2], dy=bf[2])
    emu = _grads(lambda x, w: fl.fp8_linear(x, w, recipe=recipe, emulate=True, dgrad_hp=True), *bf[:2], dy=bf[2])
    assert real[1].dtype == torch.bfloat16 and _rel(real[1], emu[1]) <= 1e-2


def test_callback_wires_dgrad_hp_into_both_dense_implementations():
    from lightning_moe.lowp.fp8_linear import Fp8Linear

    model = _tiny()
    cb = LowPrecisionTraining(GW_HP, emulate=True, dgrad_hp=True)
    cb.device = torch.device("cpu")
    cb.transform_model(model)
    wq = model.layers["0"].attention.wq
    assert isinstance(wq, Fp8Linear) and wq.lowp_dgrad_hp and wq.lowp_wgrad_hp and "dgrad_hp" in repr(wq)
    assert "dgrad_hp=True" in repr(cb)
    with pytest.raises(ValueError, match="dgrad_hp"):
        LowPrecisionTraining("fp8_blockwise", emulate=True, dgrad_hp=True)
    with pytest.raises(ValueError, match="dgrad_hp"):
        LowPrecisionTraining("fp8_rowwise", emulate=True, dense=False, dgrad_hp=True)
    pytest.importorskip("torchao.float8", reason="torchao's linear is the fused_dense=False path (ao extra)")
    torchao_model = _tiny()
    cb = LowPrecisionTraining("fp8_rowwise", emulate=True, fused_dense=False, experts=False, dgrad_hp=True)
    cb.device = torch.device("cpu")
    cb.transform_model(torchao_model)
    c = torchao_model.layers["0"].attention.wq.config
    assert c.cast_config_grad_output.scaling_type.name == "DISABLED"
    assert c.cast_config_weight_for_grad_input.scaling_type.name == "DISABLED"
    assert c.cast_config_grad_output_for_grad_weight.scaling_type.name == "DYNAMIC"  # the wgrad stays FP8
    # torchao's backward then runs: its dx is the exact dy @ w, its dw still quantized
    x = torch.randn(2, 32, torchao_model.config.hidden_size)
    lin = torchao_model.layers["0"].attention.wq
    xl = x.clone().requires_grad_()
    y = lin(xl)
    dy = torch.randn_like(y)
    y.backward(dy)
    exact = (dy.flatten(0, 1) @ lin.weight).reshape(x.shape)
    assert _rel(xl.grad, exact) <= 1e-5
