"""Hugging Face ``config.json`` <-> :class:`~lightning_moe.config.ModelConfig` for the families we import and export.

One piece of about 500 lines: the per-family defaults, the reading of every field that changes the computation and
its inverse (``config_to_hf``, ``export_families``) are one table read in both directions, so they stay side by side.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any, Mapping, Optional, Union

import torch

from lightning_moe.config import ModelConfig, MoEConfig, YaRNScaling

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
