"""Time of one stochastic rounding of a bench8 expert weight (w1 [128, 768, 2048] bf16, the forward's operand
w_EKN = a transposed view, amax over K): the Triton pass vs the PyTorch ops vs torchao's plain cast of the same view."""
import os

import triton
import torch
from triton.testing import do_bench
from lightning_moe.lowp import fp8_stochastic as fs
from lightning_moe.lowp.fp8_fused import _Ops

w_ENK = (torch.randn(128, 768, 2048, device="cuda") * 0.02).to(torch.bfloat16)
w_EKN = w_ENK.transpose(-2, -1)
ops = _Ops(emulate=False)
for backend in ("triton", "torch"):
    os.environ["LIGHTNING_MOE_KERNELS"] = backend
    for dim in (-2, -1):
        ms = do_bench(lambda: fs.stochastic_round_e4m3(w_EKN, dim), warmup=5, rep=50)
        print(f"stochastic_round_e4m3 {backend:6s} dim {dim}: {ms:.2f} ms ({w_EKN.numel() * 2 * 3 / ms / 1e6:.0f} GB/s: w read twice, written once)")
os.environ["LIGHTNING_MOE_KERNELS"] = "auto"
print(f"torchao cast w_fwd (plain, no rounding step): {do_bench(lambda: ops.w_fwd(w_EKN), warmup=5, rep=50):.2f} ms")
print(f"torchao cast w_dgrad: {do_bench(lambda: ops.w_dgrad(w_EKN), warmup=5, rep=50):.2f} ms")
