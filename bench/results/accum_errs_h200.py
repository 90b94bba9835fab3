"""Issue 23, call L: each FP8 GEMM with and without Hopper's fast accumulation against the fp32 product of the same
dequantized FP8 operands (so only accumulation differs): the grouped GEMM (fp8_fused._Ops) and the dense linear
(fp8_linear._Ops), at the bench8 experts' and attention shapes. Error: max |err| / max |ref| and ||err|| / ||ref||."""
import torch

from lightning_moe.lowp import fp8_fused as ff
from lightning_moe.lowp import fp8_linear as fl


def errs(y, ref):
    d = (y.float() - ref).abs()
    return d.max().item() / ref.abs().max().item(), (d.norm() / ref.norm()).item()


torch.manual_seed(0)
print(f"{'gemm':34s} {'fast max':>9s} {'fast rms':>9s} {'prec max':>9s} {'prec rms':>9s}  bf16 rms")
for E, M_e, K, N in ((16, 1024, 2048, 768), (16, 1024, 768, 2048), (8, 4096, 2048, 768)):
    ops = ff._Ops(emulate=False)
    x = torch.randn(E * M_e, K, device="cuda").bfloat16()
    w = (torch.randn(E, K, N, device="cuda") * 0.02).bfloat16()
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * M_e
    a, b = ops.rows(x), ops.w_fwd(w)
    ref = torch._grouped_mm(a[0].float() * a[1][:, None], b[0].float() * b[1][:, None, :], offs=offs)
    out = [errs(ops.mm(a, b, offs, torch.bfloat16, fast_accum=f), ref) for f in (True, False)]
    bf = errs(torch._grouped_mm((a[0].float() * a[1][:, None]).bfloat16(), (b[0].float() * b[1][:, None, :]).bfloat16(),
                                offs=offs), ref)
    print(f"grouped E={E} M/e={M_e} K={K} N={N}".ljust(34), " ".join(f"{v:9.2e}" for v in (*out[0], *out[1])),
          f"{bf[1]:9.2e}")
for M, K, N in ((8192, 2048, 4096), (8192, 4096, 2048), (8192, 2048, 512)):
    ops = fl._Ops("rowwise", emulate=False)
    x = torch.randn(M, K, device="cuda").bfloat16()
    w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
    xo, wo = ops.x_fwd(x), ops.w_fwd(w)
    ref = (xo[0].float() * xo[1].float()) @ (wo[0].float() * wo[1].float()).t()
    out = []
    for f in (True, False):
        ops.fast_accum = f
        out.append(errs(ops.forward(xo, wo, torch.bfloat16), ref))
    print(f"dense M={M} K={K} N={N}".ljust(34), " ".join(f"{v:9.2e}" for v in (*out[0], *out[1])))
