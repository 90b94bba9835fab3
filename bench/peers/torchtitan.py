"""torchtitan's MoE layer (``torchtitan.models.common.moe.MoE``, runs on torch 2.11) of our config, our weights
copied in: the PyTorch-native layer peer of the layer suite."""

from __future__ import annotations

from typing import Any

import torch

from bench.core.device import building
from bench.core.env import package_version
from bench.peers import copy_into


def moe_block(model_cfg: Any, src: Any, device: torch.device, dtype: torch.dtype,
                forced: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    m, D = model_cfg.moe, model_cfg.hidden_size
    E, k = m.num_experts, m.top_k
    if m.score_func == "softmax" and not m.pre_softmax and not m.norm_topk_prob:
        raise ValueError("softmax over the chosen logits without renormalisation has no torchtitan equivalent")
    shared = None
    if m.shared_expert_hidden_size:
        Fs = m.shared_expert_hidden_size
        shared = FeedForward.Config(w1=Linear.Config(in_features=D, out_features=Fs),
                                    w2=Linear.Config(in_features=Fs, out_features=D),
                                    w3=Linear.Config(in_features=D, out_features=Fs))
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=m.expert_hidden_size, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E), top_k=k, score_func=m.score_func,
            # Mixtral (softmax over the k chosen logits) = softmax over all, top-k, renormalised
            route_norm=bool(m.norm_topk_prob or (m.score_func == "softmax" and not m.pre_softmax)),
            route_scale=float(m.scaling_factor or 1.0), num_expert_groups=m.num_groups,
            num_limited_groups=m.group_topk, _debug_force_load_balance=forced),
        load_balance_coeff=1e-3 if m.expert_bias else None,
        shared_experts=shared,
    )
    with building(device, dtype):
        block = cfg.build()
    e = src.experts
    vals = {"routed_experts.inner_experts.w1_EFD": e.w1.detach(), "routed_experts.inner_experts.w2_EDF": e.w2.detach(),
            "routed_experts.inner_experts.w3_EFD": e.w3.detach(), "router.gate.weight": src.router.weight.detach(),
            "tokens_per_expert_E": torch.zeros(E, device=device)}
    if src.router.expert_bias is not None:
        vals["expert_bias_E"] = src.router.expert_bias
    if src.shared_experts is not None:
        s = src.shared_experts
        vals.update({f"shared_experts.{n}.weight": getattr(s, n).weight.detach() for n in ("w1", "w2", "w3")})
    info = copy_into(block, vals)
    info["torchtitan"] = package_version("torchtitan")
    info["router_gate_dtype"] = str(block.router.gate.weight.dtype).replace("torch.", "")
    return block.train(), info
