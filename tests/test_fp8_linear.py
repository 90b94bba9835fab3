"""The eager dense FP8 linear (lightning_moe.lowp.fp8_linear) against torchao's Float8Linear in emulation (the
numerics it reproduces), its FP8 GEMM calls on CPU (``torch._scaled_mm`` runs there too, with the CUDA layout
contract asserted), the tensorwise recipe's FP8 saved input, the input and weight caches, the RMSNorm that quantizes
its output (PyTorch reference and the Triton kernel under the interpreter), and the callback's wiring."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels.py imports it on first use)

import dataclasses
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.lowp import fp8_linear as fl
from lightning_moe.lowp.fp8_fused import Fp8WeightCache
from lightning_moe.lowp.fp8_grouped import quantize_rowwise
from lightning_moe.moe import kernels

torchao_float8 = pytest.importorskip("torchao.float8", reason="the reference is torchao's Float8Linear (ao extra)")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
M, K, N = 40, 64, 48  # M not a multiple of 16: the row padding of the kernel path runs


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def _torchao(w, recipe):
    lin = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype))
    lin[0].weight.data.copy_(w)
    cfg = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    torchao_float8.convert_to_float8_training(lin, config=cfg)
    return lin


def _run(fn, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", fl.LINEAR_RECIPES)
def test_emulation_is_torchaos_recipe(recipe):
    """Forward, input and weight gradients equal torchao's emulated Float8Linear of the same recipe (fp32 inputs: to
    fp32 rounding), and differ from the fp32 product (the quantization really happens)."""
    torch.manual_seed(0)
    x, w, dy = torch.randn(2, M // 2, K), torch.randn(N, K) * 0.1, torch.randn(2, M // 2, N)
    ours = _run(lambda x, w: fl.fp8_linear(x, w, recipe=recipe, emulate=True), x, w, dy)
    lin = _torchao(w, recipe)
    xr = x.clone().requires_grad_()
    yr = lin(xr)
    yr.backward(dy)
    for a, b in zip(ours, (yr.detach(), xr.grad, lin[0].weight.grad)):
        assert _rel(a, b) <= 1e-6
    assert _rel(ours[0], x @ w.t()) > 1e-3


@pytest.mark.parametrize("recipe", fl.LINEAR_RECIPES)
def test_fp8_gemm_calls_equal_the_emulation(recipe):
    """The kernel path (``torch._scaled_mm`` with real FP8 operands, its layout contract asserted; PyTorch quantizers
    off CUDA) equals the emulation: the same quantized values, fp32 accumulation, bf16 out."""
    torch.manual_seed(1)
    x, w, dy = torch.randn(M, K).bfloat16(), (torch.randn(N, K) * 0.1).bfloat16(), torch.randn(M, N).bfloat16()
    real = _run(lambda x, w: fl.fp8_linear(x, w, recipe=recipe, emulate=False), x, w, dy)
    emu = _run(lambda x, w: fl.fp8_linear(x, w, recipe=recipe, emulate=True), x, w, dy)
    for a, b in zip(real, emu):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert _rel(a, b) <= 1e-2  # bf16 outputs; the FP8 operands are identical


def test_tensorwise_saves_the_fp8_input():
    """tensorwise keeps the forward's FP8 x (1 byte per element) for the weight gradient, rowwise the bf16 x."""
    x, w = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True), torch.randn(N, K, dtype=torch.bfloat16,
                                                                                    requires_grad=True)
    saved = {r: fl.saved_input_bytes(lambda: fl.fp8_linear(x, w, recipe=r, emulate=False)) for r in fl.LINEAR_RECIPES}
    bf16_x, w_bytes = 48 * K * 2, N * K * 2  # x padded to 48 rows, and the weight itself
    assert saved["rowwise"] >= bf16_x + w_bytes
    assert saved["tensorwise"] < bf16_x // 2 + w_bytes + 64  # FP8 x and its scalar scale


