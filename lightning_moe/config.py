"""Model and MoE configuration: plain dataclasses, named presets, validation and parameter counts.

Both dataclasses are plain (no properties with side effects) so that ``dataclasses.replace``,
``dataclasses.asdict`` and LightningCLI/jsonargparse YAML all work on them. Every invalid combination
raises ``ValueError`` with the fix in the message, at construction.

One piece (over 500 lines): the dataclasses, their validation and the presets are read together; a preset is
checked by the same validation that checks a user's fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

__all__ = ["MoEConfig", "ModelConfig", "PRESETS", "preset_names", "resolve_model_config", "YaRNScaling"]

# attention kernels of packed batches (models/document_mask.py)
ATTN_IMPLS = ("auto", "sdpa", "flex", "varlen", "split")

@dataclass
class YaRNScaling:
    """YaRN rope scaling (DeepSeek-V2/V3 style)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings must be positive")


@dataclass
class MoEConfig:
    """Routed-expert configuration; semantics follow Megatron-Core's moe_utils.

    num_experts: routed experts E (0 = dense model, every layer a dense MLP).
    top_k: experts per token k.
    expert_hidden_size: F, the hidden size of one routed expert's SwiGLU.
    score_func: "softmax" or "sigmoid" scores over all experts.
    pre_softmax: softmax over all E experts before top-k (Qwen3/DeepSeek); False = top-k on logits, softmax over
        the k chosen ones (Mixtral). Ignored for sigmoid.
    norm_topk_prob: renormalise the k chosen scores to sum to 1 (sigmoid always normalises when True).
    scaling_factor: multiplies the combine weights (DeepSeek-V3 routed_scaling_factor = 2.5); None = 1.
    num_groups / group_topk: group-limited routing; groups scored by the sum of their top (k / group_topk) scores.
    expert_bias: aux-loss-free balancing bias (fp32 buffer, used for the choice only); requires sigmoid.
    bias_update_rate: u in b_i += u * sign(mean(n) - n_i), once per optimizer step.
    aux_loss_type: "none" | "aux" (micro-batch) | "seq" (per sequence) | "global" (counts over dp ranks).
        "aux" is computed per data-parallel rank on its own micro-batch (Megatron's definition), so its value, and
        the gradient it gives, depend on how the global batch is split over data ranks; "global" does not, nor does
        "seq" (also averaged over data ranks) unless data ranks hold different numbers of sequences with a real
        token. The z-loss is normalised by the real tokens of the whole global micro-batch: layout-invariant.
    capacity_factor: None = dropless; else capacity = ceil(capacity_factor * T * k / E) per expert, T being the
        tokens ONE rank routes (per rank, as in Megatron): which tokens are dropped depends on the layout (the
        data-parallel split, tp and cp), so a capacity-limited run is not layout-invariant; dropless runs are.
    drop_policy: "probs" keeps the highest scores, "position" the earliest tokens.
    pad_to_capacity: pad every expert's buffer to the capacity (static shapes).
    shared_expert_hidden_size: hidden size of the (fused) shared experts; 0 = none.
    shared_expert_gate: sigmoid gate on the shared expert output (Qwen2-MoE style).
    first_k_dense: the first k decoder layers use a dense MLP of ModelConfig.dense_hidden_size.
    dense_layers: further decoder layers (indices) that use a dense MLP instead of routed experts, in addition to
        the first ``first_k_dense`` (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``); None = none.
    force_balance: benchmark mode: ignore the router's choice and assign tokens round-robin.
    router / experts / shared_experts: registered component names (``lightning_moe.models.registry``), checked where
        the model is built.
    """

    num_experts: int = 8
    top_k: int = 2
    expert_hidden_size: int = 64
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    pre_softmax: bool = True
    norm_topk_prob: bool = True
    scaling_factor: Optional[float] = None
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    aux_loss_type: Literal["none", "aux", "seq", "global"] = "aux"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False
    shared_expert_hidden_size: int = 0
    shared_expert_gate: bool = False
    first_k_dense: int = 0
    dense_layers: Optional[list[int]] = None
    force_balance: bool = False
    router: str = "topk"
    experts: str = "grouped_mm"
    shared_experts: str = "swiglu"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        E, k = self.num_experts, self.top_k
        if E < 0:
            raise ValueError(f"moe.num_experts must be >= 0 (0 = dense model), got {E}")
        if E == 0:
            return
        if k < 1:
            raise ValueError(f"moe.top_k must be >= 1, got {k}")
        if k > E:
            raise ValueError(f"moe.top_k={k} exceeds moe.num_experts={E}: set top_k <= num_experts")
        if self.expert_hidden_size <= 0:
            raise ValueError(f"moe.expert_hidden_size must be positive, got {self.expert_hidden_size}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"moe.score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if self.aux_loss_type not in ("none", "aux", "seq", "global"):
            raise ValueError(
                f"moe.aux_loss_type must be one of 'none', 'aux', 'seq', 'global', got {self.aux_loss_type!r}"
            )
        if self.drop_policy not in ("probs", "position"):
            raise ValueError(f"moe.drop_policy must be 'probs' or 'position', got {self.drop_policy!r}")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError("moe.aux_loss_coeff and moe.z_loss_coeff must be >= 0")
        if self.expert_bias and self.score_func != "sigmoid":
            raise ValueError(
                "moe.expert_bias (aux-loss-free balancing) needs score_func='sigmoid' (as in DeepSeek-V3): "
                "with softmax the bias shifts are not comparable across tokens; set score_func='sigmoid' or "
                "expert_bias=False"
            )
        if self.bias_update_rate < 0:
            raise ValueError(f"moe.bias_update_rate must be >= 0, got {self.bias_update_rate}")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("moe.num_groups and moe.group_topk must be set together (or both left None)")
        if self.num_groups is not None:
            g, gk = self.num_groups, self.group_topk
            assert gk is not None
            if g <= 0 or E % g != 0:
                raise ValueError(f"moe.num_experts={E} is not divisible by moe.num_groups={g}: pick a divisor of E")
            if gk <= 0 or gk > g:
                raise ValueError(f"moe.group_topk={gk} must be in [1, num_groups={g}]")
            if k % gk != 0:
                raise ValueError(f"moe.top_k={k} must be divisible by moe.group_topk={gk}")
            if k > gk * (E // g):
                raise ValueError(
                    f"moe.top_k={k} exceeds the experts in the chosen groups ({gk} x {E // g}): raise group_topk"
                )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"moe.capacity_factor must be > 0 (or None for dropless), got {self.capacity_factor}"
            )
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("moe.pad_to_capacity needs a capacity_factor; set one or pad_to_capacity=False")
        if self.scaling_factor is not None and self.scaling_factor <= 0:
            raise ValueError(f"moe.scaling_factor must be positive, got {self.scaling_factor}")
        if self.shared_expert_hidden_size < 0:
            raise ValueError("moe.shared_expert_hidden_size must be >= 0")
        if self.shared_expert_gate and self.shared_expert_hidden_size == 0:
            raise ValueError("moe.shared_expert_gate needs shared_expert_hidden_size > 0")
        if self.first_k_dense < 0:
            raise ValueError("moe.first_k_dense must be >= 0")
        if self.dense_layers is not None:
            layers = list(self.dense_layers)
            if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers):
                raise ValueError(f"moe.dense_layers must be non-negative layer indices, got {self.dense_layers}")
            if len(set(layers)) != len(layers):
                raise ValueError(f"moe.dense_layers has repeated layer indices: {self.dense_layers}")


