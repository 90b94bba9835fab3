"""Hugging Face adapters: configs and weights of ``qwen3_moe``, ``mixtral``, ``deepseek_v3`` and ``olmoe`` models.

Import::

    hf = load_hf_config(path)                    # config.json, read as JSON (never code)
    cfg = config_from_hf(hf, max_seq_len=4096)   # every field that changes the computation, or a ValueError
    model = MoETransformer(cfg)                  # (on meta, parallelize, to_empty: any layout)
    result = load_hf_weights_(model, path)       # each rank reads only the rows of its local shards

Export::

    save_hf(model, out_dir, model_type="qwen3_moe", max_shard_bytes=5 * 2**30)   # config.json + safetensors

Conversions made at the edge (DESIGN invariant 3; our model is never changed to suit a format):

- Routed experts: our stacked ``w1`` (gate) / ``w3`` (up) [E, F, D] and ``w2`` (down) [E, D, F] <-> the per-expert
  ``experts.{j}.gate_proj/up_proj/down_proj`` (Mixtral: ``block_sparse_moe.experts.{j}.w1/w3/w2``) that checkpoints
  hold on disk, or transformers 5's in-memory fused ``experts.gate_up_proj`` [E, 2F, D] (gate rows first) and
  ``experts.down_proj`` [E, D, F]. Export writes the per-expert form, which is what transformers' ``save_pretrained``
  writes and ``from_pretrained`` converts.
- DeepSeek-V3 with ``rope_interleave`` (its default) rotates the pairs (2i, 2i+1) of ``q_pe`` / ``k_pe``; our model
  rotates (i, i + r/2) (rotate-half). The rope rows of ``q_proj`` / ``q_b_proj`` (per head) and of
  ``kv_a_proj_with_mqa`` are permuted (evens then odds) at import, and back at export. q.k is unchanged.
- ``e_score_correction_bias`` <-> our router's ``expert_bias`` buffer (used for the choice only, in both).

Reading is safetensors only (``safe_open`` + ``get_slice``): a parameter that is a DTensor shard (EP ``Shard(0)`` of
the experts, FSDP ``Shard(0)``, TP ``Shard(0)/Shard(1)``) gets only the rows / experts of its local shard read from
disk. ``HFCheckpointReader.bytes_read`` counts what was read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from lightning_moe.checkpoint.format import clean_param_name
from lightning_moe.config import ModelConfig, MoEConfig, YaRNScaling

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ARCHITECTURES",
    "load_hf_config",
    "config_from_hf",
    "config_to_hf",
    "export_families",
    "HFCheckpointReader",
    "HFLoadResult",
    "load_hf_weights_",
    "load_hf_state_dict_",
    "from_hf",
    "to_hf_state_dict",
    "save_hf",
]

log = logging.getLogger(__name__)

# dense families: imported (e.g. for upcycling), not exported
DENSE_MODEL_TYPES = ("qwen3", "llama")
EXPORT_MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3", "olmoe")
SUPPORTED_MODEL_TYPES = EXPORT_MODEL_TYPES + DENSE_MODEL_TYPES
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}

# Defaults of the transformers 5 configuration classes, for the fields we read (a config.json may omit a field).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, attention_dropout=0.0,
        decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
        norm_topk_prob=False, router_aux_loss_coef=1e-3, mlp_only_layers=None,
    ),
    "mixtral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=None, attention_dropout=0.0, num_experts_per_tok=2,
        num_local_experts=8, router_aux_loss_coef=1e-3, router_jitter_noise=0.0,
    ),
    "olmoe": dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, clip_qkv=None,
        num_experts_per_tok=8, num_experts=64, router_aux_loss_coef=0.01, norm_topk_prob=False,
    ),
    "qwen3": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, attention_dropout=0.0,
        num_experts_per_tok=1, moe_intermediate_size=0,
    ),
    "llama": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        num_experts_per_tok=1, moe_intermediate_size=0,
    ),
    "deepseek_v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=None, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
        attention_dropout=0.0,
    ),
}
_DEFAULT_THETA = {"mixtral": 1e6}
# transformers' DeepSeek-V3 builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps
_DEEPSEEK_LATENT_NORM_EPS = 1e-6


# ====================================================================================================================
# configs
# ====================================================================================================================


def load_hf_config(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model folder (or the file itself), parsed as JSON; never runs code."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.isfile(p):
        raise ValueError(f"no Hugging Face config at {p!r} (expected a folder holding config.json)")
    with open(p, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p!r} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{p!r} does not hold a JSON object")
    return cfg


class _HF:
    """A config dict with the family's defaults for missing (or null, where transformers treats null as default)
    fields, and a record of what was read."""

    def __init__(self, d: Mapping[str, Any]) -> None:
        self.d = dict(d)
        self.model_type = self.d.get("model_type")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.defaults = _DEFAULTS[self.model_type]

    def has(self, key: str) -> bool:
        return key in self.d

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.d:
            return self.d[key]
        return self.defaults.get(key, default)


def _bad(field_: str, value: Any, why: str) -> ValueError:
    return ValueError(f"Hugging Face config field {field_}={value!r}: {why}")


def _first_present(hf: _HF, *names: str) -> Any:
    """The value of the first of ``names`` in the config (aliases of one field); differing aliases are an error."""
    vals = {n: hf.d[n] for n in names if n in hf.d and hf.d[n] is not None}
    if len(set(map(repr, vals.values()))) > 1:
        raise ValueError(f"Hugging Face config gives differing values for one field: {vals}")
    if vals:
        return next(iter(vals.values()))
    for n in names:
        if hf.defaults.get(n) is not None:
            return hf.defaults[n]
    return None


def _yarn_mscale(factor: float, mscale: float) -> float:
    # identical to lightning_moe.models.transformer.yarn_mscale (kept here so configs need no model import)
    return 1.0 if factor <= 1 or mscale == 0 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_from_hf(hf: _HF, max_pos: int) -> tuple[float, Optional[YaRNScaling]]:
    """(rope_theta, YaRN scaling or None) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x)."""
    if hf.d.get("rope_scaling") is not None:
        params, name = hf.d["rope_scaling"], "rope_scaling"
    else:
        params, name = hf.d.get("rope_parameters") or {}, "rope_parameters"
    if not isinstance(params, dict):
        raise _bad(name, params, "expected a dict")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise _bad(name, params, "per-layer-type RoPE parameters are not supported (one RoPE for every layer)")
    theta = params.get("rope_theta", hf.d.get("rope_theta", _DEFAULT_THETA.get(hf.model_type, 10000.0)))
    prf = params.get("partial_rotary_factor", hf.d.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        raise _bad("partial_rotary_factor", prf, "partial rotary embeddings are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn":
        raise _bad(f"{name}.rope_type", rope_type, "only 'default' and 'yarn' RoPE are supported")
    if params.get("truncate", True) is not True:
        raise _bad(f"{name}.truncate", params["truncate"], "only the truncated YaRN correction range is supported")
    orig = int(params.get("original_max_position_embeddings") or hf.d.get("original_max_position_embeddings")
               or max_pos)
    factor = params.get("factor")
    factor = float(max_pos / orig) if factor is None else float(factor)
    mscale, mad = params.get("mscale"), params.get("mscale_all_dim")
    # transformers: cos/sin are multiplied by attention_factor (given, else mscale(f, mscale)/mscale(f, mad) when
    # both are set and non-zero, else mscale(f, 1)); MLA scores by mscale(f, mad)^2 when mad is set and non-zero.
    # Ours: cos/sin times mscale(f, m)/mscale(f, a), MLA scores times mscale(f, a)^2. Pick (m, a) that agree.
    a = float(mad) if mad else 0.0
    if params.get("attention_factor") is not None:
        af = float(params["attention_factor"])
    elif mscale and mad:
        af = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mad))
    else:
        af = _yarn_mscale(factor, 1.0)
    if mscale is not None and math.isclose(_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, a), af,
                                           rel_tol=1e-12, abs_tol=0.0):
        m = float(mscale)  # the given mscale already gives transformers' factor (always when mscale and mad are set)
    elif factor <= 1:
        if abs(af - 1.0) > 1e-12:
            raise _bad(f"{name}.attention_factor", af, "cannot be represented with factor <= 1")
        m = 1.0
    else:
        m = (af * _yarn_mscale(factor, a) - 1.0) / (0.1 * math.log(factor))
    kw: dict[str, Any] = dict(factor=factor, original_max_position_embeddings=orig, mscale=m, mscale_all_dim=a)
    # transformers reads `beta_fast or 32`, `beta_slow or 1`
    kw["beta_fast"] = float(params.get("beta_fast") or 32.0)
    kw["beta_slow"] = float(params.get("beta_slow") or 1.0)
    return float(theta), YaRNScaling(**kw)


def config_from_hf(hf_config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """Our :class:`ModelConfig` computing what transformers computes for ``hf_config`` (a parsed ``config.json``).

    Every field that changes the forward pass is mapped; one we cannot compute is a ValueError naming the field
    and value. ``overrides`` replace ModelConfig fields afterwards (``moe`` may be a dict of MoEConfig fields), e.g.
    ``max_seq_len=4096`` or training-only settings such as ``moe={"aux_loss_type": "global"}``.
    """
    hf = _HF(hf_config)
    mt = hf.model_type
    g = hf.get

    if hf.d.get("quantization_config") is not None:
        raise _bad("quantization_config", hf.d["quantization_config"],
                   "quantized checkpoints are not supported; convert the weights to bf16/fp32 first")
    act = g("hidden_act")
    if act != "silu":
        raise _bad("hidden_act", act, "only 'silu' (SwiGLU) MLPs are supported")
    if g("attention_bias"):
        raise _bad("attention_bias", g("attention_bias"), "attention projections with biases are not supported")
    for key in ("mlp_bias", "qkv_bias"):
        if hf.d.get(key):
            raise _bad(key, hf.d[key], "projection biases are not supported")
    if g("attention_dropout", 0.0):
        raise _bad("attention_dropout", g("attention_dropout"), "attention dropout is not supported")
    layer_types = hf.d.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise _bad("layer_types", layer_types, "only full (causal) attention layers are supported")
    if mt in ("qwen3_moe", "qwen3"):
        if g("use_sliding_window"):
            raise _bad("use_sliding_window", g("use_sliding_window"), "sliding-window attention is not supported")
    elif hf.d.get("sliding_window") is not None:
        raise _bad("sliding_window", hf.d["sliding_window"], "sliding-window attention is not supported")
    if mt == "mixtral" and g("router_jitter_noise"):
        raise _bad("router_jitter_noise", g("router_jitter_noise"), "router jitter is not supported")
    if mt == "olmoe" and g("clip_qkv") is not None:
        raise _bad("clip_qkv", g("clip_qkv"), "clipping q/k/v activations is not supported")

    D = int(g("hidden_size"))
    L = int(g("num_hidden_layers"))
    H = int(g("num_attention_heads"))
    G = g("num_key_value_heads")
    G = H if G is None else int(G)
    max_pos = int(g("max_position_embeddings"))
    theta, yarn = _rope_from_hf(hf, max_pos)
    eps = float(g("rms_norm_eps"))
    common: dict[str, Any] = dict(
        vocab_size=int(g("vocab_size")), hidden_size=D, num_layers=L, num_heads=H, max_seq_len=max_pos,
        rope_theta=theta, rope_scaling=yarn, tie_embeddings=bool(g("tie_word_embeddings")), norm_eps=eps,
    )
    aux_coeff = float(g("router_aux_loss_coef", 0.0) or 0.0)
    k = int(g("num_experts_per_tok"))

    if mt == "deepseek_v3":
        if G != H:
            raise _bad("num_key_value_heads", G, f"MLA needs num_key_value_heads == num_attention_heads ({H})")
        if eps != _DEEPSEEK_LATENT_NORM_EPS:
            raise _bad("rms_norm_eps", eps, "transformers' DeepSeek-V3 uses eps=1e-6 for its latent norms and "
                       "rms_norm_eps elsewhere; our model uses one eps: only 1e-6 is supported")
        E = int(_first_present(hf, "n_routed_experts", "num_local_experts"))
        F = int(g("moe_intermediate_size"))
        n_shared = int(g("n_shared_experts") or 0)
        n_group, topk_group = g("n_group"), g("topk_group")
        n_group = 1 if n_group is None else int(n_group)
        topk_group = n_group if topk_group is None else int(topk_group)
        num_groups = group_topk = None
        if n_group > 1 and topk_group < n_group:
            if E % n_group:
                raise _bad("n_group", n_group, f"n_routed_experts={E} is not divisible by it")
            if k % topk_group or k // topk_group != 2:
                raise _bad("topk_group", topk_group, f"transformers scores a group by the sum of its top-2 scores; "
                           f"our router by its top (num_experts_per_tok / topk_group) = {k}/{topk_group}: "
                           f"only num_experts_per_tok == 2 * topk_group is supported")
            num_groups, group_topk = n_group, topk_group
        norm = bool(g("norm_topk_prob"))
        if k == 1 and norm:
            raise _bad("num_experts_per_tok", k, "top-1 routing with norm_topk_prob=True is not supported")
        scale = float(g("routed_scaling_factor") or 1.0)
        first_k = min(int(g("first_k_dense_replace") or 0), L)
        moe = MoEConfig(
            num_experts=E, top_k=k, expert_hidden_size=F, score_func="sigmoid", pre_softmax=True,
            norm_topk_prob=norm, scaling_factor=None if scale == 1.0 else scale, num_groups=num_groups,
            group_topk=group_topk, expert_bias=True, bias_update_rate=1e-3, aux_loss_type="seq",
            aux_loss_coeff=1e-4, shared_expert_hidden_size=n_shared * F, first_k_dense=first_k,
        )
        q_lora = g("q_lora_rank")
        cfg = ModelConfig(
            **common, num_kv_heads=H, dense_hidden_size=int(g("intermediate_size")), attention="mla",
            q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(g("kv_lora_rank")),
            qk_nope_head_dim=int(g("qk_nope_head_dim")), qk_rope_head_dim=int(g("qk_rope_head_dim")),
            v_head_dim=int(g("v_head_dim")), moe=moe,
        )
        return _apply_overrides(cfg, overrides)

    # ---- GQA families ----
    head_dim = hf.d.get("head_dim") or D // H
    if mt == "olmoe" and head_dim != D // H:
        raise _bad("head_dim", head_dim, f"OLMoE's q/k norms are sized by hidden_size; head_dim must be "
                   f"hidden_size / num_attention_heads = {D // H}")
    if mt in DENSE_MODEL_TYPES:
        E, F, dense, norm, pre = 0, 0, list(range(L)), False, True
        qk = "head" if mt == "qwen3" else "none"
        dense_F = int(g("intermediate_size"))
    elif mt == "qwen3_moe":
        E = int(_first_present(hf, "num_experts", "num_local_experts") or 0)
        F = int(g("moe_intermediate_size"))
        step = int(g("decoder_sparse_step") or 1)
        mlp_only = [int(i) for i in (g("mlp_only_layers") or [])]
        dense = [i for i in range(L) if not (i not in mlp_only and E > 0 and (i + 1) % step == 0)]
        norm, pre, qk = bool(g("norm_topk_prob")), True, "head"
        dense_F = int(g("intermediate_size"))
    elif mt == "mixtral":
        E = int(_first_present(hf, "num_local_experts", "num_experts"))
        F = dense_F = int(g("intermediate_size"))
        dense, norm, pre, qk = [], True, False, "none"
    else:  # olmoe
        E = int(_first_present(hf, "num_experts", "num_local_experts"))
        F = dense_F = int(g("intermediate_size"))
        dense, norm, pre, qk = [], bool(g("norm_topk_prob")), True, "full"
    if E == 0 or len(dense) == L:
        moe = MoEConfig(num_experts=0)
    else:
        if k == 1 and norm and pre:
            raise _bad("num_experts_per_tok", k, "top-1 routing with norm_topk_prob=True is not supported")
        first_k = 0
        while first_k in dense:
            first_k += 1
        rest = [i for i in dense if i >= first_k]
        moe = MoEConfig(
            num_experts=E, top_k=k, expert_hidden_size=F, score_func="softmax", pre_softmax=pre, norm_topk_prob=norm,
            aux_loss_type="aux", aux_loss_coeff=aux_coeff, first_k_dense=first_k, dense_layers=rest or None,
        )
    cfg = ModelConfig(**common, num_kv_heads=G, head_dim=int(head_dim), dense_hidden_size=dense_F, qk_norm=qk,
                      moe=moe)
    return _apply_overrides(cfg, overrides)


def _apply_overrides(cfg: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    if not overrides:
        return cfg
    overrides = dict(overrides)
    moe_over = overrides.pop("moe", None)
    if moe_over:
        if isinstance(moe_over, MoEConfig):
            overrides["moe"] = moe_over
        else:
            overrides["moe"] = dataclasses.replace(cfg.moe, **moe_over)
    return dataclasses.replace(cfg, **overrides)


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    rp: dict[str, Any] = {"rope_theta": float(cfg.rope_theta), "rope_type": "default"}
    s = cfg.rope_scaling
    if s is not None:
        rp.update(rope_type="yarn", factor=float(s.factor),
                  original_max_position_embeddings=int(s.original_max_position_embeddings),
                  beta_fast=float(s.beta_fast), beta_slow=float(s.beta_slow), mscale=float(s.mscale),
                  mscale_all_dim=float(s.mscale_all_dim))
        if not (s.mscale and s.mscale_all_dim) and not (s.mscale == 1.0 and s.mscale_all_dim == 0.0):
            rp["attention_factor"] = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return rp


def export_families(cfg: ModelConfig) -> dict[str, Optional[str]]:
    """For each family ``save_hf`` writes: None when it holds ``cfg`` exactly, else the field that stops it."""
    out: dict[str, Optional[str]] = {}
    for mt in EXPORT_MODEL_TYPES:
        try:
            config_to_hf(cfg, mt)
            out[mt] = None
        except ValueError as e:
            out[mt] = str(e).removeprefix(f"cannot export to {mt}: ")
    return out


def config_to_hf(cfg: ModelConfig, model_type: str, *, dtype: Optional[torch.dtype] = None) -> dict[str, Any]:
    """A transformers 5 ``config.json`` dict for ``cfg`` as a ``model_type`` model; a ValueError naming the field
    when that family cannot express ``cfg``."""
    if model_type not in EXPORT_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} cannot be exported; supported: {', '.join(EXPORT_MODEL_TYPES)}")
    m = cfg.moe

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"cannot export to {model_type}: {what}")

    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    need(m.num_experts > 0 or model_type == "qwen3_moe", "moe.num_experts=0 (a dense model); use qwen3_moe")
    need(not m.shared_expert_gate, "moe.shared_expert_gate=True has no equivalent")
    if m.num_experts > 0:
        need(m.capacity_factor is None, f"moe.capacity_factor={m.capacity_factor} (token dropping) has no equivalent")
        need(not m.force_balance, "moe.force_balance=True has no equivalent")
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": _rope_to_hf(cfg),
        "initializer_range": cfg.init_std,
        "use_cache": True,
    }
    if dtype is not None:
        out["dtype"] = str(dtype).replace("torch.", "")
    if model_type == "deepseek_v3":
        need(cfg.attention == "mla", "attention must be 'mla'")
        need(m.score_func == "sigmoid", "moe.score_func must be 'sigmoid'")
        need(cfg.norm_eps == _DEEPSEEK_LATENT_NORM_EPS, f"norm_eps={cfg.norm_eps}: transformers' DeepSeek-V3 latent "
             f"norms use 1e-6")
        need(dense == list(range(len(dense))), f"dense layers {dense} are not the first k layers")
        S, F = m.shared_expert_hidden_size, m.expert_hidden_size
        need(S > 0 and S % F == 0, f"moe.shared_expert_hidden_size={S} must be a positive multiple of "
             f"expert_hidden_size={F} (n_shared_experts)")
        need(not (m.top_k == 1 and m.norm_topk_prob), "top-1 routing with norm_topk_prob=True")
        if m.num_groups is not None:
            assert m.group_topk is not None
            need(m.top_k == 2 * m.group_topk, f"group-limited routing with top_k={m.top_k} != 2 * group_topk="
                 f"{m.group_topk} (transformers scores groups by their top-2)")
            need(m.num_experts // m.num_groups >= 2, "fewer than 2 experts per group")
        out.update(
            num_key_value_heads=cfg.num_heads, intermediate_size=cfg.dense_hidden_size, moe_intermediate_size=F,
            n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, n_shared_experts=S // F,
            routed_scaling_factor=float(m.scaling_factor or 1.0), norm_topk_prob=m.norm_topk_prob,
            n_group=m.num_groups or 1, topk_group=m.group_topk or 1, first_k_dense_replace=len(dense),
            q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=True,
            num_nextn_predict_layers=0,
        )
        return out
    need(cfg.attention == "gqa", f"attention={cfg.attention!r}: {model_type} uses GQA")
    out.update(num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    if m.num_experts > 0:
        need(m.score_func == "softmax", f"moe.score_func={m.score_func!r}: {model_type} routes by softmax")
        need(m.num_groups is None, "group-limited routing has no equivalent")
        need(not m.expert_bias, "moe.expert_bias has no equivalent")
        need(m.scaling_factor in (None, 1.0), f"moe.scaling_factor={m.scaling_factor} has no equivalent")
        need(m.shared_expert_hidden_size == 0, f"moe.shared_expert_hidden_size={m.shared_expert_hidden_size}: shared "
             "experts have no equivalent")
        need(not (m.top_k == 1 and m.norm_topk_prob and m.pre_softmax), "top-1 routing with norm_topk_prob=True")
    if model_type == "qwen3_moe":
        need(cfg.qk_norm == "head", f"qk_norm={cfg.qk_norm!r}: Qwen3-MoE has per-head qk-norm ('head')")
        if m.num_experts > 0:
            need(m.pre_softmax, "moe.pre_softmax=False (Mixtral routing): use mixtral")
        out.update(
            intermediate_size=cfg.dense_hidden_size, moe_intermediate_size=m.expert_hidden_size,
            num_experts=m.num_experts, num_experts_per_tok=m.top_k if m.num_experts else 1,
            norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1,
            mlp_only_layers=dense if m.num_experts else [], use_sliding_window=False, sliding_window=None,
            router_aux_loss_coef=m.aux_loss_coeff,
        )
        return out
    need(not dense, f"dense layers {dense}: {model_type} has MoE layers only")
    if model_type == "mixtral":
        need(cfg.qk_norm == "none", f"qk_norm={cfg.qk_norm!r}: Mixtral has no qk-norm")
        need(not m.pre_softmax or m.top_k == 1 or m.norm_topk_prob,
             "softmax over all experts without renormalising the top-k")
        out.update(intermediate_size=m.expert_hidden_size, num_local_experts=m.num_experts,
                   num_experts_per_tok=m.top_k, sliding_window=None, router_jitter_noise=0.0,
                   router_aux_loss_coef=m.aux_loss_coeff)
        return out
    # olmoe
    need(cfg.qk_norm == "full", f"qk_norm={cfg.qk_norm!r}: OLMoE normalises q and k over all heads ('full')")
    need(cfg.head_dim == cfg.hidden_size // cfg.num_heads, "OLMoE needs head_dim == hidden_size / num_heads")
    need(m.pre_softmax, "moe.pre_softmax=False (Mixtral routing): use mixtral")
    out.update(intermediate_size=m.expert_hidden_size, num_experts=m.num_experts, num_experts_per_tok=m.top_k,
               norm_topk_prob=m.norm_topk_prob, clip_qkv=None, router_aux_loss_coef=m.aux_loss_coeff)
    return out


# ====================================================================================================================
# tensor sources
# ====================================================================================================================


class _Source:
    """What the loader needs from a set of named tensors: keys, shapes, and reading a box of one tensor."""

    bytes_read: int
    bytes_by_key: dict[str, int]

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _read(self, key: str, box: tuple[slice, ...]) -> Tensor:
        raise NotImplementedError

    def read(self, key: str, box: tuple[slice, ...]) -> Tensor:
        """``tensor[box]`` (one ``slice`` per dimension, step 1), counting the bytes read."""
        out = self._read(key, box)
        n = out.numel() * out.element_size()
        self.bytes_read += n
        self.bytes_by_key[key] = self.bytes_by_key.get(key, 0) + n
        return out


class HFCheckpointReader(_Source):
    """Lazy reader of a Hugging Face model folder's safetensors: ``model.safetensors`` or
    ``model.safetensors.index.json`` + shards. Only the boxes asked for are read (``safe_open(...).get_slice``).

    ``bytes_read`` / ``bytes_by_key``: bytes read so far (all keys / per key). Use as a context manager or call
    :meth:`close`.
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        try:
            import safetensors
        except ImportError as e:  # pragma: no cover - safetensors is a dependency of the hf extra
            raise ImportError("reading Hugging Face weights needs safetensors: pip install 'lightning_moe[hf]'") from e
        del safetensors
        self.path = os.fspath(path)
        self.bytes_read = 0
        self.bytes_by_key = {}
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map'")
            self._file_of = {}
            for k, fname in weight_map.items():
                if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in (".", ".."):
                    raise ValueError(f"{index}: shard name {fname!r} of {k!r} is not a plain file name in the folder")
                self._file_of[k] = os.path.join(self.path, fname)
        elif os.path.isfile(single):
            self._file_of = None
            self._single = single
        else:
            bins = [f for f in os.listdir(self.path) if f.endswith(".bin")] if os.path.isdir(self.path) else []
            hint = f" (found {bins}: pickle files are never loaded; convert them to safetensors)" if bins else ""
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {self.path!r}{hint}")
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        if self._file_of is None:
            h = self._handle(self._single)
            self._file_of = {k: self._single for k in h.keys()}
        for fname in sorted(set(self._file_of.values())):
            if not os.path.isfile(fname):
                raise ValueError(f"shard {fname!r} named in the index is missing")
            h = self._handle(fname)
            for k in h.keys():
                if self._file_of.get(k) == fname:
                    self._shapes[k] = tuple(h.get_slice(k).get_shape())
        missing = sorted(k for k in self._file_of if k not in self._shapes)
        if missing:
            raise ValueError(f"tensors named in the index are not in their shard: {_fmt(missing)}")

    def _handle(self, fname: str) -> Any:
        from safetensors import SafetensorError, safe_open

        h = self._handles.get(fname)
        if h is None:
            try:
                h = self._stack.enter_context(safe_open(fname, framework="pt", device="cpu"))
            except SafetensorError as e:  # a truncated download, a damaged copy
                raise ValueError(f"{fname} cannot be read as safetensors ({e}): the file is damaged or incomplete; "
                                 "copy or download it again") from e
            self._handles[fname] = h
        return h

    def keys(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def _read(self, key: str, box: tuple[slice, ...]) -> Tensor:
        h = self._handle(self._file_of[key])
        if len(box) == 0:  # a 0-dim tensor
            return h.get_tensor(key)
        return h.get_slice(key)[box]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> "HFCheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _DictSource(_Source):
    """An in-memory Hugging Face state dict (e.g. a transformers 5 model's, with fused experts)."""

    def __init__(self, sd: Mapping[str, Tensor]) -> None:
        self.sd = dict(sd)
        self.bytes_read = 0
        self.bytes_by_key = {}

    def keys(self) -> list[str]:
        return sorted(self.sd)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.sd[key].shape)

    def _read(self, key: str, box: tuple[slice, ...]) -> Tensor:
        return self.sd[key].detach()[box]


