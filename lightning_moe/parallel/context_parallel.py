"""Context parallelism (CP): the sequence of every sample is split over the ``cp`` ranks of the dense mesh.

Scheme: all-gather K/V (as in Llama 3 training), which runs on gloo (CPU) as well as NCCL. Each rank keeps its
queries local, all-gathers the keys and values of the whole sequence over the cp group with a differentiable
all-gather (its backward is a reduce-scatter, so every rank's K/V gradients receive the contributions of every
rank's queries), and masks causally by *global* token position.

Load balance: a causal mask makes late tokens expensive, so the sequence is cut into ``2 * cp`` chunks and rank
``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` (one early, one late), in that order.

How parallelize attaches it (model code stays single-device, DESIGN invariant 1)::

    for block in model.layers.values():
        block.attention.core_attention = AllGatherKVAttention(cp_mesh.get_group())
    local = shard_batch_for_cp(batch, cp_size, cp_rank)          # labels shifted on the full sequence first
    logits = model(local["input_ids"], local.get("attention_mask"), local["global_positions"],
                   position_ids_BS=local.get("position_ids"))      # packed documents, if the batch has them

Everything else in the model (embeddings, norms, MLPs, MoE routing) is per token, so it runs unchanged on the
local tokens. Per-sequence statistics (a sequence-level aux loss, loss token counts) must be reduced over the cp
group by their owners.

Padding: ``shard_batch_for_cp`` slices ``attention_mask`` like the tokens. Each rank's MoE layers route only its
own real tokens (the routers' counts and normalisers are summed over the cp group), the attention masks padding
keys over the gathered sequence (their validity is gathered with their positions), and the loss counts the real
labels of each rank, summed over cp by the strategy.

Packed documents (``position_ids`` [B, S] restarting per document, :mod:`lightning_moe.models.document_mask`):
they are sliced like the tokens and rotate q/k; the global indices keep the causal order. A token's document id is
its global index minus its position, so each rank computes its own tokens' ids; they are gathered with the
positions once per forward (:meth:`AllGatherKVAttention.document_mask`) and the block-causal mask over the gathered
keys is built once for every layer.

Legend: B batch, H heads, G kv heads, S local sequence, L gathered (global) sequence, K head dim of q/k, V head
dim of v, P MLA's shared RoPE key dim.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.activation_plan import ActivationPlan
from lightning_moe.autograd import contiguous_grad
from lightning_moe.collectives import all_gather, all_gather_autograd, wait
from lightning_moe.models.document_mask import DocumentMask, DocumentSegments
from lightning_moe.models.heads import expand_kv
from lightning_moe.models.transformer import padded_causal_mask

__all__ = ["cp_shard_indices", "shard_batch_for_cp", "AllGatherKVAttention"]



def cp_shard_indices(seq_len: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None) -> Tensor:
    """Global token indices (int64, ascending) held by ``cp_rank``: the sequence is split into ``2 * cp_size``
    equal chunks and the rank holds chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``, concatenated.

    Example: ``seq_len=8, cp_size=2``: rank 0 -> ``[0, 1, 6, 7]``, rank 1 -> ``[2, 3, 4, 5]``.
    ``cp_size == 1`` gives ``arange(seq_len)`` for any length.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if cp_size == 1:
        return torch.arange(seq_len, dtype=torch.long, device=device)
    n = 2 * cp_size
    if seq_len <= 0 or seq_len % n != 0:
        raise ValueError(
            f"context parallelism with cp={cp_size} splits each sequence into 2*cp={n} equal chunks, but the "
            f"sequence length is {seq_len}: use a sequence length divisible by {n} (e.g. "
            f"{max(n, (seq_len // n) * n)} or {(seq_len // n + 1) * n}; packed data sets it with the data module's "
            f"seq_len), or choose a cp size with 2*cp dividing {seq_len}"
        )
    c = seq_len // n
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, dtype=torch.long, device=device)
    j = n - 1 - cp_rank
    second = torch.arange(j * c, (j + 1) * c, dtype=torch.long, device=device)
    return torch.cat([first, second])


