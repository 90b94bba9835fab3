# which of the gw_hp GPU test's comparisons is off, and by how much (call J)
import torch
from lightning_moe.callbacks.low_precision import GW_HP, LowPrecisionGroupedMM
from lightning_moe.config import MoEConfig
from lightning_moe.moe import kernels
from lightning_moe.moe.layer import MoELayer
import os
os.environ[kernels.ENV_VAR] = "triton"
torch.manual_seed(0)
D, F, E, k, T = 256, 192, 16, 4, 1000
layer = MoELayer(MoEConfig(num_experts=E, top_k=k, expert_hidden_size=F), D).cuda()
layer.experts.to(torch.bfloat16)
x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
out = {}
for name, recipe, emulate, fuse in (("fused", GW_HP, False, True), ("unfused", GW_HP, False, False),
                                    ("emulated", GW_HP, True, True), ("rowwise", "fp8_rowwise", False, True),
                                    ("rowwise_unfused", "fp8_rowwise", False, False), ("rowwise_emulated", "fp8_rowwise", True, True)):
    layer.replan(grouped_mm=LowPrecisionGroupedMM(recipe, emulate=emulate, fuse=fuse))
    layer.zero_grad()
    xi = x.clone().requires_grad_()
    y = layer(xi)
    y.backward(dy)
    out[name] = [y, xi.grad, layer.experts.w1.grad.clone(), layer.experts.w2.grad.clone()]
rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
for a, b in (("fused", "unfused"), ("fused", "emulated"), ("rowwise", "rowwise_unfused"), ("rowwise", "rowwise_emulated"), ("fused", "rowwise")):
    print(f"{a:8s} vs {b:16s} " + "  ".join(f"{n} {rel(s, t):.5f}" for n, s, t in zip(("y", "dx", "dw1", "dw2"), out[a], out[b])))
