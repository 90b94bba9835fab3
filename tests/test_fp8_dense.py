"""The dense FP8 linear's Triton kernels under Triton's interpreter (TRITON_INTERPRET=1, set before triton is first
imported) against PyTorch's own casts, bit for bit: the FP8 *bytes*, not only the values (a negative value that
rounds to zero is -0, 0x80, in PyTorch's cast; a GPU check compares the bytes). The interpreter cannot store fp8: the
kernels store the e4m3 / e5m2 values in fp32 there, which is exact, and the bytes are compared after the cast."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels.py imports it on first use)

import importlib.util

import pytest
import torch

from lightning_moe.lowp.fp8_grouped import quantize_rowwise
from lightning_moe.moe import kernels

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "triton")


def _bytes(t: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    return t.to(dtype).view(torch.uint8)


def _rows_with_signed_zeros(R: int, D: int) -> torch.Tensor:
    """Rows whose FP8 forms hold -0 (tiny negatives next to a large value), +0, exact -0.0 and ties."""
    torch.manual_seed(0)
    x = torch.randn(R, D) * 3
    x[:, 0] = 40.0  # amax 40: scale 8, so |x| < 2^-13 rounds to zero
    x[:, 1], x[:, 2], x[:, 3] = -1e-6, 1e-6, -0.0
    x[:, 4] = -0.0625 * 1.0625  # a tie between two e4m3 values once scaled (0.53125 -> 0.5 / 0.5625)
    return x


def test_rms_norm_quant_bytes_equal_pytorchs_cast():
    x = _rows_with_signed_zeros(6, 64)
    y, q, s = kernels.rms_norm_quant_rowwise(x, torch.ones(64), 1e-6, torch.float32)
    q_ref, s_ref = quantize_rowwise(y, torch.float32)
    assert torch.equal(s, s_ref)
    assert torch.signbit(q_ref).any() and (q_ref == 0).any()  # the case is exercised
    assert torch.equal(_bytes(q), _bytes(q_ref))


def test_swiglu_and_gather_quant_bytes_equal_pytorchs_cast():
    """The experts' fused quantizers share the rounding helper: their bytes match PyTorch's cast too."""
    x = _rows_with_signed_zeros(6, 64)
    h_ref = kernels.swiglu_reference(x, torch.ones_like(x), None)
    _, q, _ = kernels.swiglu_quant_rowwise(x, torch.ones_like(x), None, torch.float32)
    assert torch.equal(_bytes(q), _bytes(quantize_rowwise(h_ref, torch.float32)[0]))
    asg = torch.arange(6)
    q, _ = kernels.gather_quant_rowwise(x, asg, 1, asg, 6, torch.float32)
    assert torch.equal(_bytes(q), _bytes(quantize_rowwise(x, torch.float32)[0]))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(40, 48), (70, 130)])  # partial tiles of the 64 x 64 blocks
def test_tensorwise_cast_is_torchaos_bytes_in_both_layouts(dtype, shape):
    """The fused tensorwise cast (one read, row- and column-major outputs) gives torchao's tensorwise FP8 tensor:
    its scale (max / amax, fp32, not rounded) and its bytes, -0 included; the dequantization scale is the fp32
    reciprocal."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from lightning_moe.lowp import fp8_casts as fl

    x = _rows_with_signed_zeros(*shape) * torch.logspace(-3, 1, shape[1])
    for x_dtype in (torch.float32, torch.bfloat16):
        xx = x.to(x_dtype)
        ref = hp_tensor_to_float8_dynamic(xx, dtype, LinearMMConfig())
        q, qt, sinv = fl.cast_tensorwise(xx, dtype, rows=True, cols=True)
        assert q.is_contiguous() and qt.t().is_contiguous() and q.dtype == qt.dtype == dtype
        assert torch.equal(sinv, ref._scale.reciprocal())
        assert torch.equal(q.view(torch.uint8), ref._data.view(torch.uint8))
        assert torch.equal(qt.view(torch.uint8), ref._data.view(torch.uint8))
        assert ref._data.view(torch.uint8).eq(0x80).any()  # -0 is exercised
        only_cols = fl.cast_tensorwise(xx, dtype, rows=False, cols=True)
        assert only_cols[0] is None and torch.equal(only_cols[1].view(torch.uint8), qt.view(torch.uint8))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_kernel_path_through_the_triton_casts_equals_the_emulation(recipe):
    """fp8_linear's kernel path with the Triton casts (interpreter; torch._scaled_mm on CPU) equals its emulation:
    forward and both gradients (bf16 out), and the tensorwise backward casts dy once."""
    from lightning_moe.lowp import fp8_linear as fl
    from lightning_moe.lowp.fp8_fused import Fp8WeightCache

    torch.manual_seed(1)
    M, K, N = 40, 64, 48
    x, w = torch.randn(M, K).bfloat16(), (torch.randn(N, K) * 0.1).bfloat16()
    dy = torch.randn(M, N).bfloat16()
    outs = []
    for emulate in (False, True):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        cache = Fp8WeightCache()
        y = fl.fp8_linear(xl, wl, recipe=recipe, emulate=emulate, weight_cache=cache)
        y.backward(dy)
        outs.append((y.detach(), xl.grad, wl.grad))
        assert (cache.misses, cache.hits) == (2, 0)
    for a, b in zip(*outs):
        assert a.dtype == b.dtype == torch.bfloat16
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= 1e-2