@dataclass
class ModelConfig:
    """Decoder-only language model. ``moe.num_experts == 0`` gives a dense model."""

    vocab_size: int = 260
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # None = hidden_size // num_heads
    dense_hidden_size: int = 256
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: Optional[YaRNScaling] = None
    qk_norm: Literal["none", "head", "full"] = "none"
    attention: str = "gqa"  # a registered attention: "gqa" or "mla" built in
    mlp: str = "swiglu"  # a registered dense MLP
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # packed batches (position_ids restarting per document): the document-masked attention kernel, see
    # lightning_moe.models.document_mask ("auto": varlen / flex on CUDA, sdpa elsewhere); unpacked batches use SDPA
    attn_impl: str = "auto"
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        # YAML and checkpoints give nested configs as dicts.
        if isinstance(self.moe, dict):
            self.moe = _build(MoEConfig, self.moe, "moe")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = _build(YaRNScaling, self.rope_scaling, "rope_scaling")
        if self.head_dim is None and self.num_heads > 0:
            self.head_dim = self.hidden_size // self.num_heads
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be 'none', 'head' or 'full', got {self.qk_norm!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        if self.attn_impl == "varlen" and not self.same_head_dims:
            raise ValueError(f"attn_impl='varlen' needs one head dim for q, k and v, but MLA's are "
                             f"{self.qk_nope_head_dim + self.qk_rope_head_dim} and {self.v_head_dim}: use 'flex'")
        if self.attention != "mla":
            if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads != 0:
                raise ValueError(
                    f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
                )
            assert self.head_dim is not None
            if self.head_dim <= 0 or self.head_dim % 2:
                raise ValueError(f"head_dim must be a positive even number (RoPE), got {self.head_dim}")
        else:
            if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim <= 0:
                raise ValueError(f"qk_rope_head_dim must be positive and even, got {self.qk_rope_head_dim}")
            if self.kv_lora_rank <= 0 or self.v_head_dim <= 0 or self.qk_nope_head_dim < 0:
                raise ValueError("MLA needs kv_lora_rank > 0, v_head_dim > 0 and qk_nope_head_dim >= 0")
            if self.q_lora_rank is not None and self.q_lora_rank <= 0:
                raise ValueError("q_lora_rank must be positive or None (no query compression)")
            if self.qk_norm != "none":
                raise ValueError("qk_norm is for GQA attention; MLA normalises its latents itself: set qk_norm='none'")
        if self.moe.first_k_dense > self.num_layers:
            raise ValueError(
                f"moe.first_k_dense={self.moe.first_k_dense} exceeds num_layers={self.num_layers}"
            )
        if self.moe.dense_layers and max(self.moe.dense_layers) >= self.num_layers:
            raise ValueError(
                f"moe.dense_layers={self.moe.dense_layers} names layers past num_layers={self.num_layers} "
                f"(indices are 0-based)"
            )
        needs_dense = self.moe.num_experts == 0 or self.moe.first_k_dense > 0 or bool(self.moe.dense_layers)
        if needs_dense and self.dense_hidden_size <= 0:
            raise ValueError("dense_hidden_size must be positive when some layers are dense")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def same_head_dims(self) -> bool:
        """q, k and v share one head dim (GQA always; MLA when qk_nope + qk_rope == v_head_dim)."""
        return self.attention != "mla" or self.qk_nope_head_dim + self.qk_rope_head_dim == self.v_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.moe.num_experts == 0 or layer_idx < self.moe.first_k_dense:
            return False
        return not self.moe.dense_layers or layer_idx not in self.moe.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    # ---- presets and serialisation ---------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named preset; keyword overrides replace fields. ``moe`` / ``rope_scaling`` may be dicts of overrides
        (merged into the preset's nested config) or whole ``MoEConfig`` / ``YaRNScaling`` objects."""
        return resolve_model_config({"preset": name, **overrides})

    def to_dict(self) -> dict[str, Any]:
        """Plain, nested dict (safe for ``torch.load(weights_only=True)`` checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of :meth:`to_dict`. Fields absent from ``d`` take the dataclass defaults, or the values of the
        preset named by an optional ``"preset"`` key. Unknown keys (at any nesting) are a ValueError."""
        return resolve_model_config(dict(d))

    # ---- parameter accounting ---------------------------------------------------------------------
    def param_breakdown(self) -> dict[str, dict[str, int]]:
        """Parameter counts per component: {name: {"total": n, "active": n}} summed over layers."""
        D, V = self.hidden_size, self.vocab_size
        m = self.moe
        out: dict[str, dict[str, int]] = {}

        def add(name: str, total: int, active: Optional[int] = None) -> None:
            e = out.setdefault(name, {"total": 0, "active": 0})
            e["total"] += total
            e["active"] += total if active is None else active

        add("embedding", V * D)
        if not self.tie_embeddings:
            add("lm_head", V * D)
        add("final_norm", D)
        attn = self.attention_params()
        for i in range(self.num_layers):
            add("norms", 2 * D)
            add("attention", attn)
            if self.is_moe_layer(i):
                E, k, F = m.num_experts, m.top_k, m.expert_hidden_size
                add("router", E * D + (E if m.expert_bias else 0))
                add("routed_experts", E * 3 * D * F, k * 3 * D * F)
                if m.shared_expert_hidden_size:
                    add("shared_experts", 3 * D * m.shared_expert_hidden_size + (D if m.shared_expert_gate else 0))
            else:
                add("dense_mlp", 3 * D * self.dense_hidden_size)
        return out

    def attention_params(self) -> int:
        D, H = self.hidden_size, self.num_heads
        if self.attention != "mla":
            hd = self.head_dim
            assert hd is not None
            n = D * H * hd + 2 * D * self.num_kv_heads * hd + H * hd * D
            if self.qk_norm == "head":
                n += 2 * hd
            elif self.qk_norm == "full":
                n += H * hd + self.num_kv_heads * hd
            return n
        qk_hd = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            n = D * H * qk_hd
        else:
            n = D * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * qk_hd
        n += D * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        n += self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
        n += H * self.v_head_dim * D
        return n

    def count_params(self) -> dict[str, int]:
        """{"total", "active"}: active = every parameter one token uses (top_k routed experts)."""
        b = self.param_breakdown()
        return {"total": sum(v["total"] for v in b.values()), "active": sum(v["active"] for v in b.values())}


# ---- presets --------------------------------------------------------------------------------------
# Published shapes (Hugging Face config.json of each model). Byte vocabulary (260) for tiny.


def _tiny() -> ModelConfig:
    # Qwen3-MoE's architecture exactly (qk-norm per head, softmax top-k renormalised, a dense first layer, no shared
    # expert), so the main job's model exports to Hugging Face; 2 x 192 routed hidden units per token
    return ModelConfig(
        vocab_size=260, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        dense_hidden_size=256, max_seq_len=256, rope_theta=10000.0, qk_norm="head",
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden_size=192, score_func="softmax",
                      aux_loss_type="aux", aux_loss_coeff=1e-2, z_loss_coeff=1e-3, first_k_dense=1),
    )


def _qwen3_moe_30b_a3b() -> ModelConfig:
    return ModelConfig(
        vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        dense_hidden_size=6144, max_seq_len=40960, rope_theta=1e6, qk_norm="head",
        moe=MoEConfig(num_experts=128, top_k=8, expert_hidden_size=768, score_func="softmax",
                      pre_softmax=True, norm_topk_prob=True, aux_loss_type="global", aux_loss_coeff=1e-3),
    )


def _qwen3_moe_235b_a22b() -> ModelConfig:
    return ModelConfig(
        vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
        dense_hidden_size=12288, max_seq_len=40960, rope_theta=1e6, qk_norm="head",
        moe=MoEConfig(num_experts=128, top_k=8, expert_hidden_size=1536, score_func="softmax",
                      pre_softmax=True, norm_topk_prob=True, aux_loss_type="global", aux_loss_coeff=1e-3),
    )


def _deepseek_v3() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
        dense_hidden_size=18432, max_seq_len=163840, rope_theta=10000.0,
        rope_scaling=YaRNScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128,
        moe=MoEConfig(num_experts=256, top_k=8, expert_hidden_size=2048, score_func="sigmoid",
                      norm_topk_prob=True, scaling_factor=2.5, num_groups=8, group_topk=4, expert_bias=True,
                      bias_update_rate=1e-3, aux_loss_type="seq", aux_loss_coeff=1e-4,
                      shared_expert_hidden_size=2048, first_k_dense=3),
    )


def _deepseek_v2_lite() -> ModelConfig:
    return ModelConfig(
        vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16, num_kv_heads=16,
        dense_hidden_size=10944, max_seq_len=163840, rope_theta=10000.0,
        rope_scaling=YaRNScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
        attention="mla", q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128,
        moe=MoEConfig(num_experts=64, top_k=6, expert_hidden_size=1408, score_func="softmax",
                      pre_softmax=True, norm_topk_prob=False, aux_loss_type="seq", aux_loss_coeff=1e-3,
                      shared_expert_hidden_size=2 * 1408, first_k_dense=1),
    )


def _mixtral_8x7b() -> ModelConfig:
    return ModelConfig(
        vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        dense_hidden_size=14336, max_seq_len=32768, rope_theta=1e6,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden_size=14336, score_func="softmax",
                      pre_softmax=False, norm_topk_prob=True, aux_loss_type="aux", aux_loss_coeff=1e-2),
    )


def _olmoe_1b_7b() -> ModelConfig:
    return ModelConfig(
        vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16, head_dim=128,
        dense_hidden_size=1024, max_seq_len=4096, rope_theta=10000.0, qk_norm="full",
        moe=MoEConfig(num_experts=64, top_k=8, expert_hidden_size=1024, score_func="softmax",
                      pre_softmax=True, norm_topk_prob=False, aux_loss_type="aux", aux_loss_coeff=1e-2,
                      z_loss_coeff=1e-3),
    )


