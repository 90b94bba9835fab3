"""Packed sequences: attention that is causal within each document and never crosses one.

The batch contract is Hugging Face's packed convention: ``position_ids`` [B, S] that restart at 0 at every document
start and count up by one inside a document (what ``transformers.DataCollatorWithFlattening`` emits, and what
``TextDataModule(document_mask=True)`` and chat data write). With them the model

* rotates queries and keys by those positions (every document starts at RoPE position 0),
* lets a token attend only to earlier tokens of its own document (block-causal),
* and the LightningModule drops every label that would predict across a boundary (the last token of a document).

Document ids need no scan over the sequence: a token at global index ``g`` with position ``p`` belongs to the document
that starts at ``g - p``, so any subset of the tokens (context parallelism's load-balanced chunks) computes the ids
of its own tokens. Padding tokens (``attention_mask`` 0) get a unique negative id: no other token attends to them
and each attends only to itself, so its row stays finite.

Kernels (``ModelConfig.attn_impl``), decided once per forward from the config and the device; all compute the same
attention:

* ``"sdpa"``: ``scaled_dot_product_attention`` with an explicit boolean [B, 1, S, S] mask. The reference; any
  device.
* ``"flex"``: ``flex_attention`` with a document block mask (``create_block_mask``), compiled on CUDA: blocks
  outside every document are skipped. q/k and v head dims may differ (MLA's 192 / 128). On CPU it runs eagerly,
  forward only (torch has no CPU backward for it).
* ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (flash attention over ``cu_seqlens``), CUDA only; one
  head dim for q, k and v.
* ``"auto"``: on CUDA ``"varlen"`` when q, k and v share one head dim, else ``"flex"``; ``"sdpa"`` elsewhere.

The kernel's inputs (the dense mask, the block mask, or ``cu_seqlens``) are built once per forward in
:class:`DocumentMask` and shared by every layer.

Legend: B batch, S (local) sequence, L keys (the gathered sequence under context parallelism), H heads, K head dim
of q/k, V head dim of v, T = B * S flattened tokens, N segments.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.config import ATTN_IMPLS  # the names live with the config, which imports no model code
from lightning_moe.models.heads import expand_kv

__all__ = ["ATTN_IMPLS", "DocumentMask", "document_ids", "resolve_attn_impl"]


def resolve_attn_impl(impl: str, device: torch.device, same_head_dims: bool) -> str:
    """The kernel ``impl`` means on ``device`` (a ValueError for one that cannot run there)."""
    if impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {impl!r}")
    if impl == "auto":
        if device.type != "cuda":
            return "sdpa"
        return "varlen" if same_head_dims else "flex"
    if impl == "varlen":
        if device.type != "cuda":
            raise ValueError("attn_impl='varlen' runs on CUDA only (flash attention); use 'sdpa' (or 'flex') here")
        if not same_head_dims:
            raise ValueError("attn_impl='varlen' needs one head dim for q, k and v (MLA's differ): use 'flex'")
    return impl


def document_ids(positions_S: Tensor, position_ids_BS: Tensor, key_valid_BS: Optional[Tensor] = None) -> Tensor:
    """int64 [B, S]: the global index at which each token's document starts (``positions_S - position_ids_BS``);
    padding (``key_valid_BS`` False) gets ``-1 - index``, an id no other token has."""
    doc_BS = positions_S.to(torch.long).reshape(1, -1) - position_ids_BS.to(torch.long)
    if key_valid_BS is not None:
        doc_BS = torch.where(key_valid_BS.bool(), doc_BS, -1 - positions_S.to(torch.long).reshape(1, -1))
    return doc_BS


def dense_document_mask(q_doc_BS: Tensor, q_pos_S: Tensor, k_doc_BL: Tensor, k_pos_L: Tensor) -> Tensor:
    """Boolean [B, 1, S, L] (True = attend): same document and key position <= query position."""
    same_BSL = q_doc_BS[:, :, None] == k_doc_BL[:, None, :]
    return (same_BSL & (k_pos_L[None, None, :] <= q_pos_S[None, :, None]))[:, None]


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention), torch.compile(create_block_mask)


def _flex_functions(device: torch.device):
    if device.type == "cuda":  # flex attention is only fast compiled; the block mask is built without an S x S mask
        return _compiled_flex()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return flex_attention, create_block_mask


@functools.cache
def _varlen_params() -> tuple[str, ...]:
    """The parameters of this torch's ``varlen_attn``: causal is ``window_size=(-1, 0)`` (torch >= 2.10) or
    ``is_causal=True`` (2.9, which has no ``scale`` either)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return tuple(inspect.signature(varlen_attn).parameters)


def varlen_segments(doc_BS: Tensor) -> tuple[Tensor, int]:
    """``cu_seqlens`` (int32 [N + 1]) and the longest segment of the flattened [B * S] tokens: a segment is a run of
    one document id inside a row. Two host syncs (the segment count and the longest), once per forward."""
    B, S = doc_BS.shape
    flat_T = doc_BS.reshape(-1)
    start_T = torch.ones_like(flat_T, dtype=torch.bool)
    start_T[1:] = flat_T[1:] != flat_T[:-1]
    start_T[::S] = True  # a row never continues the previous one
    starts_N = start_T.nonzero().squeeze(1)
    cu_N1 = torch.cat([starts_N, starts_N.new_tensor([B * S])]).to(torch.int32)
    return cu_N1, int((cu_N1[1:] - cu_N1[:-1]).max())


class DocumentMask:
    """What the attention seam receives for packed sequences (in place of a key padding mask): the document id and
    global position of every local token, and the chosen kernel's inputs, built once for all layers.

    ``DocumentMask(doc_BS, positions_S, impl)`` builds the single-process inputs of a resolved kernel (:meth:`build`
    resolves ``attn_impl`` first); context parallelism builds its own (:meth:`gathered`): the dense mask of the local
    queries against the gathered keys."""

    def __init__(self, doc_BS: Tensor, positions_S: Tensor, impl: str) -> None:
        self.doc_BS, self.positions_S, self.impl = doc_BS, positions_S, impl
        self.dense_B1SL: Optional[Tensor] = None
        self.block_mask = None
        self.cu_seqlens: Optional[Tensor] = None
        self.max_len = 0
        if impl == "sdpa":
            self.dense_B1SL = dense_document_mask(doc_BS, positions_S, doc_BS, positions_S)
        elif impl == "flex":
            _, create_block_mask = _flex_functions(doc_BS.device)
            B, S = doc_BS.shape

            def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                return (doc_BS[b, q] == doc_BS[b, kv]) & (kv <= q)

            self.block_mask = create_block_mask(same_document_causal, B, None, S, S, device=doc_BS.device)
        elif impl == "varlen":
            self.cu_seqlens, self.max_len = varlen_segments(doc_BS)
        else:
            raise ValueError(f"DocumentMask needs a resolved attn_impl ('sdpa', 'flex' or 'varlen'), got {impl!r}")

    @classmethod
    def build(cls, doc_BS: Tensor, positions_S: Tensor, attn_impl: str, same_head_dims: bool) -> "DocumentMask":
        """The model's per-forward builder on one process: ``attn_impl`` resolved for the device, then built."""
        return cls(doc_BS, positions_S, resolve_attn_impl(attn_impl, doc_BS.device, same_head_dims))

    @classmethod
    def gathered(cls, doc_BS: Tensor, positions_S: Tensor, k_doc_BL: Tensor, k_pos_L: Tensor) -> "DocumentMask":
        """The SDPA mask of local queries against keys gathered from elsewhere (context parallelism)."""
        self = cls.__new__(cls)
        self.doc_BS, self.positions_S, self.impl = doc_BS, positions_S, "sdpa"
        self.block_mask, self.cu_seqlens, self.max_len = None, None, 0
        self.dense_B1SL = dense_document_mask(doc_BS, positions_S, k_doc_BL, k_pos_L)
        return self

    def __repr__(self) -> str:
        return f"DocumentMask(impl={self.impl!r}, shape={tuple(self.doc_BS.shape)})"

    def attend(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, scale: Optional[float],
               k_shared_B1SP: Optional[Tensor] = None) -> Tensor:
        """o [B, H, S, V] on one process: k/v may hold fewer heads (GQA) and a key part shared by every head
        (MLA's RoPE key), as at :class:`~lightning_moe.models.transformer.CoreAttention`."""

        H = q_BHSK.shape[1]
        if self.impl == "varlen":
            return self._varlen(q_BHSK, k_BGSK, v_BGSV, scale, k_shared_B1SP)
        if self.impl == "flex":
            flex_attention, _ = _flex_functions(q_BHSK.device)
            if k_shared_B1SP is not None:
                k_BGSK = torch.cat([k_BGSK, k_shared_B1SP.expand(-1, k_BGSK.shape[1], -1, -1)], dim=-1)
            return flex_attention(q_BHSK, k_BGSK, v_BGSV, block_mask=self.block_mask, scale=scale,
                                  enable_gqa=k_BGSK.shape[1] != H)
        k_BHSK, v_BHSV = expand_kv(H, k_BGSK, v_BGSV, k_shared_B1SP)
        return F.scaled_dot_product_attention(q_BHSK, k_BHSK, v_BHSV, attn_mask=self.dense_B1SL, scale=scale)

    def _varlen(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, scale: Optional[float],
                k_shared_B1SP: Optional[Tensor]) -> Tensor:
        from torch.nn.attention.varlen import varlen_attn

        B, H, S, _ = q_BHSK.shape
        rep = H // k_BGSK.shape[1]
        # the model hands over [B, S, heads, K] tensors viewed as [B, heads, S, K]: flattening them back is free;
        # the GQA repeat is done in that layout so k and v stay flat views too (enable_gqa is not in every torch)
        q_BSHK, k_BSGK, v_BSGV = q_BHSK.transpose(1, 2), k_BGSK.transpose(1, 2), v_BGSV.transpose(1, 2)
        if rep > 1:
            k_BSGK, v_BSGV = k_BSGK.repeat_interleave(rep, dim=2), v_BSGV.repeat_interleave(rep, dim=2)
        if k_shared_B1SP is not None:
            k_BSGK = torch.cat([k_BSGK, k_shared_B1SP.transpose(1, 2).expand(-1, -1, H, -1)], dim=-1)
        T = B * S
        if "window_size" in _varlen_params():
            causal = {"scale": scale, "window_size": (-1, 0)}
        elif scale is None:
            causal = {"is_causal": True}
        else:
            raise ValueError("this torch's varlen_attn takes no scale: use attn_impl='flex'")
        o_THV = varlen_attn(q_BSHK.reshape(T, H, -1), k_BSGK.reshape(T, H, -1), v_BSGV.reshape(T, H, -1),
                            self.cu_seqlens, self.cu_seqlens, self.max_len, self.max_len, **causal)
        return o_THV.view(B, S, H, -1).transpose(1, 2)