@pytest.mark.parametrize("shape", [(40, 48), (300, 130)])  # partial tiles; M over one amax program's 256 rows
def test_colwise_cast_is_torchaos_rowwise_wgrad_operand(shape):
    """The rowwise weight gradient's column-wise cast: the bytes and (reciprocal) scales of torchao's axiswise cast
    along dim 0 with power-of-two scales, column-major."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from lightning_moe.lowp import fp8_casts as fl

    x = _rows_with_signed_zeros(*shape) * torch.logspace(-3, 1, shape[1])
    x[:, 7] = 0.0  # an all-zero column (amax clamped at 1e-12)
    for x_dtype in (torch.float32, torch.bfloat16):
        xx = x.to(x_dtype)
        ref = hp_tensor_to_float8_dynamic(xx, E4M3, LinearMMConfig(), scaling_granularity=_axiswise(), axiswise_dim=0,
                                          round_scales_to_power_of_2=True)
        q, sinv = fl.cast_colwise(xx)
        assert q.shape == xx.shape and q.t().is_contiguous() and q.dtype == E4M3
        assert torch.equal(q.view(torch.uint8), ref._data.view(torch.uint8))
        assert torch.equal(sinv, ref._scale.reciprocal().flatten())


def _axiswise():
    from torchao.float8.config import ScalingGranularity

    return ScalingGranularity.AXISWISE


@pytest.mark.parametrize("shape", [(40, 48), (13, 1100)])  # several rows per program; a row over one 1024 block
def test_rowwise_cast_is_torchaos_and_transpose_moves_bytes(shape):
    """The row-wise cast (forward x and w, dgrad dy): torchao's axiswise dim -1 power-of-two cast, bytes and
    (reciprocal) scales; the FP8 byte transpose is ``q.t().contiguous()``."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from lightning_moe.lowp import fp8_casts as fl

    x = _rows_with_signed_zeros(*shape) * torch.logspace(-3, 1, shape[0])[:, None]
    x[1] = 0.0  # an all-zero row
    for x_dtype in (torch.float32, torch.bfloat16):
        xx = x.to(x_dtype)
        ref = hp_tensor_to_float8_dynamic(xx, E4M3, LinearMMConfig(), scaling_granularity=_axiswise(),
                                          axiswise_dim=-1, round_scales_to_power_of_2=True)
        q, sinv = fl.cast_rowwise(xx)
        assert q.is_contiguous() and q.dtype == E4M3
        assert torch.equal(q.view(torch.uint8), ref._data.view(torch.uint8))
        assert torch.equal(sinv, ref._scale.reciprocal().flatten())
        t = fl.transpose_fp8(q)
        assert t.is_contiguous() and t.dtype == E4M3 and torch.equal(t.view(torch.uint8), q.t().contiguous().view(
            torch.uint8))
