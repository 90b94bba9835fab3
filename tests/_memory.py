"""Shared pieces of the recomputation and activation-offload tests: tiny configs (GQA with MoE and shared experts;
an MLA variant) and one forward/backward that returns every gradient, the routing statistics and the losses."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from lightning_moe import ModelConfig
from lightning_moe.models.transformer import MoETransformer
from lightning_moe.moe.record import MoERecorder

SEQ = 16
BATCH = 2


def gqa_config() -> ModelConfig:
    # dims multiples of 4 floats: the grouped-GEMM path runs (not the loop fallback)
    moe = dict(num_experts=4, top_k=2, expert_hidden_size=32, score_func="sigmoid", expert_bias=True,
               aux_loss_type="seq", aux_loss_coeff=1e-2, z_loss_coeff=1e-3, shared_expert_hidden_size=32,
               first_k_dense=1)
    return ModelConfig.from_preset("tiny", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                                   dense_hidden_size=64, max_seq_len=32, qk_norm="head", moe=moe)


def mla_config() -> ModelConfig:
    moe = dict(num_experts=4, top_k=2, expert_hidden_size=32, shared_expert_hidden_size=32, aux_loss_coeff=1e-2)
    return ModelConfig.from_preset("tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                                   dense_hidden_size=64, max_seq_len=32, attention="mla", qk_norm="none",
                                   q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                   v_head_dim=8, moe=moe)


def reference_model(cfg: ModelConfig) -> MoETransformer:
    torch.manual_seed(1234)
    model = MoETransformer(cfg)
    model.init_weights()
    return model


def tokens(cfg: ModelConfig, batch: int = BATCH, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=g)


def full_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def step(model: nn.Module, ids: torch.Tensor, before_backward: Optional[Callable[[], Any]] = None,
         steps: int = 1, forward_context: Callable[[], ContextManager] = contextlib.nullcontext) -> dict[str, Any]:
    """``steps`` forward/backward passes (gradients accumulate): every parameter's (full) gradient, each MoE
    layer's routing record summed over the forwards, and the loss values. ``forward_context``: entered around each forward only,
    as Lightning's precision plugin does around ``training_step``."""
    w = torch.linspace(-1, 1, model.config.vocab_size)
    losses = []
    routing: dict[int, Any] = {}
    for _ in range(steps):
        with forward_context():
            recorder = MoERecorder()
            logits = model(ids, recorder=recorder)
            records = recorder.records.values()
            loss = (logits.float() * w).mean() + sum(r.aux_loss + r.z_loss for r in records)
        for i, r in recorder.records.items():
            routing[i] = r.routing if i not in routing else routing[i] + r.routing
        if before_backward is not None:
            before_backward()
        loss.backward()
        losses.append(float(loss.detach()))
    # keyed like the state dict (the full-AC wrapper adds a prefix to parameter names)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): full_grad(p) for n, p in model.named_parameters()}
    assert len(routing) == len(model.moe_layers())
    stats = [routing[i] for i in sorted(routing)]
    return {"grads": grads, "losses": losses, "stats": stats}


def assert_same(a: dict[str, Any], b: dict[str, Any], exact: bool = True) -> None:
    assert a["losses"] == b["losses"]
    assert a["grads"].keys() == b["grads"].keys()
    for n in a["grads"]:
        x, y = a["grads"][n], b["grads"][n]
        if exact:
            assert torch.equal(x, y), f"{n}: max diff {(x - y).abs().max():.3e}"
        else:
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=n)
    for sa, sb in zip(a["stats"], b["stats"]):
        for fa, fb in zip(sa.values(), sb.values()):
            assert (fa is None and fb is None) or torch.equal(fa, fb)