def test_input_cache_quantizes_a_shared_input_once():
    """Three projections of one input: one quantization; a new tensor or an in-place change is not matched; the
    entry is dropped after its last consumer (no FP8 copy outlives the block)."""
    torch.manual_seed(2)
    cache = fl.Fp8InputCache(consumers=3)
    x = torch.randn(M, K)
    ws = [torch.randn(N, K) for _ in range(3)]
    ys = [fl.fp8_linear(x, w, recipe="rowwise", emulate=True, input_cache=cache) for w in ws]
    assert (cache.misses, cache.hits) == (1, 2) and cache._entry is None
    for y, w in zip(ys, ws):  # the shared quantization gives what each would have made alone
        assert torch.equal(y, fl.fp8_linear(x, w, recipe="rowwise", emulate=True))
    fl.fp8_linear(x, ws[0], recipe="rowwise", emulate=True, input_cache=cache)
    x.mul_(2)  # in place: a new version, not matched
    y = fl.fp8_linear(x, ws[1], recipe="rowwise", emulate=True, input_cache=cache)
    assert cache.misses == 3 and torch.equal(y, fl.fp8_linear(x, ws[1], recipe="rowwise", emulate=True))
    fl.fp8_linear(x.clone(), ws[2], recipe="rowwise", emulate=True, input_cache=cache)
    assert cache.misses == 4
    # an entry nobody reads (a norm recomputed in the backward) goes with its activation
    y = fl.fp8_rms_norm(torch.randn(M, K), torch.ones(K), 1e-6, emulate=True, input_cache=cache)
    assert cache._entry is not None
    del y
    assert cache._entry is None


def test_weight_cache_once_per_optimizer_step():
    lin = torch.nn.Linear(K, N, bias=False)
    cache = Fp8WeightCache()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for _ in range(2):  # two micro-batches: the forward weight made once, the dgrad one once
        fl.fp8_linear(torch.randn(M, K, requires_grad=True), lin.weight, recipe="rowwise", emulate=True,
                      weight_cache=cache).sum().backward()
    assert (cache.misses, cache.hits) == (2, 2)
    opt.step()
    fl.fp8_linear(torch.randn(M, K), lin.weight, recipe="rowwise", emulate=True, weight_cache=cache)
    assert cache.misses == 3


@pytest.fixture(params=["torch", pytest.param("triton", marks=needs_triton)])
def backend(request, monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, request.param)
    return request.param


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_rms_norm_quantizes_its_output(backend, dtypes):
    """y as the model's RMSNorm makes it; its FP8 form (left in the cache) bit for bit the rowwise quantization of y;
    gradients of x and of the weight those of F.rms_norm."""
    torch.manual_seed(3)
    x_dtype, w_dtype = dtypes
    x = torch.randn(M, K, dtype=x_dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(K, dtype=w_dtype)).requires_grad_()
    cache = fl.Fp8InputCache(consumers=1)
    y = fl.fp8_rms_norm(x, w, 1e-6, emulate=True, input_cache=cache)
    ref = fl._rms_norm(x, w, 1e-6)
    assert y.dtype == x_dtype and _rel(y, ref) <= (1e-6 if x_dtype == torch.float32 else 8e-3)
    q, s = quantize_rowwise(y.detach(), torch.float32)
    assert torch.equal(cache.read(y, "rowwise")[0], q * s[:, None])
    dy = torch.randn_like(ref)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    rx, rw = torch.autograd.grad(ref, (x, w), dy)
    assert _rel(gx, rx) <= 1e-6 and _rel(gw, rw) <= 1e-6


def _tiny(seed=0):
    from lightning_moe.config import ModelConfig
    from lightning_moe.models.transformer import MoETransformer

    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset("tiny", num_layers=2)
    return MoETransformer(cfg)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