def shard_batch_for_cp(batch: Mapping[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """This cp rank's slice of a batch, plus ``global_positions`` (the global indices of the local tokens,
    [S_local]: the causal order).

    ``batch`` holds ``input_ids`` [B, S] and ``labels`` [B, S] computed on the *full* sequence (shift before
    sharding: the label of a rank's last token lives on another rank); optional ``attention_mask`` [B, S] and
    ``position_ids`` [B, S] (packed documents). Every tensor of shape [B, S, ...] is sliced along dim 1; other
    entries are passed through. The input dict is not modified. With ``cp_size == 1`` the batch is returned as is
    (a shallow copy) plus ``global_positions`` = ``arange(S)``, and labels are not required.

    Raises ValueError when ``labels`` are missing, ``position_ids`` are not [B, S], or S is not divisible by
    ``2 * cp_size``.
    """
    if "input_ids" not in batch:
        raise ValueError("shard_batch_for_cp needs batch['input_ids'] of shape [B, S]")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must have shape [B, S], got {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    out = dict(batch)
    position_ids = batch.get("position_ids")
    if position_ids is not None and tuple(position_ids.shape) != (B, S):
        raise ValueError(f"batch['position_ids'] must have the shape of input_ids {(B, S)} (per-document positions "
                         f"of packed sequences), got {tuple(position_ids.shape)}")
    if cp_size == 1:
        out["global_positions"] = torch.arange(S, dtype=torch.long, device=input_ids.device)
        return out
    if batch.get("labels") is None:
        raise ValueError(
            "context parallelism needs batch['labels'] computed on the full sequence before sharding (the next "
            "token of a rank's last token lives on another rank): shift the labels first, e.g. "
            "batch['labels'] = shift_labels(input_ids, attention_mask)"
        )
    idx = cp_shard_indices(S, cp_size, cp_rank, device=input_ids.device)
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[0] == B and value.shape[1] == S:
            out[key] = value.index_select(1, idx.to(value.device))
    out["global_positions"] = idx
    return out


class AllGatherKVAttention:
    """Causal attention over a context-parallel group: a drop-in for the model's ``CoreAttention`` (a plain object,
    no state-dict keys) with the same call signature.

    ``__call__(q_BHSK, k_BGSK, v_BGSV, key_valid_BS, scale, positions_S, k_shared_B1SP=None) -> o_BHSV``: q/k/v
    hold this rank's tokens (any subset of the sequence, e.g. from :func:`cp_shard_indices`) and ``positions_S``
    their global positions. K, V (and the shared key part), the positions and the key padding mask are all-gathered
    over ``cp_group`` (differentiable for K and V), and the queries attend to every real key at a global position
    <= their own. K/V are gathered as the model hands them over: G kv heads (GQA) and MLA's one shared RoPE key,
    repeated / expanded to the query heads only after the gather (:func:`expand_kv`), which moves H/G times fewer
    bytes than gathering repeated heads. k/v may have different head dims (MLA).

    ``key_valid_BS``: bool [B, S], True = real token, for this rank's keys; None = all real. A rank whose tokens
    are all real may pass None while another passes a mask (the model drops an all-real mask): the validity is
    always gathered, with the positions in one collective, so every rank issues the same collectives. The mask is
    therefore [B, 1, S, L] (batch dim included) even without padding: telling "no rank has padding" apart would
    cost a host sync per layer.

    Note: the boolean mask keeps SDPA off the flash kernel (the memory-efficient or math kernel runs instead).
    """

    activation_seams = ("kernel",)  # recompute "attn_core": the local attention after the gathers
    activation_plan = ActivationPlan()

    def __init__(self, cp_group: Optional[dist.ProcessGroup] = None) -> None:
        self.cp_group = cp_group if cp_group is not None else dist.group.WORLD
        self.cp_size = dist.get_world_size(self.cp_group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size})"

    def __deepcopy__(self, memo: dict) -> "AllGatherKVAttention":
        # a deep-copied model (e.g. an EMA or reference copy) shares the process group, which cannot be copied
        copied = type(self)(self.cp_group)
        copied.activation_plan = self.activation_plan
        return copied

    def _gather_seq(self, x_BHSK: Tensor) -> Tensor:
        """All-gather along the sequence dim (dim 2); the functional gather concatenates along dim 0."""
        x_SBHK = x_BHSK.permute(2, 0, 1, 3).contiguous()
        x_LBHK = contiguous_grad(wait(all_gather_autograd(x_SBHK, 0, self.cp_group)))
        return x_LBHK.permute(1, 2, 0, 3)

    def _gather_keys_meta(self, q_pos_S: Tensor, key_BS: Tensor) -> tuple[Tensor, Tensor]:
        """Global positions [L] and a per-key property [B, L] (validity, or document ids) of every rank's tokens,
        in one all-gather."""
        meta_S1B = torch.cat([q_pos_S[:, None], key_BS.T.long()], dim=1)
        meta_L1B = wait(all_gather(meta_S1B.contiguous(), 0, self.cp_group))
        return meta_L1B[:, 0], meta_L1B[:, 1:].T

    def document_mask(self, doc_BS: Tensor, positions_S: Tensor, attn_impl: str, same_head_dims: bool,
                      segments: Optional[DocumentSegments] = None, windows: bool = True) -> DocumentMask:
        """Packed sequences: the model's per-forward mask builder under cp (``MoETransformer.build_document_mask``).
        Document ids and positions of every rank's tokens are gathered once per forward (not per layer), and the
        block-causal mask of the local queries against all keys is built once; the gathered attention runs SDPA
        with it. ``segments`` (the full rows' structure) and ``windows`` are not needed: the gathered ids say it all."""
        if attn_impl not in ("auto", "sdpa") and self.cp_size > 1:
            raise ValueError(
                f"context parallelism runs packed (document-masked) attention as SDPA with an explicit mask over the "
                f"gathered keys; attn_impl={attn_impl!r} cannot run there: set attn_impl to 'auto' or 'sdpa'"
            )
        q_pos = positions_S.to(device=doc_BS.device, dtype=torch.long)
        if self.cp_size == 1:
            return DocumentMask.gathered(doc_BS, q_pos, doc_BS, q_pos)
        k_pos_L, k_doc_BL = self._gather_keys_meta(q_pos, doc_BS)
        return DocumentMask.gathered(doc_BS, q_pos, k_doc_BL, k_pos_L)

    def __call__(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, key_valid_BS: Optional[Tensor],
                 scale: Optional[float], positions_S: Tensor, k_shared_B1SP: Optional[Tensor] = None) -> Tensor:
        B, S = q_BHSK.shape[0], q_BHSK.shape[2]
        if k_BGSK.shape[2] != S or v_BGSV.shape[2] != S:
            raise ValueError(
                f"q, k and v must hold the same local tokens; got sequence lengths {S}, {k_BGSK.shape[2]}, "
                f"{v_BGSV.shape[2]}"
            )
        if isinstance(key_valid_BS, DocumentMask):  # packed: the mask over the gathered keys is already built
            k_shared_B1LP = k_shared_B1SP
            if self.cp_size > 1:
                k_BGSK, v_BGSV = self._gather_seq(k_BGSK), self._gather_seq(v_BGSV)
                k_shared_B1LP = None if k_shared_B1SP is None else self._gather_seq(k_shared_B1SP)
            return self.activation_plan.recompute.run("kernel", self.kernel, q_BHSK, k_BGSK, v_BGSV,
                                                      key_valid_BS.dense_B1SL, scale, k_shared_B1LP)
        if positions_S is None or positions_S.dim() != 1 or positions_S.shape[0] != S:
            got = None if positions_S is None else tuple(positions_S.shape)
            raise ValueError(
                f"context parallelism needs positions_S: the global positions of the {S} local tokens "
                f"(shard_batch_for_cp(...)['global_positions']), got shape {got}"
            )
        if key_valid_BS is not None and tuple(key_valid_BS.shape) != (B, S):
            raise ValueError(f"the key padding mask must have shape [B, S] = {(B, S)} (this rank's tokens), got "
                             f"{tuple(key_valid_BS.shape)}")
        q_pos = positions_S.to(device=q_BHSK.device, dtype=torch.long)
        valid_BS = (torch.ones(B, S, dtype=torch.bool, device=q_BHSK.device) if key_valid_BS is None
                    else key_valid_BS.to(device=q_BHSK.device, dtype=torch.bool))
        if self.cp_size > 1:
            k_BGLK, v_BGLV = self._gather_seq(k_BGSK), self._gather_seq(v_BGSV)
            k_shared_B1LP = None if k_shared_B1SP is None else self._gather_seq(k_shared_B1SP)
            k_pos, valid_BL = self._gather_keys_meta(q_pos, valid_BS)
            valid_BL = valid_BL.bool()
        else:
            k_BGLK, v_BGLV, k_shared_B1LP, k_pos, valid_BL = k_BGSK, v_BGSV, k_shared_B1SP, q_pos, valid_BS
        return self.activation_plan.recompute.run("kernel", self.kernel, q_BHSK, k_BGLK, v_BGLV,
                                                  padded_causal_mask(q_pos, k_pos, valid_BL), scale, k_shared_B1LP)

    def kernel(self, q_BHSK: Tensor, k_BGLK: Tensor, v_BGLV: Tensor, mask_B1SL: Tensor, scale: Optional[float],
               k_shared_B1LP: Optional[Tensor] = None) -> Tensor:
        """The local attention after the gathers, head repeat included: the collective-free part
        ``activation_checkpointing=[attn_core]`` recomputes (the gathered compact K/V are kept, never gathered
        again; their repeated copies are not)."""
        k_BHLK, v_BHLV = expand_kv(q_BHSK.shape[1], k_BGLK, v_BGLV, k_shared_B1LP)
        return F.scaled_dot_product_attention(q_BHSK, k_BHLK, v_BHLV, attn_mask=mask_B1SL, scale=scale)