# ====================================================================================================================
# the key/layout plan: for each of our tensors, where it lives in a Hugging Face checkpoint
# ====================================================================================================================


@dataclass(frozen=True)
class _Direct:
    """``ours = source[key]`` restricted to ``offset[d] : offset[d] + ours.shape[d]`` per dim, rows (dim 0) optionally
    permuted (``ours[r] = source[perm[r]]``). ``src_shape``: the source's expected full shape."""

    key: str
    src_shape: tuple[int, ...]
    offset: tuple[int, ...] = ()
    perm: Optional[tuple[int, ...]] = None

    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {self.key: self.src_shape}

    def read(self, src: _Source, region: tuple[slice, ...]) -> Tensor:
        off = self.offset + (0,) * (len(region) - len(self.offset))
        if self.perm is None:
            return src.read(self.key, tuple(slice(r.start + o, r.stop + o) for r, o in zip(region, off)))
        rows = torch.tensor(self.perm[region[0]], dtype=torch.long)
        rest = tuple(slice(r.start + o, r.stop + o) for r, o in zip(region[1:], off[1:]))
        if rows.numel() == 0:
            return src.read(self.key, (slice(off[0], off[0]),) + rest)
        lo, hi = int(rows.min()), int(rows.max()) + 1
        block = src.read(self.key, (slice(lo + off[0], hi + off[0]),) + rest)
        return block[rows - lo]


@dataclass(frozen=True)
class _Stack:
    """``ours[e] = source[keys[e]]``: one source tensor (one dim less) per index of our dim 0 (per-expert weights)."""

    keys_: tuple[str, ...]
    src_shape: tuple[int, ...]

    def keys(self) -> tuple[str, ...]:
        return self.keys_

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {k: self.src_shape for k in self.keys_}

    def read(self, src: _Source, region: tuple[slice, ...]) -> Tensor:
        parts = [src.read(self.keys_[e], region[1:]) for e in range(region[0].start, region[0].stop)]
        if not parts:
            return torch.empty((0,) + tuple(r.stop - r.start for r in region[1:]))
        return torch.stack(parts)


_Recipe = Union[_Direct, _Stack]


def _interleave_perm(r: int) -> list[int]:
    """Rotate-half position j holds the interleaved position perm[j]: evens, then odds."""
    return list(range(0, r, 2)) + list(range(1, r, 2))


def _mla_q_perm(H: int, nope: int, rope: int) -> tuple[int, ...]:
    p = _interleave_perm(rope)
    qk = nope + rope
    return tuple(h * qk + j if j < nope else h * qk + nope + p[j - nope] for h in range(H) for j in range(qk))


def _mla_kv_perm(kv_lora_rank: int, rope: int) -> tuple[int, ...]:
    return tuple(range(kv_lora_rank)) + tuple(kv_lora_rank + j for j in _interleave_perm(rope))