def test_callback_swaps_in_the_eager_linear_and_trains_like_torchao(recipe):
    """fused_dense (default): every dense linear becomes our Fp8Linear, the attention's input projections share one
    input cache and (rowwise) the attention norm quantizes for them; loss and gradients equal the torchao-converted
    model's (fused_dense=False) to fp32 rounding."""
    from lightning_moe.callbacks import LowPrecisionTraining
    from lightning_moe.lowp.fp8_linear import Fp8Linear, Fp8QuantRMSNorm

    models = []
    for fused in (True, False):
        model = _tiny()
        cb = LowPrecisionTraining(recipe, emulate=True, experts=False, fused_dense=fused)
        cb.device = torch.device("cpu")
        cb.transform_model(model)
        models.append(model)
    ours, ref = models
    att = ours.layers["0"].attention
    assert all(isinstance(getattr(att, n), Fp8Linear) for n in ("wq", "wk", "wv", "wo"))
    assert att.wq.lowp_input_cache is att.wk.lowp_input_cache is att.wv.lowp_input_cache is not None
    assert att.wo.lowp_input_cache is None
    assert isinstance(ours.layers["0"].attention_norm, Fp8QuantRMSNorm) == (recipe == "fp8_rowwise")
    assert type(ref.layers["0"].attention.wq).__name__ == "Float8Linear"
    ref.load_state_dict(ours.state_dict())  # same keys, same values
    tokens = torch.randint(0, 100, (2, 24))
    losses, grads = [], []
    for model in (ours, ref):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        losses.append(loss.detach())
        if model is ours:  # the shared quantization happened: one per block (the norm's, rowwise), three reads
            cache = att.wq.lowp_input_cache
            assert cache.hits == (3 if recipe == "fp8_rowwise" else 2) and cache._entry is None
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert _rel(losses[0], losses[1]) <= 1e-6
    for n, g in grads[1].items():
        assert g is not None and _rel(grads[0][n], g) <= 1e-4, n


def test_compiled_regions_keep_torchaos_linear_and_look_up_compiled_entries():
    """Inside regions MoEParallelStrategy(compile=...) compiles, dense linears stay torchao's Float8Linear (inductor
    fuses its casts); the auto choice looks them up among compiled entries only, so a table measured eagerly leaves
    them in bf16 while the eager ones follow it."""
    from lightning_moe.callbacks import LowPrecisionTraining

    model = _tiny()
    cb = LowPrecisionTraining("fp8_rowwise", emulate=True, experts=False)
    cb._compile_regions = ("attention",)  # what setup reads from the strategy
    cb.transform_model(model)
    att, mlp = model.layers["0"].attention, model.layers["0"].feed_forward
    assert type(att.wq).__name__ == "Float8Linear" and type(mlp.w1).__name__ == "Fp8Linear"
    assert type(model.layers["0"].attention_norm).__name__ == "RMSNorm"  # no fused norm for compiled projections
    shapes = {(m.out_features, m.in_features) for m in (att.wq, att.wk, mlp.w1, mlp.w2)}
    table = {"schema": 1, "entries": [{"kind": "dense", "N": n, "K": k, "groups": 1, "recipe": "fp8_rowwise",
                                       "ratios": {"64": 2.0}} for n, k in shapes]}
    cb = LowPrecisionTraining(emulate=True, experts=False, table=table, tokens_per_microbatch=64)
    cb._compile_regions = ("attention",)
    cb.transform_model(model := _tiny())
    why = {d.gemm.name: (d.gemm.mode, d.recipe) for d in cb.decisions}
    assert why["layers.0.attention.wq"] == ("compiled", None)
    assert why["layers.0.feed_forward.w1"] == ("eager", "fp8_rowwise")


def test_gpu_check_suite_runs_on_cpu(capsys):
    """bench/fp8_linear.py (the H200 check of these kernels) at toy sizes on the CPU kernel path: its checks pass."""
    from bench import fp8_linear as suite

    assert suite.main(["--device", "cpu", "--small"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "qkv block" in out and out.count(" yes") == 10
