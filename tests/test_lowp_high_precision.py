"""``lightning_moe.lowp.high_precision``: inside the context every module LowPrecisionTraining swapped in runs the
high-precision program of the model it was made from (the same losses, gradients and routing, bit for bit, on CPU
where no fused kernel runs), outside it the quantized one again; the experts' fused steps' high-precision branches
against plain references; a model with torchao float8 linears (which the switch cannot reach) is refused."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

from _memory import assert_same, reference_model, step, tokens
from lightning_moe.callbacks import LowPrecisionTraining
from lightning_moe.callbacks.low_precision import RECIPES, LowPrecisionGroupedMM
from lightning_moe.lowp import high_precision as hp_mod
from lightning_moe.lowp.high_precision import high_precision, high_precision_active
from lightning_moe.moe import kernels
from test_low_precision import _config

pytest.importorskip("torchao.float8", reason="the fp8 dense linears use torchao (the ao extra)")

BLOCK = ("mxfp8", "nvfp4")


@pytest.mark.parametrize("recipe, backend", [(r, "auto") for r in RECIPES]
                         + [pytest.param("fp8_rowwise", "triton", marks=pytest.mark.slow)])  # ~16 s interpreted
def test_high_precision_runs_the_unconverted_program(recipe, backend, monkeypatch):
    # triton (the interpreter on CPU): the fused kernels, the experts' own row gather and its FP8 twin included
    monkeypatch.setenv(kernels.ENV_VAR, backend)
    if recipe in BLOCK:
        pytest.importorskip("lightning_moe.lowp.block_formats")
    cfg = _config(recipe=recipe)
    ids = tokens(cfg)
    base = reference_model(cfg)
    ref = step(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp8_blockwise's "experts are slow without DeepGEMM"
        LowPrecisionTraining(recipe, emulate=True).transform_model(model)
    quantized = step(copy.deepcopy(model), ids)
    assert abs(quantized["losses"][0] - ref["losses"][0]) > 1e-7 * abs(ref["losses"][0])  # the switch matters
    got = step(model, ids, forward_context=high_precision)
    assert_same(got, ref)
    assert not high_precision_active()
    again = step(copy.deepcopy(model), ids)  # closed: quantized again
    assert again["losses"] == quantized["losses"]


def test_contexts_nest_and_close_on_error():
    with high_precision():
        with high_precision():
            assert high_precision_active()
        assert high_precision_active()
    with pytest.raises(RuntimeError, match="boom"):
        with high_precision():
            raise RuntimeError("boom")
    assert not high_precision_active() and hp_mod._DEPTH[0] == 0


def _rows_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T, D, F, E, k = 6, 32, 48, 3, 2
    x_TD = torch.randn(T, D, generator=g, requires_grad=True)
    # R = 8 rows in expert order: a padding row (-1) in expert 1, expert 2 empty
    asg_R = torch.tensor([0, 5, 7, 2, -1, 11, 3, 8])
    pos_TK = torch.full((T, k), -1, dtype=torch.int32)  # each (token, choice)'s row, -1 where it has none
    for r, a in enumerate(asg_R.tolist()):
        if a >= 0:
            pos_TK[a // k, a % k] = r
    offs_E = torch.tensor([3, 8, 8], dtype=torch.int32)
    w1_EFD, w3_EFD = torch.randn(E, F, D, generator=g), torch.randn(E, F, D, generator=g)
    return x_TD, asg_R, pos_TK, offs_E, w1_EFD, w3_EFD


def test_fused_steps_high_precision_branches_are_the_plain_gemms(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "triton")  # the experts gather their own rows only with the row kernels
    gmm = LowPrecisionGroupedMM("fp8_rowwise", emulate=True)
    x_TD, asg_R, pos_TK, offs_E, w1_EFD, w3_EFD = _rows_case()
    rows_RD = torch.stack([x_TD[a // 2] if a >= 0 else torch.zeros(x_TD.shape[1]) for a in asg_R.tolist()])
    ref_g = torch._grouped_mm(rows_RD, w1_EFD.transpose(-2, -1), offs=offs_E)
    ref_u = torch._grouped_mm(rows_RD, w3_EFD.transpose(-2, -1), offs=offs_E)
    w1, w3 = w1_EFD.clone().requires_grad_(True), w3_EFD.clone().requires_grad_(True)
    with high_precision():
        g_RF, u_RF = gmm.gather_gate_up(x_TD, asg_R, pos_TK, w1.transpose(-2, -1), w3.transpose(-2, -1), offs_E)
    torch.testing.assert_close(g_RF, ref_g, rtol=0, atol=0)
    torch.testing.assert_close(u_RF, ref_u, rtol=0, atol=0)
    assert g_RF[4].abs().max() == 0  # the padding row
    dg, du = torch.randn_like(g_RF), torch.randn_like(u_RF)
    torch.autograd.backward([g_RF, u_RF], [dg, du])  # differentiable: each token's gradient from its rows
    ref_x = x_TD.detach().clone().requires_grad_(True)
    ref_w1, ref_w3 = w1_EFD.clone().requires_grad_(True), w3_EFD.clone().requires_grad_(True)
    rows = torch.stack([ref_x[a // 2] if a >= 0 else torch.zeros(ref_x.shape[1]) for a in asg_R.tolist()])
    torch.autograd.backward([torch._grouped_mm(rows, ref_w1.transpose(-2, -1), offs=offs_E),
                             torch._grouped_mm(rows, ref_w3.transpose(-2, -1), offs=offs_E)], [dg, du])
    for got, want in ((x_TD.grad, ref_x.grad), (w1.grad, ref_w1.grad), (w3.grad, ref_w3.grad)):
        torch.testing.assert_close(got, want)
    # the down projection: swiglu of (g, u) times the rows' weights, then the plain grouped GEMM
    probs_R = torch.rand(asg_R.shape[0])
    w2_EDF = torch.randn(3, 32, 48)
    with high_precision():
        y = gmm.swiglu_down(ref_g, ref_u, probs_R, w2_EDF.transpose(-2, -1), offs_E)
    h = torch.nn.functional.silu(ref_g) * ref_u * probs_R[:, None]
    torch.testing.assert_close(y, torch._grouped_mm(h, w2_EDF.transpose(-2, -1), offs=offs_E))
    quantized = gmm.swiglu_down(ref_g, ref_u, probs_R, w2_EDF.transpose(-2, -1), offs_E)
    assert not torch.allclose(quantized, y)  # outside the context the FP8 step runs


def test_models_with_torchao_float8_linears_are_refused():
    float8 = importlib.import_module("torchao.float8")
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    float8.convert_to_float8_training(model)
    assert hp_mod.torchao_linears(model) == ["0", "2"]
    with pytest.raises(ValueError, match="2 torchao float8 linears .*0, 2.*compile=False"):
        with high_precision(model):
            pass
    assert not high_precision_active()
    with high_precision(nn.Sequential(nn.Linear(4, 4))):  # nothing of torchao's: fine
        assert high_precision_active()