_MLP_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass
class _Family:
    model_type: str
    rope_interleave: bool = False

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> "_Family":
        hf = _HF(hf_config)
        inter = bool(hf.get("rope_interleave")) if hf.model_type == "deepseek_v3" else False
        return cls(hf.model_type, inter)


def _mlp_weight(prefix: str, w: str, D: int, hidden: int) -> "_Direct":
    """One weight of a SwiGLU MLP (w1 gate / w3 up [hidden, D], w2 down [D, hidden]) under ``prefix``."""
    return _Direct(prefix + f"{_MLP_NAMES[w]}.weight", (D, hidden) if w == "w2" else (hidden, D))


def _plan(cfg: ModelConfig, fam: _Family, our_keys: Iterable[str], available: Optional[set[str]] = None
          ) -> dict[str, _Recipe]:
    """For each of ``our_keys``, the recipe reading it from Hugging Face tensors. ``available``: the source's keys
    (chooses per-expert vs fused experts and Mixtral's module name); None = the on-disk (per-expert) layout."""
    mt = fam.model_type
    D, m = cfg.hidden_size, cfg.moe
    E, F = m.num_experts, m.expert_hidden_size
    avail = available or set()
    plan: dict[str, _Recipe] = {}
    q_perm = kv_perm = None
    if cfg.attention == "mla" and fam.rope_interleave:
        q_perm = _mla_q_perm(cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim)
        kv_perm = _mla_kv_perm(cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    attn_names = {
        "wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm",
    } if cfg.attention == "gqa" else {
        "wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
        "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj",
    }
    per_expert = {"w1": "w1", "w3": "w3", "w2": "w2"} if mt == "mixtral" else _MLP_NAMES

    def moe_prefix(i: int) -> str:
        if mt == "mixtral":
            # on disk: block_sparse_moe; transformers 5 in memory: mlp
            if available is None or any(k.startswith(f"model.layers.{i}.block_sparse_moe.") for k in avail):
                return f"model.layers.{i}.block_sparse_moe."
        return f"model.layers.{i}.mlp."

    for key in our_keys:
        if key == "tok_embeddings.weight":
            plan[key] = _Direct("model.embed_tokens.weight", (cfg.vocab_size, D))
            continue
        if key == "norm.weight":
            plan[key] = _Direct("model.norm.weight", (D,))
            continue
        if key == "output.weight":
            plan[key] = _Direct("lm_head.weight", (cfg.vocab_size, D))
            continue
        mm = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if mm is None:
            raise ValueError(f"no Hugging Face equivalent for our tensor {key!r}")
        i, rest = int(mm.group(1)), mm.group(2)
        L = f"model.layers.{i}."
        if rest == "attention_norm.weight":
            plan[key] = _Direct(L + "input_layernorm.weight", (D,))
            continue
        if rest == "ffn_norm.weight":
            plan[key] = _Direct(L + "post_attention_layernorm.weight", (D,))
            continue
        a = re.fullmatch(r"attention\.(\w+)\.weight", rest)
        if a and a.group(1) in attn_names:
            name = a.group(1)
            plan[key] = _Direct(L + f"self_attn.{attn_names[name]}.weight", _attn_shape(cfg, name),
                                perm=q_perm if name in ("wq", "wq_b") else kv_perm if name == "wkv_a" else None)
            continue
        f = re.fullmatch(r"feed_forward\.(w[123])\.weight", rest)
        if f:
            plan[key] = _mlp_weight(L + "mlp.", f.group(1), D, cfg.dense_hidden_size)
            continue
        P = moe_prefix(i)
        if rest == "moe.router.weight":
            plan[key] = _Direct(P + "gate.weight", (E, D))
            continue
        if rest == "moe.router.expert_bias":
            plan[key] = _Direct(P + "gate.e_score_correction_bias", (E,))
            continue
        x = re.fullmatch(r"moe\.experts\.(w[123])", rest)
        if x:
            w = x.group(1)
            if P + "experts.gate_up_proj" in avail or P + "experts.down_proj" in avail:
                if w == "w2":
                    plan[key] = _Direct(P + "experts.down_proj", (E, D, F))
                else:
                    plan[key] = _Direct(P + "experts.gate_up_proj", (E, 2 * F, D), offset=(0, 0 if w == "w1" else F, 0))
            else:
                shape = (D, F) if w == "w2" else (F, D)
                plan[key] = _Stack(tuple(P + f"experts.{j}.{per_expert[w]}.weight" for j in range(E)), shape)
            continue
        s = re.fullmatch(r"moe\.shared_experts\.(w[123])\.weight", rest)
        if s:
            plan[key] = _mlp_weight(L + "mlp.shared_experts.", s.group(1), D, m.shared_expert_hidden_size)
            continue
        raise ValueError(f"no Hugging Face {mt} equivalent for our tensor {key!r}")
    return plan


def _attn_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    D, H = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "gqa":
        K, G = cfg.head_dim, cfg.num_kv_heads
        assert K is not None
        full = cfg.qk_norm == "full"
        return {"wq": (H * K, D), "wk": (G * K, D), "wv": (G * K, D), "wo": (D, H * K),
                "q_norm": (H * K,) if full else (K,), "k_norm": (G * K,) if full else (K,)}[name]
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return {"wq": (H * qk, D), "wq_a": (cfg.q_lora_rank or 0, D), "q_norm": (cfg.q_lora_rank or 0,),
            "wq_b": (H * qk, cfg.q_lora_rank or 0), "wkv_a": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D),
            "kv_norm": (cfg.kv_lora_rank,), "wkv_b": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            "wo": (D, H * cfg.v_head_dim)}[name]


