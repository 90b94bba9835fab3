"""Fused Triton kernels (lightning_moe.moe.kernels) against formulas written here and against the PyTorch path.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is first imported, which
kernels.py does lazily). Kernel tests skip only when triton does not import; the switch tests always run.
bench/kernels_check.py runs the same comparisons at full size on a GPU.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels.py imports it on first use)

import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.config import MoEConfig
from lightning_moe.moe import kernels
from lightning_moe.moe.dispatch.rows import _PermuteRows, _UnpermuteRows
from lightning_moe.moe import experts as experts_mod
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.record import MoERecorder

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (T, k, D, dropped assignments, padding rows): k = 1, T = 1, T = 0, zero rows (all dropped), odd D, D > BLOCK_D
CASES = [
    (9, 4, 48, 0, 0),
    (9, 4, 37, 5, 0),
    (9, 4, 130, 3, 4),
    (7, 1, 33, 2, 2),
    (1, 1, 16, 0, 0),
    (1, 3, 24, 0, 2),
    (6, 2, 20, 12, 0),
    (0, 2, 16, 0, 3),
    (5, 2, 1100, 1, 1),
]
BF16 = dict(rtol=1.6e-2, atol=1e-2)


@pytest.fixture
def triton_kernels(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "triton")


def _maps(T, k, n_drop, n_pad, seed=0):
    """pos [T, k] (row of each assignment, -1 dropped) and asg [R] (assignment of each row, -1 padding), shuffled."""
    gen = torch.Generator().manual_seed(seed)
    A = T * k
    kept = torch.randperm(A, generator=gen)[: A - n_drop]
    R = kept.numel() + n_pad
    rows = torch.randperm(R, generator=gen)[: kept.numel()]
    pos = torch.full((A,), -1, dtype=torch.long)
    pos[kept] = rows
    asg = torch.full((R,), -1, dtype=torch.long)
    asg[rows] = kept
    return pos.view(T, k), asg


def _combine_ref(y, w, pos):
    """out[t] = sum_k w[t, k] * y[pos[t, k]] over pos >= 0."""
    T, k = pos.shape
    if y.shape[0] == 0:
        return y.new_zeros(T, y.shape[1]) + 0 * w.sum() + 0 * y.sum()
    G = y[pos.clamp(min=0).reshape(-1)].view(T, k, y.shape[1])
    return torch.where((pos >= 0).unsqueeze(-1), w.unsqueeze(-1) * G, 0).sum(1)


def _permute_ref(x, asg, k):
    """rows[r] = x[asg[r] // k] (asg < 0: zero)."""
    if x.shape[0] == 0:
        return x.new_zeros(asg.shape[0], x.shape[1]) + 0 * x.sum()
    return torch.where((asg >= 0).unsqueeze(-1), x[asg.clamp(min=0) // k], 0)


def _unpermute(y, w, pos, asg):
    return _UnpermuteRows.apply(y, w, pos, asg, bool((pos < 0).any()), bool((asg >= 0).all()))


def _permute(x, pos, asg):
    return _PermuteRows.apply(x, asg, pos, bool((pos < 0).any()), bool((asg >= 0).all()))


def _assert_close_to_scale(a, b, rel):
    """max |a - b| <= rel * max |b|: for sums with cancellation, where elementwise relative errors mean little."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert (a - b).abs().max() <= rel * b.abs().max().clamp(min=1e-30), (a - b).abs().max()


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


# ---- switch ----------------------------------------------------------------------------------------------------------


def test_switch_values(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.backend() == "auto" and not kernels.use_triton(cpu)  # CPU runs the reference by default
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert not kernels.use_triton(cpu)
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="LIGHTNING_MOE_KERNELS='cuda'"):
        kernels.use_triton(cpu)


def test_triton_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels, "_import_triton", lambda: (None, "ModuleNotFoundError: No module named 'triton'"))
    monkeypatch.setenv(kernels.ENV_VAR, "auto")
    assert not kernels.use_triton(torch.zeros(1))
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match="triton does not import"):
        kernels.use_triton(torch.zeros(1))
    layer = MoELayer(MoEConfig(num_experts=4, top_k=2, expert_hidden_size=8), 8)
    with pytest.raises(RuntimeError, match="LIGHTNING_MOE_KERNELS=torch"):
        layer(torch.randn(1, 3, 8))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels, "_import_triton", lambda: (SimpleNamespace(INTERPRET=False), None))
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.use_triton(torch.zeros(1))


@needs_triton
def test_interpreter_is_on():
    mod, err = kernels._import_triton()
    assert err is None and mod.INTERPRET, "triton was imported before TRITON_INTERPRET=1 was set"


# ---- combine (unpermute) ---------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("T,k,D,n_drop,n_pad", CASES)
def test_combine_fp32(triton_kernels, monkeypatch, T, k, D, n_drop, n_pad):
    pos, asg = _maps(T, k, n_drop, n_pad)
    torch.manual_seed(1)
    y, w = torch.randn(asg.shape[0], D), torch.rand(T, k)
    g = torch.randn(T, D)
    y1, w1 = _leaves(y, w)
    out = _unpermute(y1, w1, pos, asg)
    assert out.grad_fn.fused  # the autograd node is the function's ctx
    out.backward(g)
    y2, w2 = _leaves(y.double(), w.double())
    ref = _combine_ref(y2, w2, pos)
    ref.backward(g.double())
    tol = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref.float(), **tol)
    torch.testing.assert_close(y1.grad, y2.grad.float(), **tol)
    torch.testing.assert_close(w1.grad, w2.grad.float(), **tol)
    # the PyTorch path agrees too (to its own fp32 rounding)
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    y3, w3 = _leaves(y, w)
    out3 = _unpermute(y3, w3, pos, asg)
    out3.backward(g)
    for a, b in ((out, out3), (y1.grad, y3.grad), (w1.grad, w3.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("T,k,D,n_drop,n_pad", [CASES[2], CASES[3], CASES[8]])
def test_combine_bf16(triton_kernels, monkeypatch, T, k, D, n_drop, n_pad):
    """bf16 rows, fp32 weights: fp32 math against an fp64 reference of the same (rounded) inputs."""
    pos, asg = _maps(T, k, n_drop, n_pad)
    torch.manual_seed(2)
    y, w = torch.randn(asg.shape[0], D).bfloat16(), torch.rand(T, k)
    g = torch.randn(T, D).bfloat16()
    y1, w1 = _leaves(y, w)
    out = _unpermute(y1, w1, pos, asg)
    out.backward(g)
    assert out.dtype == y1.grad.dtype == torch.bfloat16 and w1.grad.dtype == torch.float32
    y2, w2 = _leaves(y.double(), w.double())
    ref = _combine_ref(y2, w2, pos)
    ref.backward(g.double())
    torch.testing.assert_close(out.double(), ref, **BF16)
    torch.testing.assert_close(y1.grad.double(), y2.grad, **BF16)
    torch.testing.assert_close(w1.grad.double(), w2.grad, rtol=1e-5, atol=1e-5)  # fp32 dot of exact products
    # the fp32 k-sum rounds once: within one bf16 ulp of the exact sum (Triton's interpreter rounds fp32 -> bf16
    # towards zero, a GPU to nearest: half an ulp there, which bench/kernels_check.py checks)
    assert ((out.double() - ref).abs() <= ref.abs() * 2.0**-7 + 1e-30).all()


# ---- permute -------------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("T,k,D,n_drop,n_pad", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute(triton_kernels, T, k, D, n_drop, n_pad, dtype):
    pos, asg = _maps(T, k, n_drop, n_pad, seed=3)
    torch.manual_seed(3)
    x = torch.randn(T, D).to(dtype)
    g = torch.randn(asg.shape[0], D).to(dtype)
    (x1,) = _leaves(x)
    rows = _permute(x1, pos, asg)
    assert rows.grad_fn.fused
    rows.backward(g)
    (x2,) = _leaves(x.double())
    ref = _permute_ref(x2, asg, k)
    ref.backward(g.double())
    assert rows.dtype == x1.grad.dtype == dtype
    torch.testing.assert_close(rows.double(), ref, rtol=0, atol=0)  # a copy
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else BF16
    torch.testing.assert_close(x1.grad.double(), x2.grad, **tol)


# ---- SwiGLU -------------------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (7, 37), (33, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(triton_kernels, shape, dtype):
    torch.manual_seed(4)
    g, u, dh = (torch.randn(shape).mul(3).to(dtype) for _ in range(3))
    g1, u1 = _leaves(g, u)
    h = kernels.swiglu(g1, u1)
    assert h.grad_fn is not None and "SwiGLU" in type(h.grad_fn).__name__  # the fused path ran
    h.backward(dh)
    g2, u2 = _leaves(g.double(), u.double())
    ref = F.silu(g2) * u2
    ref.backward(dh.double())
    assert h.dtype == g1.grad.dtype == u1.grad.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else BF16
    for a, b in ((h, ref), (g1.grad, g2.grad), (u1.grad, u2.grad)):
        torch.testing.assert_close(a.double(), b, **tol)


@needs_triton
@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (7, 37), (33, 130), (5, 2100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_with_row_weights(triton_kernels, shape, dtype):
    """silu(g) * u * p[:, None] and its three gradients (dp a row sum in fp32) against float64 autograd."""
    torch.manual_seed(6)
    g, u, dh = (torch.randn(shape).mul(3).to(dtype) for _ in range(3))
    p = torch.rand(shape[0])
    g1, u1, p1 = _leaves(g, u, p)
    h = kernels.swiglu(g1, u1, p1)
    assert "SwiGLUProbs" in type(h.grad_fn).__name__  # the fused path ran
    h.backward(dh)
    g2, u2, p2 = _leaves(g.double(), u.double(), p.double())
    ref = F.silu(g2) * u2 * p2.unsqueeze(1)
    ref.backward(dh.double())
    assert h.dtype == g1.grad.dtype == u1.grad.dtype == dtype and p1.grad.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else BF16
    for a, b in ((h, ref), (g1.grad, g2.grad), (u1.grad, u2.grad)):
        torch.testing.assert_close(a.double(), b, **tol)
    # dp sums F products of bf16 inputs in fp32: compare relative to the row's scale
    if shape[0]:
        _assert_close_to_scale(p1.grad.double(), p2.grad, 1e-5 if dtype == torch.float32 else 2e-2)
    # the reference expression (CPU / LIGHTNING_MOE_KERNELS=torch) agrees too
    torch.testing.assert_close(kernels.swiglu_reference(g, u, p).double(), ref.detach(), **tol)


@needs_triton
@pytest.mark.parametrize("shape", [(0, 8), (1, 16), (7, 37), (33, 130), (5, 2100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", [False, True])
def test_swiglu_quant_rowwise_matches_the_unfused_emulation(triton_kernels, shape, dtype, weights):
    """The fused SwiGLU + FP8 rowwise quantization: h bit for bit the unfused kernel's, and its quantization bit for
    bit the emulated FP8 rowwise recipe's (lightning_moe.lowp.fp8_grouped: torchao's power-of-2 scales), outlier and
    all-zero rows included."""
    from lightning_moe.lowp.fp8_grouped import _qdq_along, fp8_scale

    torch.manual_seed(8)
    g, u = (torch.randn(shape).mul(3).to(dtype) for _ in range(2))
    if shape[0] >= 7:
        g[1], u[2, 0] = 0.0, 3e4  # a zero row; an outlier
    p = torch.rand(shape[0]) if weights else None
    h, q, s = kernels.swiglu_quant_rowwise(g, u, p, q_dtype=torch.float32)
    assert h.dtype == dtype and q.shape == h.shape and s.shape == (shape[0],)
    assert torch.equal(h, kernels.swiglu(g, u, p).detach())  # the unfused kernel
    scale = fp8_scale(h.float().abs().amax(-1, keepdim=True)) if shape[0] else torch.ones(0, 1)
    assert torch.equal(s, (1.0 / scale).squeeze(-1))
    assert torch.equal(q, (h.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(q * s[:, None], _qdq_along(h, -1))  # what the emulated grouped GEMM multiplies
    # compiled on a GPU, stored as float8_e4m3fn: tests/test_fp8_blockwise.py (this module forces the interpreter)


# ---- the layer ------------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("cfg", [
    dict(),
    dict(capacity_factor=0.75),
    dict(capacity_factor=0.75, pad_to_capacity=True, shared_expert_hidden_size=24),
], ids=["dropless", "capacity", "padded+shared"])
def test_layer_triton_matches_torch(monkeypatch, cfg):
    """MoELayer: the same outputs, aux losses and gradients (input and every parameter) on both paths."""
    D = 24
    torch.manual_seed(5)
    layer = MoELayer(MoEConfig(num_experts=6, top_k=2, expert_hidden_size=40, **cfg), D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(2, 9, D)
    mod, used = kernels._kernels(), set()

    class Spy:  # records which kernels the layer launches
        def __getattr__(self, name):
            used.add(name)
            return getattr(mod, name)

    monkeypatch.setattr(kernels, "_kernels", Spy)
    gathered = []
    real_gate_up = experts_mod._GatherGateUp.apply
    monkeypatch.setattr(experts_mod._GatherGateUp, "apply",
                        lambda *a: gathered.append(1) or real_gate_up(*a))
    results = {}
    for name, regather in (("torch", True), ("triton", False), ("triton", True)):
        monkeypatch.setenv(kernels.ENV_VAR, name)
        layer.replan(regather_rows=regather)
        layer.zero_grad()
        (xi,) = _leaves(x)
        recorder = MoERecorder()
        y = layer(xi, recorder=recorder)
        (y.square().sum() + recorder.records[0].aux_loss).backward()
        results[name, regather] = [y, xi.grad] + [p.grad.clone() for p in layer.parameters()]
    # the combine weights go into the experts' SwiGLU: combine is a plain k-sum, its backward a gather
    assert used - {"INTERPRET"} == {"k_sum_kernel", "gather_rows_kernel", "swiglu_probs_fwd_kernel",
                                    "swiglu_probs_bwd_kernel"}
    assert len(gathered) == 1  # only the fused run with regather_rows took the gather-inside gate/up path
    for key in (("triton", False), ("triton", True)):
        for a, b in zip(results[key], results["torch", True]):
            _assert_close_to_scale(a, b, 1e-6)


@needs_triton
def test_layer_with_another_grouped_mm_keeps_every_gemm_on_it(monkeypatch):
    """With the fused kernels on one process, experts whose grouped GEMM is not torch's (low precision) do not take
    the gather-inside gate/up path, which calls torch._grouped_mm itself: all three GEMMs go through the
    implementation, forward and backward (the plan resolves regather_rows to False)."""
    from lightning_moe.moe.grouped_mm import TorchGroupedMM

    calls = []

    class Counting(TorchGroupedMM):  # torch's numbers, but not declared as torch's kernel
        exact_torch = False

        def __call__(self, x_MK, w_EKN, offs_E):
            calls.append(tuple(w_EKN.shape))
            return super().__call__(x_MK, w_EKN, offs_E)

    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    torch.manual_seed(5)
    layer = MoELayer(MoEConfig(num_experts=6, top_k=2, expert_hidden_size=40), 24)
    assert layer.plan.regather_rows and layer.experts.gathers_rows(torch.randn(3, 24))
    gathered = []
    real_gate_up = experts_mod._GatherGateUp.apply
    monkeypatch.setattr(experts_mod._GatherGateUp, "apply", lambda *a: gathered.append(1) or real_gate_up(*a))
    assert not layer.replan(grouped_mm=Counting()).regather_rows
    layer(torch.randn(2, 9, 24)).sum().backward()
    assert not gathered and calls == [(6, 24, 40), (6, 24, 40), (6, 40, 24)]
