"""Decoder-only MoE language model: RMSNorm, RoPE (+YaRN), GQA (+qk-norm) or MLA attention, dense SwiGLU MLPs for
the first-k-dense layers and MoE layers elsewhere.

Model code is single-device and mesh-agnostic (DESIGN invariant 1): parallelism is attached from outside.
Construction works on the meta device; ``init_weights()`` (or ``reset_parameters()`` on every submodule after
``to_empty``) gives the explicit initialisation.

Incremental decoding: ``forward(..., cache=KVCache(...))`` runs only the new tokens and attends to the cached
ones (see :class:`KVCache`); without a cache every path is the training forward, unchanged.

Legend: B batch, S sequence, D hidden, H heads, G kv heads, K head dim, V vocabulary, F MLP hidden,
L cached slots, R MLA kv latent rank, P MLA rope head dim.

One piece (over 500 lines): the blocks of one decoder (norms, rope, attention, MLPs, the KV cache) and the
model that composes them; each is small, and they change together.
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe.activation_plan import ActivationPlan
from lightning_moe.config import ModelConfig, YaRNScaling
from lightning_moe.models import registry
from lightning_moe.models.document_mask import DocumentMask, DocumentSegments, document_ids
from lightning_moe.models.heads import expand_kv
from lightning_moe.models.lm_loss import IGNORE_INDEX, LMLoss
from lightning_moe.models.outputs import LMStepOutput
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.record import MoERecorder


class RMSNorm(nn.Module):
    activation_seams: ClassVar[tuple[str, ...]] = ("forward",)  # recompute "norm"
    activation_plan: ActivationPlan = ActivationPlan()

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.activation_plan.forward(self._forward, x)

    def _forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 for stability, return the input dtype. With input and weight in one dtype, rms_norm
        # does exactly that itself (its reduced-precision kernels compute in fp32) and keeps the bf16 input for the
        # backward instead of an fp32 copy (half the saved bytes, one fewer pass).
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def _yarn_inv_freq(dim: int, theta: float, s: YaRNScaling) -> Tensor:
    """YaRN-interpolated inverse frequencies (DeepSeek-V2/V3 definition)."""
    pos = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    extra = 1.0 / (theta**pos)
    inter = 1.0 / (s.factor * theta**pos)

    def corr_dim(n_rot: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (n_rot * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(s.beta_fast)), 0)
    high = min(math.ceil(corr_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = 1.0 - ramp  # 1 = keep the original (extrapolated) frequency
    return (inter * (1 - mask) + extra * mask).float()


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 or mscale == 0 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_seq_len); a non-persistent buffer rebuilt by reset_parameters."""

    def __init__(self, dim: int, max_seq_len: int, theta: float, scaling: Optional[YaRNScaling] = None) -> None:
        super().__init__()
        self.dim, self.max_seq_len, self.theta, self.scaling = dim, max_seq_len, theta, scaling
        self.register_buffer("cos_sin", torch.empty(max_seq_len, dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.cos_sin.is_meta:
            return
        if self.scaling is not None:
            inv_freq = _yarn_inv_freq(self.dim, self.theta, self.scaling)
            # YaRN's attention temperature is folded into cos/sin (as in DeepSeek's reference code)
            m = yarn_mscale(self.scaling.factor, self.scaling.mscale) / yarn_mscale(
                self.scaling.factor, self.scaling.mscale_all_dim
            )
        else:
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)).float()
            m = 1.0
        t = torch.arange(self.max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(torch.float32))
        table = torch.cat([freqs.cos() * m, freqs.sin() * m], dim=-1)
        with torch.no_grad():
            self.cos_sin.copy_(table.to(self.cos_sin.device, self.cos_sin.dtype))

    def forward(self, positions_S: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [S, K/2] for positions [S] shared by the batch, or [B, S, K/2] for per-sequence positions
        [B, S] (decoding a left-padded batch with a KV cache)."""
        cs = self.cos_sin.index_select(0, positions_S.reshape(-1)).float().view(*positions_S.shape, self.dim)
        return cs[..., : self.dim // 2], cs[..., self.dim // 2 :]


def apply_rope(x_BSHK: Tensor, cos_SK2: Tensor, sin_SK2: Tensor) -> Tensor:
    """Rotate-half RoPE (Hugging Face / Llama layout: the two halves of the head dim pair up). cos/sin are
    [S, K/2] (one set of positions for the batch) or [B, S, K/2] (per sequence)."""
    half = x_BSHK.shape[-1] // 2
    x1, x2 = x_BSHK[..., :half].float(), x_BSHK[..., half:].float()
    if cos_SK2.dim() == 2:
        cos, sin = cos_SK2[None, :, None, :], sin_SK2[None, :, None, :]
    else:
        cos, sin = cos_SK2[:, :, None, :], sin_SK2[:, :, None, :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BSHK.dtype)


def padded_causal_mask(q_pos_S: Tensor, k_pos_L: Tensor, key_valid_BL: Optional[Tensor]) -> Tensor:
    """Boolean attention mask (True = attend): each query sees the keys at positions <= its own that are real
    (``key_valid_BL`` True; None = all real) and always its own position, so the rows of padding queries stay finite.
    [S, L] without ``key_valid_BL``, else [B, 1, S, L]."""
    allowed_SL = k_pos_L[None, :] <= q_pos_S[:, None]
    if key_valid_BL is None:
        return allowed_SL
    own_SL = k_pos_L[None, :] == q_pos_S[:, None]
    return ((allowed_SL[None] & key_valid_BL[:, None, :].bool()) | own_SL[None])[:, None]


class CoreAttention:
    """Causal scaled-dot-product attention over local heads: the seam context parallelism replaces (an object,
    not a submodule, so it adds no state-dict keys).

    ``__call__(q_BHSK, k_BGSK, v_BGSV, key_valid_BS, scale, positions_S, k_shared_B1SP=None)``: k/v may hold fewer
    heads than q (GQA) and ``k_shared_B1SP`` a key part shared by all heads (MLA's RoPE key): :func:`expand_kv`
    runs here, after the seam, so a context-parallel gather moves the compact tensors. ``key_valid_BS``: bool
    [B, S], True = real token (None = no padding); padding keys are masked out; or, for packed sequences, a
    :class:`~lightning_moe.models.document_mask.DocumentMask` (block-causal per document, padding included).
    ``positions_S`` are the global positions of the local queries and keys; a single process ignores them (causal
    by index). Its call is the seam ``activation_checkpointing=[attn_core]`` recomputes."""

    activation_seams: ClassVar[tuple[str, ...]] = ("forward",)
    activation_plan: ActivationPlan = ActivationPlan()

    def __call__(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, key_valid_BS: Optional[Tensor],
                 scale: Optional[float], positions_S: Tensor, k_shared_B1SP: Optional[Tensor] = None) -> Tensor:
        return self.activation_plan.forward(self._attend, q_BHSK, k_BGSK, v_BGSV, key_valid_BS, scale, positions_S,
                                            k_shared_B1SP)

    def _attend(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, key_valid_BS: Optional[Tensor],
                scale: Optional[float], positions_S: Tensor, k_shared_B1SP: Optional[Tensor] = None) -> Tensor:
        if isinstance(key_valid_BS, DocumentMask):
            return key_valid_BS.attend(q_BHSK, k_BGSK, v_BGSV, scale, k_shared_B1SP)
        k_BHSK, v_BHSV = expand_kv(q_BHSK.shape[1], k_BGSK, v_BGSV, k_shared_B1SP)
        if key_valid_BS is None:
            return F.scaled_dot_product_attention(q_BHSK, k_BHSK, v_BHSV, is_causal=True, scale=scale)
        idx_S = torch.arange(q_BHSK.shape[2], device=q_BHSK.device)
        mask = padded_causal_mask(idx_S, idx_S, key_valid_BS)
        return F.scaled_dot_product_attention(q_BHSK, k_BHSK, v_BHSV, attn_mask=mask, scale=scale)


class KVCache:
    """Keys and values of earlier tokens for incremental decoding of a batch of B sequences in ``max_len`` slots.

    Slot t of every sequence holds the t-th token fed to the model (prompt, then generated tokens). A prompt batch
    may be left-padded: ``attention_mask`` [B, S] given to the forward that fills the slots marks padding (0),
    which no later query attends to and which does not count as a position. Each sequence's RoPE positions count
    its own real tokens (position = number of earlier real tokens), so a left-padded prompt decodes exactly as it
    would alone. ``max_len`` must not exceed the model's ``max_seq_len``.

    What a layer stores (``LayerKVCache.update``): GQA layers the keys after qk-norm and RoPE and the values,
    [B, L, G, K] each (kv heads, before the GQA repeat). MLA layers the normalised kv latent [B, L, R] and the
    shared roped key [B, L, P]: R + P numbers per token instead of H * (2 K) (what MLA is designed for); their
    cached attention runs in the latent space with ``wkv_b`` absorbed into the query and the output (DeepSeek's
    inference form, equal to the training forward up to rounding).

    The model calls :meth:`begin` before and :meth:`end` after the layers of a forward; layers only see a
    :class:`LayerKVCache` view. Storage is allocated on each layer's first update (its dtype and device).
    """

    def __init__(self, batch_size: int, max_len: int, device: Optional[torch.device | str] = None) -> None:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs batch_size > 0 and max_len > 0, got {batch_size} and {max_len}")
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0  # slots filled by completed forwards
        self.valid_BL = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_pos_B = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._store: dict[int, list[Tensor]] = {}
        self._new = 0  # tokens of the forward in progress

    def begin(self, input_ids_BS: Tensor, attention_mask_BS: Optional[Tensor]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """Reserve slots for the S new tokens; return their positions [B, S], the attention mask [B, 1, S, L]
        (True = attend: causal over slots, real keys only, and every query to its own slot so padding rows stay
        finite) and the MoE padding mask [B, S] (None when every new token is real)."""
        B, S = input_ids_BS.shape
        if B != self.batch_size:
            raise ValueError(f"KVCache was made for batch size {self.batch_size}, got input of batch size {B}")
        start, end = self.length, self.length + S
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} slots: cannot add {S} tokens to {start} cached ones")
        device = self.valid_BL.device
        if attention_mask_BS is None:
            real_BS = torch.ones(B, S, dtype=torch.bool, device=device)
        else:
            if tuple(attention_mask_BS.shape) != (B, S):
                raise ValueError(f"attention_mask must have shape {(B, S)}, got {tuple(attention_mask_BS.shape)}")
            real_BS = attention_mask_BS.to(device=device, dtype=torch.bool)
        self.valid_BL[:, start:end] = real_BS
        positions_BS = (self.next_pos_B[:, None] + real_BS.long().cumsum(1) - 1).clamp(min=0)
        self.next_pos_B += real_BS.sum(1)
        q_slot = torch.arange(start, end, device=device)[:, None]
        k_slot = torch.arange(end, device=device)[None, :]
        allowed_BSL = ((k_slot <= q_slot)[None] & self.valid_BL[:, None, :end]) | (k_slot == q_slot)[None]
        self._new = S
        padding_mask = None if attention_mask_BS is None or bool(real_BS.all()) else real_BS
        return positions_BS, allowed_BSL[:, None], padding_mask

    def update(self, layer_idx: int, *new_BS: Tensor) -> tuple[Tensor, ...]:
        """Write this forward's tensors [B, S, ...] of one layer into their slots; return every filled slot of
        each, [B, L, ...] (L = cached + new)."""
        start, end = self.length, self.length + self._new
        store = self._store.get(layer_idx)
        if store is None:
            store = [t.new_zeros(self.batch_size, self.max_len, *t.shape[2:]) for t in new_BS]
            self._store[layer_idx] = store
        out = []
        for buf, t in zip(store, new_BS):
            buf[:, start:end] = t
            out.append(buf[:, :end])
        return tuple(out)

    def end(self) -> None:
        self.length += self._new
        self._new = 0

    def layer(self, layer_idx: int) -> "LayerKVCache":
        return LayerKVCache(self, layer_idx)


class LayerKVCache:
    """One layer's view of a :class:`KVCache` (what the attention modules receive)."""

    def __init__(self, cache: KVCache, layer_idx: int) -> None:
        self.cache, self.layer_idx = cache, layer_idx

    def update(self, *new_BS: Tensor) -> tuple[Tensor, ...]:
        return self.cache.update(self.layer_idx, *new_BS)


def _linear(in_dim: int, out_dim: int) -> nn.Linear:
    return nn.Linear(in_dim, out_dim, bias=False)


@registry.register("attention", "gqa")
class Attention(nn.Module):
    """Grouped-query attention with optional qk-norm ("head": per-head RMSNorm as in Qwen3; "full": over all
    heads as in OLMoE)."""

    activation_seams: ClassVar[tuple[str, ...]] = ("forward",)  # offload "attention"
    activation_plan: ActivationPlan = ActivationPlan()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        D, H, G, K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, G, K
        self.wq, self.wk, self.wv = _linear(D, H * K), _linear(D, G * K), _linear(D, G * K)
        self.wo = _linear(H * K, D)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(K, cfg.norm_eps), RMSNorm(K, cfg.norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * K, cfg.norm_eps), RMSNorm(G * K, cfg.norm_eps)
        self.rope = RotaryEmbedding(K, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.core_attention = CoreAttention()

    def forward(self, x_BSD: Tensor, positions_S: Tensor, mask: Optional[Tensor],
                cache: Optional[LayerKVCache] = None) -> Tensor:
        return self.activation_plan.forward(self._forward, x_BSD, positions_S, mask, cache)

    def _forward(self, x_BSD: Tensor, positions_S: Tensor, mask: Optional[Tensor],
                 cache: Optional[LayerKVCache] = None) -> Tensor:
        """``mask``: the key padding mask [B, S] (True = real token; None = no padding), causal masking is implied;
        or a :class:`~lightning_moe.models.document_mask.DocumentMask` for packed sequences. With ``cache``:
        positions [B, S] and mask [B, 1, S, L] come from :meth:`KVCache.begin`; keys and values of earlier slots are
        read from the cache and this forward's are appended."""
        B, S, _ = x_BSD.shape
        q, k, v = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 instead of H/G: under tensor parallelism each rank holds a slice of the heads
        q_BSHK = q.view(B, S, -1, self.head_dim)
        k_BSGK = k.view(B, S, -1, self.head_dim)
        v_BSGK = v.view(B, S, -1, self.head_dim)
        if self.qk_norm == "head":
            q_BSHK, k_BSGK = self.q_norm(q_BSHK), self.k_norm(k_BSGK)
        cos, sin = self.rope(positions_S)
        q_BSHK, k_BSGK = apply_rope(q_BSHK, cos, sin), apply_rope(k_BSGK, cos, sin)
        if cache is not None:  # single-process decoding: explicit slot mask, no context-parallel seam
            k_BSGK, v_BSGK = cache.update(k_BSGK, v_BSGK)  # now every cached slot: [B, L, G, K]
            k_BHLK, v_BHLK = expand_kv(q_BSHK.shape[2], k_BSGK.transpose(1, 2), v_BSGK.transpose(1, 2))
            o_BHSK = F.scaled_dot_product_attention(q_BSHK.transpose(1, 2), k_BHLK, v_BHLK, attn_mask=mask)
        else:  # kv heads go to the seam unrepeated (expand_kv runs there)
            o_BHSK = self.core_attention(
                q_BSHK.transpose(1, 2), k_BSGK.transpose(1, 2), v_BSGK.transpose(1, 2), mask, None, positions_S
            )
        return self.wo(o_BHSK.transpose(1, 2).reshape(B, S, -1))


@registry.register("attention", "mla")
class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value compression, a decoupled
    shared RoPE key."""

    activation_seams: ClassVar[tuple[str, ...]] = ("forward", "up_proj")  # offload "attention"; recompute "mla_up_proj"
    activation_plan: ActivationPlan = ActivationPlan()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_heads
        self.num_heads = H
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope + self.rope_dim
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.wq = _linear(D, H * qk_dim)
        else:
            self.wq_a = _linear(D, cfg.q_lora_rank)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = _linear(cfg.q_lora_rank, H * qk_dim)
        self.wkv_a = _linear(D, cfg.kv_lora_rank + self.rope_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = _linear(cfg.kv_lora_rank, H * (self.nope + self.v_dim))
        self.wo = _linear(H * self.v_dim, D)
        self.rope = RotaryEmbedding(self.rope_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.core_attention = CoreAttention()
        self.scale = qk_dim**-0.5
        if cfg.rope_scaling is not None:
            self.scale *= yarn_mscale(cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim) ** 2

    def forward(self, x_BSD: Tensor, positions_S: Tensor, mask: Optional[Tensor],
                cache: Optional[LayerKVCache] = None) -> Tensor:
        return self.activation_plan.forward(self._forward, x_BSD, positions_S, mask, cache)

    def _forward(self, x_BSD: Tensor, positions_S: Tensor, mask: Optional[Tensor],
                 cache: Optional[LayerKVCache] = None) -> Tensor:
        """``mask`` as in :meth:`Attention.forward`: key padding [B, S] without a cache, [B, 1, S, L] with one."""
        if cache is not None:
            return self._forward_cached(x_BSD, positions_S, mask, cache)
        B, S, _ = x_BSD.shape
        kv = self.wkv_a(x_BSD)
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_in = x_BSD if self.q_lora_rank is None else self.wq_a(x_BSD)
        q, kv_up = self.activation_plan.recompute.run("up_proj", self.up_proj, q_in, c_kv)
        q_BSHK = q.view(B, S, -1, self.nope + self.rope_dim)
        q_nope, q_pe = q_BSHK.split([self.nope, self.rope_dim], dim=-1)
        kv_BSHK = kv_up.view(B, S, -1, self.nope + self.v_dim)
        k_nope, v = kv_BSHK.split([self.nope, self.v_dim], dim=-1)
        cos, sin = self.rope(positions_S)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe_BS1P = apply_rope(k_pe.unsqueeze(2), cos, sin)
        q_BSHK = torch.cat([q_nope, q_pe], dim=-1)
        # the shared rope key goes to the seam once, not per head (expand_kv appends it there)
        o = self.core_attention(q_BSHK.transpose(1, 2), k_nope.transpose(1, 2), v.transpose(1, 2), mask, self.scale,
                                positions_S, k_pe_BS1P.transpose(1, 2))
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))

    def up_proj(self, q_in: Tensor, c_kv: Tensor) -> tuple[Tensor, Tensor]:
        """Queries and per-head keys/values from the compressed latents (``q_in``: the q latent, or x without q
        compression): the seam ``activation_checkpointing=[mla_up_proj]`` recomputes."""
        q = self.wq(q_in) if self.q_lora_rank is None else self.wq_b(self.q_norm(q_in))
        return q, self.wkv_b(self.kv_norm(c_kv))

    def _forward_cached(self, x_BSD: Tensor, positions_BS: Tensor, mask: Tensor, cache: LayerKVCache) -> Tensor:
        """Decoding with a latent cache (normalised c_kv [B, L, R] and roped k_pe [B, L, P]). ``wkv_b`` is absorbed:
        q_nope . (W_uk c) = (W_uk^T q_nope) . c and the output W_uv (sum_l p_l c_l), so attention runs over R + P
        dimensions against the latent itself and no per-head keys or values are materialised."""
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD) if self.q_lora_rank is None else self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q_nope, q_pe = q.view(B, S, -1, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = self.rope(positions_BS)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe_BSP = apply_rope(k_pe.unsqueeze(2), cos, sin).squeeze(2)
        c_BLR, k_pe_BLP = cache.update(self.kv_norm(c_kv), k_pe_BSP)
        w_HXR = self.wkv_b.weight.view(-1, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk_HNR, w_uv_HVR = w_HXR.split([self.nope, self.v_dim], dim=1)
        q_lat_BSHR = torch.einsum("bshn,hnr->bshr", q_nope, w_uk_HNR)
        H = q_lat_BSHR.shape[2]
        q_BHSX = torch.cat([q_lat_BSHR, q_pe], dim=-1).transpose(1, 2)
        k_BHLX = torch.cat([c_BLR, k_pe_BLP], dim=-1)[:, None].expand(-1, H, -1, -1)
        v_BHLR = c_BLR[:, None].expand(-1, H, -1, -1)
        o_BHSR = F.scaled_dot_product_attention(q_BHSX, k_BHLX, v_BHLR, attn_mask=mask, scale=self.scale)
        o_BSHV = torch.einsum("bhsr,hvr->bshv", o_BHSR, w_uv_HVR)
        return self.wo(o_BSHV.reshape(B, S, -1))


@registry.register("mlp", "swiglu")
class FeedForward(nn.Module):
    """Dense SwiGLU MLP."""

    activation_seams: ClassVar[tuple[str, ...]] = ("forward",)  # offload "mlp"
    activation_plan: ActivationPlan = ActivationPlan()

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1, self.w3 = _linear(dim, hidden_dim), _linear(dim, hidden_dim)
        self.w2 = _linear(hidden_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.activation_plan.forward(self._forward, x)

    def _forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention and an MLP (dense, or MoE where ``cfg.is_moe_layer``); components are built by
    name through :mod:`lightning_moe.models.registry`. Its forward is the seam of whole-block recomputation
    (``full``) and of offload ``block``: recomputation outside the offload scope (``ActivationPlan.block``)."""

    activation_seams: ClassVar[tuple[str, ...]] = ("forward",)
    activation_plan: ActivationPlan = ActivationPlan()

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = registry.build("attention", cfg.attention, cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            self.moe = MoELayer(cfg.moe, cfg.hidden_size)
        else:
            self.feed_forward = registry.build("mlp", cfg.mlp, cfg.hidden_size, cfg.dense_hidden_size)

    def forward(self, x_BSD: Tensor, positions_S: Tensor, mask: Optional[Tensor], padding_mask_BS: Optional[Tensor],
                cache: Optional[KVCache] = None, recorder: Optional[MoERecorder] = None) -> Tensor:
        return self.activation_plan.block(self._forward, x_BSD, positions_S, mask, padding_mask_BS, cache=cache,
                                          recorder=recorder)

    def _forward(self, x_BSD: Tensor, positions_S: Tensor, mask: Optional[Tensor], padding_mask_BS: Optional[Tensor],
                 cache: Optional[KVCache] = None, recorder: Optional[MoERecorder] = None) -> Tensor:
        """``mask``: the attention's mask (see :meth:`Attention.forward`); ``padding_mask_BS``: the MoE layer's
        (True = real token); ``recorder``: receives the MoE layer's losses and routing record (see
        :class:`~lightning_moe.moe.record.MoERecorder`)."""
        if cache is None:
            h = x_BSD + self.attention(self.attention_norm(x_BSD), positions_S, mask)
        else:
            h = x_BSD + self.attention(self.attention_norm(x_BSD), positions_S, mask, cache=cache.layer(self.layer_idx))
        ffn_in = self.ffn_norm(h)
        if self.is_moe:
            out = self.moe(ffn_in, padding_mask_BS, recorder=recorder, layer_idx=self.layer_idx)
        else:
            out = self.feed_forward(ffn_in)
        return h + out


def check_components(cfg: ModelConfig) -> None:
    """ValueError naming the field and the registered choices for a component name of ``cfg`` that no module
    registered (checked here, where the components are built: the registry knows names, the config does not)."""
    moe = cfg.moe
    for kind, field, name in (("attention", "attention", cfg.attention), ("mlp", "mlp", cfg.mlp),
                              ("router", "moe.router", moe.router), ("experts", "moe.experts", moe.experts),
                              ("shared_experts", "moe.shared_experts", moe.shared_experts)):
        registry.check(kind, name, field)


class MoETransformer(nn.Module):
    """Decoder LM. ``forward(input_ids_BS, attention_mask_BS=None) -> logits_BSV`` (in the activation dtype);
    with ``labels_BS`` it returns the step's :class:`~lightning_moe.models.outputs.LMStepOutput` (token-loss sum,
    valid-token count, each MoE layer's losses and routing record). The model keeps no per-forward state."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_components(cfg)
        self.config = cfg
        # builds the packed forward's DocumentMask once for all layers; context parallelism replaces it with one
        # that gathers every rank's document ids (parallel.parallelize.apply_cp)
        self.build_document_mask = DocumentMask.build
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # a dict keyed by layer index keeps FQNs stable when parallelize wraps or removes layers
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else _linear(cfg.hidden_size, cfg.vocab_size)
        # the LM loss seam; tensor parallelism replaces it by the vocab-parallel loss (parallel.parallelize.apply_tp)
        self.lm_loss = LMLoss()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Explicit initialisation (after ``to_empty`` when built on the meta device): normal(init_std) for
        input projections and embeddings, init_std / sqrt(2 * num_layers) for projections into the residual
        stream, ones for norms; rope tables rebuilt."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.num_layers)
        residual_out = ("wo", "w2")
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                s = out_std if name.rsplit(".", 1)[-1] in residual_out else std
                nn.init.trunc_normal_(module.weight, std=s, a=-3 * s, b=3 * s)
            elif isinstance(module, nn.Embedding):
                # as Hugging Face's Qwen/DeepSeek/Mixtral: unit variance learns markedly slower under AdamW
                nn.init.normal_(module.weight, std=std)
            elif module is not self and hasattr(module, "reset_parameters"):
                # routers, grouped and shared experts draw from their own stds: give them the config's
                if hasattr(module, "init_std"):
                    module.init_std = std
                if hasattr(module, "out_init_std"):
                    module.out_init_std = out_std
                module.reset_parameters()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Rebuild the state no checkpoint carries (non-persistent buffers): the RoPE tables. After ``to_empty``
        plus loading weights from elsewhere (a checkpoint, Hugging Face, upcycling)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_parameters()

    def moe_layers(self) -> list[MoELayer]:
        return [blk.moe for blk in self.layers.values() if blk.is_moe]

    @torch.no_grad()
    def update_expert_bias(self, bias_demand: dict[int, Tensor]) -> None:
        """The step's expert-bias update: ``bias_demand`` maps an MoE layer's index to its demand [E], summed over
        the step's micro-batches and every rank routing distinct tokens (the gradient finalisation's
        ``update_expert_bias`` argument)."""
        for idx, counts_E in bias_demand.items():
            self.layers[str(idx)].moe.router.update_expert_bias(counts_E)

    def forward(self, input_ids_BS: Tensor, attention_mask_BS: Optional[Tensor] = None,
                positions_S: Optional[Tensor] = None, cache: Optional[KVCache] = None,
                labels_BS: Optional[Tensor] = None, loss_impl: str = "auto",
                position_ids_BS: Optional[Tensor] = None,
                document_segments: Optional[DocumentSegments] = None,
                recorder: Optional[MoERecorder] = None) -> Union[Tensor, LMStepOutput]:
        """``positions_S``: [S] (default arange) or, on one process, [B, S] per-sequence positions. ``cache``:
        incremental decoding (see :class:`KVCache`; positions then follow the cache and must be None).
        ``position_ids_BS``: packed documents (:mod:`lightning_moe.models.document_mask`): positions [B, S] that
        restart at 0 at each document start; they rotate q/k and make attention block-causal per document, while
        ``positions_S`` stay the tokens' global indices (context parallelism's order). ``document_segments``: the
        same documents' structure computed on the host (the collate's, see
        :func:`~lightning_moe.models.document_mask.document_segments`): the forward then needs no host sync.

        Returns logits [B, S, V] (``recorder``: receives the MoE layers' records, see
        :class:`~lightning_moe.moe.record.MoERecorder`); with ``labels_BS`` (-100 = ignored) instead an
        :class:`~lightning_moe.models.outputs.LMStepOutput`: the sum of the token cross-entropies (an fp32 scalar,
        computed without holding the [B*S, V] logits where ``loss_impl`` allows, see
        :mod:`lightning_moe.models.lm_loss`), the valid labels, and each MoE layer's losses and routing record.
        The loss is taken inside ``forward`` so that FSDP's root hooks hold the output weight gathered while it is
        used."""
        if labels_BS is not None and recorder is None:
            recorder = MoERecorder()
        h_BSD = self.hidden_states(input_ids_BS, attention_mask_BS, positions_S, cache=cache,
                                   position_ids_BS=position_ids_BS, document_segments=document_segments,
                                   recorder=recorder)
        if labels_BS is None:
            return self.logits(h_BSD)
        assert recorder is not None
        w_VD = self.tok_embeddings.weight if self.output is None else self.output.weight
        loss_sum = self.lm_loss(h_BSD, w_VD, labels_BS, loss_impl)
        return LMStepOutput(loss_sum, (labels_BS != IGNORE_INDEX).sum(), recorder.records)

    def hidden_states(self, input_ids_BS: Tensor, attention_mask_BS: Optional[Tensor] = None,
                      positions_S: Optional[Tensor] = None, cache: Optional[KVCache] = None,
                      position_ids_BS: Optional[Tensor] = None,
                      document_segments: Optional[DocumentSegments] = None,
                      recorder: Optional[MoERecorder] = None) -> Tensor:
        if cache is not None:
            if position_ids_BS is not None:
                raise ValueError("with a KV cache the positions follow the cache: pass position_ids_BS=None")
            return self._hidden_states_cached(input_ids_BS, attention_mask_BS, positions_S, cache)
        S = input_ids_BS.shape[1]
        if positions_S is None:
            positions_S = torch.arange(S, device=input_ids_BS.device)
        padding_mask = None
        if attention_mask_BS is not None:
            padding_mask = attention_mask_BS.bool()
            if bool(padding_mask.all()):
                padding_mask = None
        attn_mask: Optional[Tensor | DocumentMask] = padding_mask
        rope_positions = positions_S
        if position_ids_BS is not None:
            if tuple(position_ids_BS.shape) != tuple(input_ids_BS.shape) or positions_S.dim() != 1:
                raise ValueError(f"position_ids must have the shape of input_ids {tuple(input_ids_BS.shape)} (and "
                                 f"positions_S be [S]), got {tuple(position_ids_BS.shape)}")
            doc_BS = document_ids(positions_S, position_ids_BS, padding_mask)
            attn_mask = self.build_document_mask(doc_BS, positions_S, self.config.attn_impl, self.config.same_head_dims,
                                                 document_segments, windows=not self._plans_activations())
            rope_positions = position_ids_BS
        h = self.tok_embeddings(input_ids_BS)
        for block in self.layers.values():
            # the attention masks padding keys (core attention builds the causal mask), the MoE routes no padding
            h = block(h, rope_positions, attn_mask, padding_mask, recorder=recorder)
        return self.norm(h)

    def _plans_activations(self) -> bool:
        """Whether any module recomputes or offloads what its forward saves (an activation plan other than the
        default): the "split" attention kernel would bypass it (models/document_windows.py)."""
        for m in self.modules():
            for owner in (m, getattr(m, "core_attention", None)):
                plan = getattr(owner, "activation_plan", None)
                if plan is not None and (plan.recompute.seams or plan.offload.scope is not None):
                    return True
        return False

    def _hidden_states_cached(self, input_ids_BS: Tensor, attention_mask_BS: Optional[Tensor],
                              positions_S: Optional[Tensor], cache: KVCache) -> Tensor:
        if positions_S is not None:
            raise ValueError("with a KV cache the positions follow the cache: pass positions_S=None")
        if cache.max_len > self.config.max_seq_len:
            raise ValueError(f"KVCache max_len={cache.max_len} exceeds the model's max_seq_len={self.config.max_seq_len}")
        positions_BS, mask, padding_mask = cache.begin(input_ids_BS, attention_mask_BS)
        h = self.tok_embeddings(input_ids_BS)
        for block in self.layers.values():
            h = block(h, positions_BS, mask, padding_mask, cache=cache)
        cache.end()
        return self.norm(h)

    def logits(self, h_BSD: Tensor) -> Tensor:
        """The full logits [..., V] as a plain tensor: a vocab-sharded LM head (tensor parallel) is gathered here,
        only when logits are asked for."""
        if self.output is None:
            logits = F.linear(h_BSD, self.tok_embeddings.weight)
        else:
            logits = self.output(h_BSD)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits
