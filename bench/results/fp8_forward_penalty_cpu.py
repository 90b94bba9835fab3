# CPU study for issue 23 (bench/RESULTS.md, "Convergence with fp32 masters over three paired init seeds"); output in fp8_forward_penalty_cpu.txt
"""How much does an FP8 forward alone raise the loss of a trained model? Train a small Qwen3-shaped MoE in fp32 on the
embedded corpus (CPU), then evaluate the same batches through bf16 and emulated FP8 forwards of the same weights."""
import sys
import time

import torch
from lightning_moe.config import ModelConfig
from lightning_moe.module import MoELanguageModel
from lightning_moe.callbacks import LowPrecisionTraining
from lightning_moe.data import TextDataModule
from lightning_moe.models.labels import shift_labels
torch.manual_seed(0); torch.set_num_threads(2)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
cfg = ModelConfig.from_preset("qwen3_moe_30b_a3b", num_layers=2, vocab_size=512, hidden_size=512, num_heads=8,
                              num_kv_heads=4, head_dim=64, dense_hidden_size=1024, max_seq_len=512,
                              moe={"num_experts": 16, "top_k": 4, "expert_hidden_size": 256})
dm = TextDataModule(seq_len=256, batch_size=4); dm.setup("fit")
m = MoELanguageModel(cfg); m.configure_model(); model = m.model
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
it = iter(dm.train_dataloader())
def loss_of(mod, ids):
    out = mod(ids, None, None, labels_BS=shift_labels(ids, None, None))
    return out.loss_sum / out.num_tokens
t0 = time.time()
for s in range(steps):
    ids = next(it)["input_ids"]
    lr = 1e-3 * min(1.0, (s + 1) / 30)
    for g in opt.param_groups: g["lr"] = lr
    opt.zero_grad(); l = loss_of(model, ids); l.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    if s % 50 == 0: print(s, float(l), f"{time.time()-t0:.0f}s", flush=True)
evals = [next(it)["input_ids"] for _ in range(20)]
sd = {k: v.clone() for k, v in model.state_dict().items()}
res = {}
for name in ("fp32", "bf16", "fp8_rowwise", "fp8_tensorwise"):
    m2 = MoELanguageModel(cfg); m2.configure_model(); mod = m2.model
    mod.load_state_dict(sd)
    if name != "fp32":
        mod = mod.to(torch.bfloat16)
    if name.startswith("fp8"):
        cb = LowPrecisionTraining(name, emulate=True); cb.device = torch.device("cpu"); cb.transform_model(mod)
    with torch.no_grad():
        res[name] = sum(float(loss_of(mod, ids)) for ids in evals) / len(evals)
print("eval mean loss over 20 batches:", {k: round(v, 5) for k, v in res.items()})
print("relative to bf16:", {k: f"{100 * (v / res['bf16'] - 1):+.3f}%" for k, v in res.items()})
