"""``LowPrecisionTraining(fast_accum=False)``: no FP8 GEMM uses Hopper's fast accumulation. The flag reaches every
FP8 GEMM call (our eager dense linear, the experts' fused and unfused grouped GEMMs, torchao's linear inside compiled
regions), the default keeps torchao's choice (forward fast; dense backward precise; experts' backward fast), and the
numbers of the emulation do not change (it accumulates in fp32 either way). The kernels' accuracy with the flag is
checked on an H200 (tests/test_fp8_fused_gpu.py)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels.py imports it on first use)

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.callbacks.low_precision import GW_HP, LowPrecisionGroupedMM, LowPrecisionTraining
from lightning_moe.config import ModelConfig
from lightning_moe.lowp import fp8_fused
from lightning_moe.lowp import fp8_linear as fl


class _Recorder:
    """Wraps a torch FP8 GEMM function: records each call's ``use_fast_accum`` and runs it (or ``fake``)."""

    def __init__(self, fn, fake=None):
        self.fn, self.fake, self.calls = fn, fake, []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs.get("use_fast_accum"))
        return (self.fake or self.fn)(*args, **kwargs)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("fast_accum", [True, False])
def test_dense_linear_passes_the_flag_to_its_forward_gemm_only(monkeypatch, recipe, fast_accum):
    """Three ``torch._scaled_mm`` calls per step (forward, dgrad, wgrad): the forward's fast accumulation follows the
    flag, the backward's is always off; the result is the emulation's to bf16 rounding either way."""
    rec = _Recorder(torch._scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", rec)
    torch.manual_seed(0)
    x, w = torch.randn(48, 64).bfloat16().requires_grad_(), (torch.randn(32, 64) * 0.1).bfloat16().requires_grad_()
    y = fl.fp8_linear(x, w, recipe=recipe, emulate=False, fast_accum=fast_accum)
    y.backward(torch.ones_like(y))
    assert rec.calls == [fast_accum, False, False]
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ye = fl.fp8_linear(xe, we, recipe=recipe, emulate=True, fast_accum=fast_accum)
    ye.backward(torch.ones_like(ye))
    assert len(rec.calls) == 3  # the emulation calls no FP8 GEMM
    for a, b in ((y, ye), (x.grad, xe.grad), (w.grad, we.grad)):
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= 1e-2


def _fake_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """``torch._scaled_grouped_mm``'s numbers on CPU (dequantized fp32 operands; it has no CPU kernel)."""
    sa = scale_a.float().reshape(-1, 1) if scale_a.dim() == 1 else scale_a.float()
    deq_b = b.float() * scale_b.float().reshape(b.shape[0], 1, b.shape[2])
    return torch._grouped_mm(a.float() * sa, deq_b, offs=offs).to(out_dtype)


@pytest.mark.parametrize("fwd,bwd", [(True, True), (False, True), (True, False), (False, False)])
def test_grouped_ops_route_the_flags_to_forward_and_backward_gemms(monkeypatch, fwd, bwd):
    """``fp8_fused._Ops.mm`` (a forward GEMM) and ``dgrad`` take their own flags: two 2D x 3D grouped GEMMs."""
    rec = _Recorder(torch._scaled_grouped_mm, fake=_fake_scaled_grouped_mm)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", rec)
    ops = fp8_fused._Ops(emulate=False, bwd_fast_accum=bwd, fwd_fast_accum=fwd)
    E, K, N, offs = 2, 32, 16, torch.tensor([16, 32], dtype=torch.int32)
    a = (torch.randn(32, K).to(fp8_fused.E4M3), torch.ones(32))
    b = (torch.randn(E, K, N).to(fp8_fused.E4M3), torch.ones(E, N))
    y = ops.mm(a, b, offs, torch.bfloat16)
    bt = (torch.randn(E, N, K).to(fp8_fused.E4M3), torch.ones(E, K))
    monkeypatch.setattr(ops, "rows", lambda t: (t.to(fp8_fused.E4M3), torch.ones(t.shape[0])))
    dx = ops.dgrad(torch.randn(32, N), bt, offs, torch.bfloat16)
    assert rec.calls == [fwd, bwd] and y.shape == (32, N) and dx.shape == (32, K)


def test_grouped_mm_numerics_and_the_unfused_route(monkeypatch):
    """``fast_accum=False`` turns both of the experts' flags off (gw_hp's backward is precise already); the unfused
    path then runs our ``fp8_rowwise_grouped_mm`` with those flags (torchao's function has fast accumulation
    everywhere), and only then."""
    seen = []

    def spy(x, w, offs, **kw):
        seen.append(kw)
        return torch._grouped_mm(x, w, offs=offs)

    monkeypatch.setattr(fp8_fused, "fp8_rowwise_grouped_mm", spy)
    x, w, offs = torch.randn(32, 16), torch.randn(2, 16, 32), torch.tensor([16, 32], dtype=torch.int32)
    expect = {("fp8_rowwise", True): None, ("fp8_rowwise", False): (False, False, False),
              (GW_HP, True): (True, False, True), (GW_HP, False): (True, False, False)}
    for (recipe, fast), flags in expect.items():
        seen.clear()
        gmm = LowPrecisionGroupedMM(recipe, emulate=True, fuse=False, fast_accum=fast)
        assert (gmm.wgrad_hp, gmm.bwd_fast_accum, gmm.fwd_fast_accum) == (flags or (False, True, True))
        assert ("fast_accum=False" in repr(gmm)) == (not fast)
        gmm(x, w, offs)
        if flags is None:  # torchao's numbers: its function (here emulated), not ours
            assert seen == []
        else:
            assert seen == [{"emulate": True, "wgrad_hp": flags[0], "bwd_fast_accum": flags[1],
                             "fwd_fast_accum": flags[2], "sr_weights": False}]
    seen.clear()  # stochastically rounded weights: numerics torchao's function lacks, so ours runs
    LowPrecisionGroupedMM("fp8_rowwise", emulate=True, fuse=False, sr_weights=True)(x, w, offs)
    assert seen == [{"emulate": True, "wgrad_hp": False, "bwd_fast_accum": True, "fwd_fast_accum": True,
                     "sr_weights": True}]


def _tiny():
    from lightning_moe.models.transformer import MoETransformer

    torch.manual_seed(0)
    return MoETransformer(ModelConfig.from_preset("tiny", num_layers=2))


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
def test_callback_sets_the_flag_on_every_fp8_gemm_and_leaves_the_emulated_loss(recipe):
    """Every swapped dense linear and every experts' GEMM carries the flag; under emulation the loss and the
    gradients are those of the default, bit for bit (fp32 products either way)."""
    from lightning_moe.lowp.fp8_linear import Fp8Linear

    tokens = torch.randint(0, 100, (2, 32))
    out = {}
    for fast in (True, False):
        model = _tiny()
        cb = LowPrecisionTraining(recipe, emulate=True, fast_accum=fast)
        assert ("fast_accum=False" in repr(cb)) == (not fast)
        cb.device = torch.device("cpu")
        cb.transform_model(model)
        linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        experts = [m.experts.grouped_mm for m in model.modules() if hasattr(m, "experts")]
        assert linears and experts
        assert all(m.lowp_fast_accum == fast for m in linears)
        assert all(g.fwd_fast_accum == fast and g.bwd_fast_accum == fast for g in experts)
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        out[fast] = loss.detach(), [p.grad for p in model.parameters()]
    assert torch.equal(out[True][0], out[False][0])
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))


def test_torchao_linear_gets_a_precise_forward_gemm():
    """Where torchao's ``Float8Linear`` runs (``fused_dense=False``; compiled regions), ``fast_accum=False`` turns
    off the one fast-accumulating GEMM of its config, the forward's, and leaves the rest of the recipe."""
    pytest.importorskip("torchao.float8", reason="torchao's linear is the fused_dense=False path (ao extra)")
    configs = {}
    for fast in (True, False):
        model = _tiny()
        cb = LowPrecisionTraining("fp8_rowwise", emulate=True, fused_dense=False, experts=False, fast_accum=fast)
        cb.device = torch.device("cpu")
        cb.transform_model(model)
        wq = model.layers["0"].attention.wq
        assert type(wq).__name__ == "Float8Linear"
        configs[fast] = wq.config
    assert configs[True].gemm_config_output.use_fast_accum
    assert not configs[False].gemm_config_output.use_fast_accum
    for field in ("gemm_config_grad_input", "gemm_config_grad_weight", "cast_config_input", "cast_config_weight"):
        assert getattr(configs[True], field) == getattr(configs[False], field), field
