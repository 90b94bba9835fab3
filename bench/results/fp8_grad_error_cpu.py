# CPU study for issue 23 (bench/RESULTS.md, "Convergence with fp32 masters over three paired init seeds"); output in fp8_grad_error_cpu.txt
"""Per-parameter gradient error of bf16 and emulated FP8 recipes against an fp32 reference on one batch (CPU)."""
import collections
import sys

import torch
from lightning_moe.config import ModelConfig
from lightning_moe.module import MoELanguageModel
from lightning_moe.callbacks import LowPrecisionTraining
from lightning_moe.data import TextDataModule
from lightning_moe.models.labels import shift_labels
torch.manual_seed(0)
torch.set_num_threads(2)
cfg = ModelConfig.from_preset("qwen3_moe_30b_a3b", num_layers=2, vocab_size=512, hidden_size=512, num_heads=8,
                              num_kv_heads=4, head_dim=64, dense_hidden_size=1024, max_seq_len=512,
                              moe={"num_experts": 16, "top_k": 4, "expert_hidden_size": 256})
T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
recipes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp8_rowwise", "fp8_tensorwise"]
dm = TextDataModule(seq_len=T, batch_size=4); dm.setup("fit")
batch = next(iter(dm.train_dataloader()))
ids = batch["input_ids"]
labels = shift_labels(ids, None, None)

def build(dtype):
    torch.manual_seed(0)
    m = MoELanguageModel(cfg); m.configure_model()
    model = m.model
    return model.to(dtype)

ref = build(torch.float32)
with torch.no_grad():  # the reference holds the bf16-rounded weights
    for p in ref.parameters():
        p.copy_(p.to(torch.bfloat16).float())

def grads(model):
    model.zero_grad(set_to_none=True)
    out = model(ids, None, None, labels_BS=labels)
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    return float(loss), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}

l_ref, g_ref = grads(ref)
results = collections.OrderedDict()
for name in ["bf16", *recipes]:
    m = build(torch.float32)
    m.load_state_dict(ref.state_dict())
    m = m.to(torch.bfloat16)
    if name != "bf16":
        cb = LowPrecisionTraining(name, emulate=True)
        cb.device = torch.device("cpu")
        cb.transform_model(m)
        print(name, "converted", len(cb.converted))
    l, g = grads(m)
    results[name] = (l, g)
print(f"loss fp32 {l_ref:.5f} " + " ".join(f"{k} {v[0]:.5f}" for k, v in results.items()))
def pat(n):
    return ".".join("*" if p.isdigit() else p for p in n.split("."))
rows = collections.OrderedDict()
for n, gr in g_ref.items():
    k = pat(n)
    for name, (_, g) in results.items():
        e = float((g[n] - gr).norm() / gr.norm().clamp(min=1e-30))
        cos = float((g[n].flatten() @ gr.flatten()) / (gr.flatten() @ gr.flatten()))  # projection: 1 = no shrink
        rows.setdefault(k, {}).setdefault(name, []).append((e, cos))
print(f"{'param':45s} " + " ".join(f"{n:>22s}" for n in results))
for k, d in rows.items():
    cells = []
    for name in results:
        es = d[name]
        cells.append(f"{sum(e for e, _ in es)/len(es):9.4f} proj {sum(c for _, c in es)/len(es):.4f}")
    print(f"{k:45s} " + " ".join(f"{c:>22s}" for c in cells))
