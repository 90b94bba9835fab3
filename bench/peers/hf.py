"""Hugging Face ``transformers`` peers: the Qwen3-MoE config and plain-loop optimizer of the training-step suite, the
MoE block of the layer suite (our weights copied in) and the DeepSeek-V3 model of its step suite."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from bench.core.device import build_on, building
from bench.peers import copy_into

# the transformers MoE block class of each model type (the layer suite's peer)
MOE_BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE", "mixtral": "MixtralSparseMoeBlock"}


def qwen3_config(cfg: Any, impl: str) -> Any:
    """``Qwen3MoeConfig`` of our ModelConfig (sdpa attention, ``impl`` experts unless "default")."""
    from transformers import Qwen3MoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.dense_hidden_size,
        moe_intermediate_size=cfg.moe.expert_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.moe.num_experts,
        num_experts_per_tok=cfg.moe.top_k,
        norm_topk_prob=cfg.moe.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        router_aux_loss_coef=cfg.moe.aux_loss_coeff,
        output_router_logits=True,
        tie_word_embeddings=cfg.tie_embeddings,
        use_cache=False,
        attn_implementation="sdpa",
    )
    if impl != "default":
        kw["experts_implementation"] = impl
    try:  # transformers 5.x: rope_parameters; 4.x: rope_theta
        hcfg = Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, **kw)
    except TypeError:
        hcfg = Qwen3MoeConfig(rope_theta=cfg.rope_theta, **kw)
    rp = getattr(hcfg, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(hcfg, "rope_theta", None)) if isinstance(rp, dict) else None
    if theta is not None and float(theta) != float(cfg.rope_theta):
        raise ValueError(f"Qwen3MoeConfig took rope_theta={theta}, expected {cfg.rope_theta}")
    return hcfg


def plain_optimizer(model: Any, lr: float, steps: int, device: torch.device) -> tuple[Any, Any]:
    """AdamW (fused on CUDA) and LR schedule of a plain-loop ``transformers`` model, as ``MoELanguageModel`` sets them
    up: weight decay 0.1 except on 1-D parameters and the embedding table, betas 0.9/0.95, warmup 2 then cosine to
    0.1x over ``steps``."""
    from lightning_moe.module import warmup_cosine

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "embed_tokens" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, 2, max(steps, 1), 0.1))
    return opt, sched


def moe_block(model_cfg: Any, model_type: str, impl: str, src: Any, device: torch.device,
             dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    import transformers
    from transformers import AutoConfig

    from lightning_moe.models.hf import config_to_hf

    d = config_to_hf(model_cfg, model_type)
    d.pop("model_type", None)
    d.pop("architectures", None)
    hcfg = AutoConfig.for_model(model_type, **d)
    info: dict[str, Any] = {"transformers": transformers.__version__}
    if impl != "eager" and not hasattr(hcfg, "_experts_implementation"):
        raise RuntimeError(f"transformers {transformers.__version__} has no experts implementation switch")
    if hasattr(hcfg, "_experts_implementation"):
        hcfg._experts_implementation = impl
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = getattr(mod, MOE_BLOCKS[model_type])
    with building(device, dtype):
        block = cls(hcfg)
    # the dtypes the transformers model keeps in fp32 (DeepSeek-V3: gate.weight, e_score_correction_bias)
    keep: set[str] = set()
    for obj in vars(mod).values():
        if isinstance(obj, type) and issubclass(obj, transformers.PreTrainedModel):
            for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
                keep |= set(getattr(obj, attr, None) or [])
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        if t.is_floating_point() and any(k in name for k in keep):
            t.data = t.data.float()
    info["fp32_tensors"] = sorted(n for n, t in list(block.named_parameters()) + list(block.named_buffers())
                                  if t.dtype == torch.float32)
    e = src.experts
    ex = block.experts
    w13 = torch.cat([e.w1.detach(), e.w3.detach()], dim=1)  # [E, 2F, D]: gate then up (transformers' chunk order)
    if getattr(ex, "is_transposed", False):
        vals = {"experts.gate_up_proj": w13.transpose(1, 2), "experts.down_proj": e.w2.detach().transpose(1, 2)}
    else:
        vals = {"experts.gate_up_proj": w13, "experts.down_proj": e.w2.detach()}
    vals["gate.weight"] = src.router.weight.detach()
    if src.router.expert_bias is not None:
        vals["gate.e_score_correction_bias"] = src.router.expert_bias
    if src.shared_experts is not None:
        s = src.shared_experts
        vals.update({"shared_experts.gate_proj.weight": s.w1.weight.detach(),
                     "shared_experts.up_proj.weight": s.w3.weight.detach(),
                     "shared_experts.down_proj.weight": s.w2.weight.detach()})
    info.update(copy_into(block, vals))
    info["experts_implementation"] = str(getattr(ex.config, "_experts_implementation", "n/a")) \
        if hasattr(ex, "config") else "n/a (no experts interface)"
    return block.train(), info


def deepseek_v3_model(cfg: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``DeepseekV3ForCausalLM`` of ``cfg`` (sdpa, grouped_mm experts), built in ``dtype`` on ``device``; the
    modules transformers keeps in fp32 when loading (router weight, score-correction bias) stay fp32."""
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    from lightning_moe.models.hf import config_to_hf

    kw = config_to_hf(cfg, "deepseek_v3")
    for key in ("model_type", "architectures"):
        kw.pop(key, None)
    kw["use_cache"] = False
    hcfg = AutoConfig.for_model("deepseek_v3", attn_implementation="sdpa", experts_implementation="grouped_mm", **kw)
    model = build_on(DeepseekV3ForCausalLM, hcfg, device, dtype)
    keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or []) + list(
        getattr(model, "_keep_in_fp32_modules", None) or [])
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and any(k in name for k in keep):
                t.data = t.data.float()
    return model.to(device).train()