# ====================================================================================================================
# import
# ====================================================================================================================


def _fmt(keys: Iterable[str], n: int = 12) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


@dataclass
class HFLoadResult:
    """What :func:`load_hf_weights_` did on this rank."""

    bytes_read: int = 0
    bytes_by_key: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)      # MTP layers (index >= num_layers), tied lm_head
    unexpected: list[str] = field(default_factory=list)   # only with strict=False
    missing: list[str] = field(default_factory=list)      # only with strict=False


def _local_region(t: Tensor) -> tuple[Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, its box in global coordinates) for a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(local.shape) != tuple(shape):
            raise ValueError(f"cannot locate a DTensor shard: local shape {tuple(local.shape)} != computed {shape}")
        if len(offset) != len(shape):  # rank outside the mesh: nothing local
            offset = (0,) * len(shape)
        return local, tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return t, tuple(slice(0, s) for s in t.shape)


_COMPARED = ("vocab_size", "hidden_size", "num_layers", "num_heads", "rope_theta", "rope_scaling", "tie_embeddings",
             "norm_eps", "attention")
_COMPARED_GQA = ("num_kv_heads", "head_dim", "qk_norm")
_COMPARED_MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_COMPARED_MOE = ("num_experts", "top_k", "expert_hidden_size", "score_func", "norm_topk_prob", "num_groups",
                 "group_topk", "shared_expert_hidden_size", "shared_expert_gate")


