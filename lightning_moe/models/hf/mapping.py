"""Per-family state-dict recipes: for each of our tensors, where it lives in a Hugging Face checkpoint (stacked
experts, fused gate/up, DeepSeek-V3's interleaved rope rows) and how it is read back into our layout."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Union

import torch
from torch import Tensor

from lightning_moe.config import ModelConfig
from lightning_moe.models.hf.config import _HF

if TYPE_CHECKING:
    from lightning_moe.models.hf.io import _Source

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
