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