def _config_differences(ours: ModelConfig, want: ModelConfig) -> list[str]:
    """Fields in which ``ours`` computes something else than ``want`` (the checkpoint's)."""
    diffs = []
    names = _COMPARED + (_COMPARED_GQA if want.attention == "gqa" else _COMPARED_MLA)
    for n in names:
        if getattr(ours, n) != getattr(want, n):
            diffs.append(f"{n}: model {getattr(ours, n)!r} vs checkpoint {getattr(want, n)!r}")
    a, b = ours.moe, want.moe
    if b.num_experts > 0:
        for n in _COMPARED_MOE:
            if getattr(a, n) != getattr(b, n):
                diffs.append(f"moe.{n}: model {getattr(a, n)!r} vs checkpoint {getattr(b, n)!r}")
        if b.score_func == "softmax" and a.pre_softmax != b.pre_softmax and b.top_k > 1:
            diffs.append(f"moe.pre_softmax: model {a.pre_softmax!r} vs checkpoint {b.pre_softmax!r}")
        if (a.scaling_factor or 1.0) != (b.scaling_factor or 1.0):
            diffs.append(f"moe.scaling_factor: model {a.scaling_factor!r} vs checkpoint {b.scaling_factor!r}")
        if a.expert_bias != b.expert_bias:
            diffs.append(f"moe.expert_bias: model {a.expert_bias!r} vs checkpoint {b.expert_bias!r}")
    elif a.num_experts != 0:
        diffs.append(f"moe.num_experts: model {a.num_experts} vs checkpoint 0")
    lo = [i for i in range(ours.num_layers) if ours.is_moe_layer(i)]
    lw = [i for i in range(want.num_layers) if want.is_moe_layer(i)]
    if lo != lw:
        diffs.append(f"MoE layers: model {lo} vs checkpoint {lw}")
    if len(lw) < want.num_layers and ours.dense_hidden_size != want.dense_hidden_size:
        diffs.append(f"dense_hidden_size: model {ours.dense_hidden_size} vs checkpoint {want.dense_hidden_size}")
    return diffs


