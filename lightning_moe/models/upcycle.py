"""Sparse upcycling: a dense model's state dict -> an MoE model's, whose output at initialisation equals the dense one.

Rule (granularity g, E routed experts, top-k, F the dense MLP's hidden size):

- The dense SwiGLU is a sum over its hidden units, so splitting F into g equal chunks c gives
  ``mlp(x) = sum_c mlp_c(x)`` exactly, ``mlp_c`` using rows c of ``w1`` / ``w3`` and columns c of ``w2``.
- E = n * g experts form n *replicas* of the g chunks: expert ``e = r * g + c`` is chunk c of replica r, so
  ``expert_hidden_size = F / g``. k = t * g with t <= n (g = 1: every expert is a full copy of the MLP).
- The router is fresh (normal(0, std)) but the g experts of one replica share one router row ("virtual groups"):
  their scores tie, so the top-k always takes t whole replicas, i.e. every chunk exactly t times.
- With normalised combine weights (softmax with ``norm_topk_prob`` or top-k-then-softmax, or sigmoid with
  ``norm_topk_prob``) the weights of one replica's g experts are equal and all k weights sum to 1, so each chunk gets a
  total weight of 1/g: the routed output is ``(1/g) * scaling_factor * mlp(x)``. Expert down-projections are therefore
  scaled by ``g / scaling_factor``, and the MoE layer equals the dense MLP for every token (dropless routing).
- Group-limited routing keeps this when every group holds whole replicas (``(E / num_groups) % g == 0``).

Training breaks the ties: the g experts of a replica get different gradients (different chunks), so their router rows
and weights diverge.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional

import torch
from torch import Tensor

from lightning_moe.config import ModelConfig, MoEConfig

__all__ = ["upcycle_config", "upcycle_state_dict"]


def upcycle_config(dense_cfg: ModelConfig, moe: MoEConfig, granularity: int = 1) -> ModelConfig:
    """The MoE model's config: ``dense_cfg`` with ``moe``; validates the upcycling rule (ValueError naming the fix)."""
    g = granularity
    if dense_cfg.moe.num_experts != 0:
        raise ValueError("upcycling starts from a dense model: dense_cfg.moe.num_experts must be 0")
    if g < 1:
        raise ValueError(f"granularity must be >= 1, got {g}")
    E, k, F = moe.num_experts, moe.top_k, dense_cfg.dense_hidden_size
    if E <= 0:
        raise ValueError("moe.num_experts must be positive")
    if F % g:
        raise ValueError(f"dense_hidden_size={F} is not divisible by granularity={g}")
    if moe.expert_hidden_size != F // g:
        raise ValueError(f"moe.expert_hidden_size={moe.expert_hidden_size} must be dense_hidden_size / granularity "
                         f"= {F // g}")
    if E % g or k % g:
        raise ValueError(f"moe.num_experts={E} and moe.top_k={k} must be multiples of granularity={g} "
                         f"(E = replicas x g, k = t x g)")
    # combine weights summing to 1 (our router renormalises only when k > 1)
    normalised = (moe.score_func == "softmax" and not moe.pre_softmax) or (k > 1 and moe.norm_topk_prob)
    if not normalised:
        raise ValueError("upcycling keeps the dense output only with normalised top-k weights: set "
                         "moe.norm_topk_prob=True (or pre_softmax=False with softmax)")
    if moe.shared_expert_hidden_size:
        raise ValueError("upcycling into shared experts is not supported: set moe.shared_expert_hidden_size=0")
    if moe.num_groups is not None and (E // moe.num_groups) % g:
        raise ValueError(f"group-limited routing needs whole replicas per group: (num_experts / num_groups) = "
                         f"{E // moe.num_groups} must be a multiple of granularity={g}")
    return dataclasses.replace(dense_cfg, moe=moe)


@torch.no_grad()
def upcycle_state_dict(dense_sd: Mapping[str, Tensor], dense_cfg: ModelConfig, moe: MoEConfig, granularity: int = 1,
                       *, router_init_std: Optional[float] = None, generator: Optional[torch.Generator] = None
                       ) -> tuple[dict[str, Tensor], ModelConfig]:
    """(state dict, config) of the upcycled MoE model; see the module docstring for the rule.

    ``dense_sd``: the dense model's full state dict (our keys). Layers that the new config keeps dense
    (``first_k_dense`` / ``dense_layers``) keep their MLP. ``router_init_std``: the fresh router's std (default
    ``dense_cfg.init_std``). Expert bias (if enabled) starts at zero.
    """
    cfg = upcycle_config(dense_cfg, moe, granularity)
    g, E = granularity, moe.num_experts
    n = E // g
    Fe = moe.expert_hidden_size
    std = dense_cfg.init_std if router_init_std is None else router_init_std
    scale = g / (moe.scaling_factor or 1.0)
    out: dict[str, Tensor] = {}
    for key, t in dense_sd.items():
        m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(w[123])\.weight", key)
        if m is None or not cfg.is_moe_layer(int(m.group(1))):
            out[key] = t.detach().clone()
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        p = f"layers.{i}."
        try:
            w1, w3, w2 = (dense_sd[p + f"feed_forward.{w}.weight"] for w in ("w1", "w3", "w2"))
        except KeyError as e:
            raise ValueError(f"dense state dict lacks {e.args[0]!r}") from None
        # chunk c: rows [c*Fe, (c+1)*Fe) of w1/w3 [F, D], the same columns of w2 [D, F]; expert e = r*g + c
        chunks = torch.arange(E) % g
        w1_E = torch.stack([w1[c * Fe:(c + 1) * Fe] for c in chunks.tolist()])
        w3_E = torch.stack([w3[c * Fe:(c + 1) * Fe] for c in chunks.tolist()])
        w2_E = torch.stack([w2[:, c * Fe:(c + 1) * Fe] * scale for c in chunks.tolist()])
        rows = torch.randn(n, cfg.hidden_size, generator=generator, dtype=torch.float32) * std
        out[p + "moe.router.weight"] = rows.repeat_interleave(g, dim=0)  # the g experts of a replica tie
        if moe.expert_bias:
            out[p + "moe.router.expert_bias"] = torch.zeros(E, dtype=torch.float32)
        out[p + "moe.experts.w1"] = w1_E.contiguous()
        out[p + "moe.experts.w3"] = w3_E.contiguous()
        out[p + "moe.experts.w2"] = w2_E.contiguous()
    return out, cfg