PRESETS = {
    "tiny": _tiny,
    "qwen3_moe_30b_a3b": _qwen3_moe_30b_a3b,
    "qwen3_moe_235b_a22b": _qwen3_moe_235b_a22b,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2_lite": _deepseek_v2_lite,
    "mixtral_8x7b": _mixtral_8x7b,
    "olmoe_1b_7b": _olmoe_1b_7b,
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


# ---- resolving specs: preset names, dicts of fields with an optional "preset" key -----------------------------------

_NESTED = {"moe": MoEConfig, "rope_scaling": YaRNScaling}


def _close(word: Any, choices: Any) -> str:
    """' (did you mean X?)' for the closest of ``choices`` (difflib, else the one ``word`` begins), or ''."""
    choices = [str(c) for c in choices]
    match = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    if not match and str(word):
        match = [c for c in choices if c.startswith(str(word))][:1]
    return f" (did you mean {match[0]!r}?)" if match else ""


def _unknown_preset(name: Any, where: str) -> ValueError:
    return ValueError(
        f"{where}: unknown preset {name!r}{_close(name, PRESETS)}; known presets: {', '.join(preset_names())}"
    )


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    if origin is list:
        item = (typing.get_args(tp) or (Any,))[0]
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(item, str(item))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _check_value(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against the field type ``tp`` (ints are accepted for floats); raises ValueError naming the
    key and what is allowed. Ours, not jsonargparse's: ``from_preset`` / ``from_dict`` overrides and the mapping
    under ``model.config`` (typed as a preset name or a dict there) reach the dataclasses without it."""
    origin = typing.get_origin(tp)
    ok = False
    if origin is Union:
        for arg in typing.get_args(tp):
            try:
                return _check_value(value, arg, key)
            except ValueError:
                continue
    elif origin is Literal:
        ok = value in typing.get_args(tp)
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(tp) or (Any,)
            return [v if item is Any else _check_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    elif tp is type(None):
        ok = value is None
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        ok = isinstance(value, str)
    elif dataclasses.is_dataclass(tp):
        ok = isinstance(value, (dict, tp))
    else:  # pragma: no cover - every field type is listed above
        ok = True
    if not ok:
        raise ValueError(f"{key} must be {_type_name(tp)}, got {value!r}")
    return value


def _merge(cls: type, base: dict[str, Any], overrides: dict[str, Any], where: str) -> dict[str, Any]:
    """``base`` (a complete ``asdict`` of ``cls``) updated by ``overrides``; nested dataclass fields merge key by
    key. Unknown keys and values of the wrong type are a ValueError naming the key."""
    types = _field_types(cls)
    out = dict(base)
    for key, value in overrides.items():
        path = f"{where}.{key}"
        if key not in types:
            raise ValueError(
                f"unknown key {path!r}{_close(key, types)}; {cls.__name__} keys: {', '.join(types)}"
            )
        nested = _NESTED.get(key) if cls is ModelConfig else None
        if nested is not None and value is not None:
            if isinstance(value, nested):
                value = dataclasses.asdict(value)
            if not isinstance(value, dict):
                raise ValueError(f"{path} must be a mapping of {nested.__name__} fields or null, got {value!r}")
            start = out.get(key)
            if start is None:
                start = dataclasses.asdict(nested())
            out[key] = _merge(nested, start, value, path)
        else:
            out[key] = _check_value(value, types[key], path)
    return out


def _build(cls: type, d: dict[str, Any], where: str) -> Any:
    """``cls(**d)`` for MoEConfig / YaRNScaling, unknown keys and wrong types reported as ValueError (missing keys
    take the defaults)."""
    return cls(**_merge(cls, dataclasses.asdict(cls()), d, where))


def resolve_model_config(spec: Union["ModelConfig", str, dict[str, Any]], where: str = "config") -> "ModelConfig":
    """A ModelConfig from any of the accepted forms:

    - a ``ModelConfig`` (returned as is);
    - a preset name, e.g. ``"qwen3_moe_30b_a3b"``;
    - a dict of fields, with an optional ``"preset"`` key: the preset's fields (or the dataclass defaults without
      one) updated by the others. Nested ``moe`` / ``rope_scaling`` dicts update the preset's nested config key by
      key: ``{"preset": "qwen3_moe_30b_a3b", "num_layers": 2, "moe": {"top_k": 4}}``.

    Unknown preset names, unknown keys at any nesting and values of the wrong type raise a ValueError that names the
    key (prefixed by ``where``), what is allowed and a close match; invalid combinations raise the dataclasses'
    own ValueErrors.
    """
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise _unknown_preset(spec, where)
        return PRESETS[spec]()
    if not isinstance(spec, dict):
        raise ValueError(
            f"{where} must be a preset name ({', '.join(preset_names())}), a ModelConfig or a mapping of its fields "
            f"(optionally with a 'preset' key), got {type(spec).__name__}: {spec!r}"
        )
    overrides = dict(spec)
    preset = overrides.pop("preset", None)
    if preset is None:
        base_dict = ModelConfig().to_dict()  # the dataclass defaults
        base_dict["head_dim"] = None  # derived from hidden_size / num_heads unless given
    else:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise _unknown_preset(preset, f"{where}.preset")
        base_dict = PRESETS[preset]().to_dict()
    return ModelConfig(**_merge(ModelConfig, base_dict, overrides, where))