def _model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Our state-dict entries (parameters and persistent buffers) by clean name, as the live tensors."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out[clean_param_name(name)] = t
    return out


@torch.no_grad()
def _load_from_source(model: nn.Module, src: _Source, hf_config: Mapping[str, Any], *, strict: bool,
                      check_config: bool) -> HFLoadResult:
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    fam = _Family.from_hf(hf_config)
    if check_config:
        want = config_from_hf(hf_config)
        diffs = _config_differences(cfg, want)
        if diffs:
            raise ValueError("the model's config does not match the checkpoint's config.json: " + "; ".join(diffs)
                             + " (build the model from config_from_hf(load_hf_config(path)), or pass "
                             "check_config=False)")
    tensors = _model_tensors(model)
    src_keys = set(src.keys())
    result = HFLoadResult()

    # MTP modules (DeepSeek-V3's layer num_hidden_layers..) and a tied lm_head copy are not ours to load
    used: set[str] = set()
    mtp: set[int] = set()
    for k in sorted(src_keys):
        mm = re.match(r"model\.layers\.(\d+)\.", k)
        if mm and int(mm.group(1)) >= cfg.num_layers:
            result.skipped.append(k)
            mtp.add(int(mm.group(1)))
        elif k == "lm_head.weight" and cfg.tie_embeddings:
            result.skipped.append(k)
    if result.skipped:
        if mtp:
            log.info("Hugging Face import: skipping layers %s (multi-token-prediction modules past num_layers=%d)",
                     sorted(mtp), cfg.num_layers)
        if "lm_head.weight" in result.skipped:
            log.info("Hugging Face import: skipping lm_head.weight (tie_embeddings: the output reuses the embedding)")
    used.update(result.skipped)

    plan = _plan(cfg, fam, tensors.keys(), src_keys)
    missing = sorted({k for r in plan.values() for k in r.keys()} - src_keys)
    # shape checks of every source a recipe reads
    wrong = []
    for r in plan.values():
        for k, shp in r.expected().items():
            if k in src_keys and tuple(src.shape(k)) != tuple(shp):
                wrong.append(f"{k}: checkpoint {tuple(src.shape(k))} vs expected {tuple(shp)}")
    if wrong:
        raise ValueError("Hugging Face tensors with unexpected shapes: " + "; ".join(sorted(set(wrong))[:12]))
    for ours, r in plan.items():
        if tuple(tensors[ours].shape) != _our_shape(r, tensors[ours]):
            raise ValueError(f"our tensor {ours} has shape {tuple(tensors[ours].shape)}, its Hugging Face source "
                             f"gives {_our_shape(r, tensors[ours])}")
    for r in plan.values():
        used.update(r.keys())
    unexpected = sorted(src_keys - used)
    if missing:
        if strict:
            raise ValueError(f"Hugging Face checkpoint lacks tensors the model needs: {_fmt(missing)}")
        result.missing = missing
    if unexpected:
        if strict:
            raise ValueError(f"Hugging Face checkpoint holds tensors the model has no place for: {_fmt(unexpected)}")
        result.unexpected = unexpected

    with torch.no_grad():
        for ours, r in plan.items():
            if any(k in missing for k in r.keys()):
                continue
            t = tensors[ours]
            if t.is_meta:
                raise ValueError(f"{ours} is on the meta device: materialise the model (to_empty) before loading")
            local, region = _local_region(t)
            if any(s.stop <= s.start for s in region) and len(region) > 0:
                continue
            val = r.read(src, region)
            if tuple(val.shape) != tuple(local.shape):
                raise ValueError(f"{ours}: read {tuple(val.shape)} for a local shard of {tuple(local.shape)}")
            local.copy_(val.to(dtype=local.dtype, device=local.device))
    model.reset_buffers()  # RoPE tables (garbage after to_empty), bias-update counts
    result.bytes_read = src.bytes_read
    result.bytes_by_key = dict(src.bytes_by_key)
    return result


def _our_shape(r: _Recipe, t: Tensor) -> tuple[int, ...]:
    if isinstance(r, _Stack):
        return (len(r.keys_),) + tuple(r.src_shape)
    if r.offset:  # fused gate_up: our half of dim 1
        return tuple(t.shape)
    return tuple(r.src_shape)


def load_hf_weights_(model: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True,
                     check_config: bool = True, hf_config: Optional[Mapping[str, Any]] = None) -> HFLoadResult:
    """Fill ``model`` (a :class:`~lightning_moe.models.transformer.MoETransformer`, plain or parallelized: its
    parameters may be DTensors) from the Hugging Face folder ``path`` in place.

    Each parameter reads only the global box of its local shard (experts of this EP rank, rows of this FSDP/TP
    shard). Every checkpoint tensor must be used and every parameter filled, else a ValueError naming the keys
    (``strict=False``: report them in the result instead). Tensors of layers past ``num_layers`` (DeepSeek-V3's
    multi-token-prediction modules) are skipped with a log line. ``check_config``: the model's config must compute
    what ``config.json`` describes (ValueError naming the differing fields). RoPE tables are rebuilt, so a model
    materialised with ``to_empty`` is ready to run after this call. Returns the bytes read and what was skipped.
    """
    hf_config = load_hf_config(path) if hf_config is None else hf_config
    with HFCheckpointReader(path) as reader:
        return _load_from_source(model, reader, hf_config, strict=strict, check_config=check_config)


def load_hf_state_dict_(model: nn.Module, hf_state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any], *,
                        strict: bool = True, check_config: bool = True) -> HFLoadResult:
    """:func:`load_hf_weights_` from an in-memory Hugging Face state dict (per-expert or transformers 5's fused
    ``gate_up_proj`` / ``down_proj`` experts); ``hf_config`` is the config dict (``hf_model.config.to_dict()``)."""
    return _load_from_source(model, _DictSource(hf_state_dict), hf_config, strict=strict, check_config=check_config)


def from_hf(path: Union[str, os.PathLike], *, device: Union[str, torch.device] = "cpu",
            dtype: Optional[torch.dtype] = None, **overrides: Any) -> nn.Module:
    """A single-process :class:`MoETransformer` with the weights of the Hugging Face folder ``path``."""
    from lightning_moe.models.transformer import MoETransformer

    hf = load_hf_config(path)
    cfg = config_from_hf(hf, **overrides)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    load_hf_weights_(model, path, hf_config=hf, check_config=False)
    return model


# ====================================================================================================================
# export
# ====================================================================================================================


def _full(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def to_hf_state_dict(state_dict: Mapping[str, Tensor], cfg: ModelConfig, model_type: str, *, keep: bool = True
                     ) -> dict[str, Tensor]:
    """Our state dict as the Hugging Face tensors of a ``model_type`` checkpoint on disk (per-expert keys;
    DeepSeek-V3 rope rows interleaved). Tensors are fresh copies. DTensors are gathered one at a time (a collective:
    every rank calls this); ``keep=False`` drops each gathered tensor at once (ranks that do not write)."""
    sd = {clean_param_name(k): v for k, v in state_dict.items()}
    fam = _Family(model_type, rope_interleave=(model_type == "deepseek_v3"))
    plan = _plan(cfg, fam, sd.keys(), None)
    out: dict[str, Tensor] = {}
    for ours, r in plan.items():
        t = _full(sd[ours]).detach()
        if not keep:
            del t
            continue
        if isinstance(r, _Stack):
            for j, k in enumerate(r.keys_):
                out[k] = t[j].clone().contiguous()
        else:
            assert not r.offset, "export never writes fused experts"
            if r.perm is not None:
                inv = torch.empty(len(r.perm), dtype=torch.long)
                inv[torch.tensor(r.perm, dtype=torch.long)] = torch.arange(len(r.perm))
                t = t[inv]
            out[r.key] = t.clone().contiguous()
    if keep and model_type == "deepseek_v3" and not cfg.moe.expert_bias:
        # transformers' router always has the correction bias; ours is off: zero computes the same choice
        for i in range(cfg.num_layers):
            if cfg.is_moe_layer(i):
                out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = torch.zeros(cfg.moe.num_experts)
    return out


def save_hf(state_dict_or_model: Union[nn.Module, Mapping[str, Tensor]], out_dir: Union[str, os.PathLike],
            cfg: Optional[ModelConfig] = None, *, model_type: str, max_shard_bytes: int = 5 * 2**30,
            dtype: Optional[torch.dtype] = None, extra_config: Optional[Mapping[str, Any]] = None
            ) -> Optional[list[str]]:
    """Write a Hugging Face folder (``config.json`` + safetensors, sharded with ``model.safetensors.index.json``
    when larger than ``max_shard_bytes``) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    ``state_dict_or_model``: our model (its config is used when ``cfg`` is None) or state dict; DTensors are gathered
    with ``full_tensor()``, so under torch.distributed every rank must call this; rank 0 writes. ``dtype``: cast
    floating tensors (the router and its bias stay as given). ``extra_config``: entries added to ``config.json``
    (e.g. the tokenizer's ``bos_token_id`` / ``eos_token_id``; they are null otherwise). The folder is replaced only
    once complete. Returns the written file names on the writing rank, None elsewhere.
    """
    import torch.distributed as dist

    if isinstance(state_dict_or_model, nn.Module):
        cfg = cfg if cfg is not None else state_dict_or_model.config  # type: ignore[assignment]
        sd = state_dict_or_model.state_dict()
    else:
        sd = dict(state_dict_or_model)
    if cfg is None:
        raise ValueError("save_hf needs cfg (the ModelConfig) when given a state dict")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    try:
        hf_cfg = config_to_hf(cfg, model_type, dtype=dtype)  # validates before any gathering
    except ValueError as e:
        others = {mt: why for mt, why in export_families(cfg).items() if mt != model_type}
        fits = [mt for mt, why in others.items() if why is None]
        stops = "; ".join(f"{mt}: {why}" for mt, why in others.items() if why is not None)
        raise ValueError(f"{e}. " + (f"Families that hold this model: {', '.join(fits)} (model_type="
                                      f"{fits[0]!r}); " if fits else "No other family holds this model: ") + stops
                         ) from None
    hf_cfg.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf_cfg.update(extra_config or {})
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    tensors = to_hf_state_dict(sd, cfg, model_type, keep=rank == 0)  # gathers DTensors (collective)
    if rank != 0:
        if distributed:
            dist.barrier()
        return None
    if dtype is not None:
        for k, v in tensors.items():
            if v.is_floating_point() and not (k.endswith(".gate.weight") or k.endswith("e_score_correction_bias")):
                tensors[k] = v.to(dtype)
    try:
        files = _write_folder(tensors, hf_cfg, os.fspath(out_dir), max_shard_bytes)
    finally:
        if distributed:
            dist.barrier()
    return files


def _write_folder(tensors: dict[str, Tensor], hf_cfg: dict[str, Any], out_dir: str, max_shard_bytes: int
                  ) -> list[str]:
    from safetensors.torch import save_file

    if "dtype" not in hf_cfg:
        dts = {str(v.dtype).replace("torch.", "") for k, v in tensors.items() if ".gate." not in k}
        hf_cfg["dtype"] = dts.pop() if len(dts) == 1 else "float32"
    # greedy shards in key order (a tensor larger than the limit gets a shard of its own)
    shards: list[list[str]] = [[]]
    size = 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hf-export-", dir=parent)
    try:
        names = []
        weight_map = {}
        if len(shards) == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, keys in zip(names, shards):
            save_file({k: tensors[k] for k in keys}, os.path.join(tmp, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in keys})
        if len(shards) > 1:
            total = sum(v.numel() * v.element_size() for v in tensors.values())
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                          indent=2)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_cfg, f, indent=2, sort_keys=True)
        # replace the target only once everything is written
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=".hf-export-old-", dir=parent)
            os.rmdir(old)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(os.listdir(out_dir))
    return files
