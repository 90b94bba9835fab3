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
* ``"split"``: the plain causal kernel (SDPA ``is_causal``: cuDNN's fused attention on Hopper, what unpacked
  training runs) once per document, on a window rounded up to a bucket length (:mod:`.document_windows`); any
  device, any head dims.
* ``"auto"``: ``"sdpa"`` off CUDA. On CUDA decided per batch from its segment lengths: ``"split"`` for few, long
  documents (:func:`~.document_windows.prefer_windows`: at most 64, of 1024 tokens or more on average), else
  ``"varlen"`` when q, k and v share one head dim, ``"flex"`` when not. Measured on one H200
  (``bench/RESULTS.md``, issue 22): every document-masked kernel torch 2.11 has is 1.3-1.6x slower than cuDNN's
  causal one, so long documents are fastest through it.

The kernel's inputs (the dense mask, the block mask, or ``cu_seqlens``) are built once per forward in
:class:`DocumentMask` and shared by every layer.

Host syncs: ``cu_seqlens`` and the longest segment need the document structure on the host. Computed from the
device's ``position_ids`` that costs syncs (``nonzero``) once per forward; the data collate computes it instead on the
CPU (:func:`document_segments`, the batch's ``document_segments`` entry, moved to the device with the batch), and then
a forward syncs nowhere. With it the fast kernels also skip the mask where it is not needed: rows holding one
document run the plain causal kernel (exact: causal attention over one document is its block-causal attention), the
whole batch when every row does ("flex", "varlen", "split"), row by row otherwise ("varlen": single-document rows
through ``is_causal`` SDPA, the others through ``varlen_attn``). "sdpa", the reference, always applies its explicit
mask.

Legend: B batch, S (local) sequence, L keys (the gathered sequence under context parallelism), H heads, K head dim
of q/k, V head dim of v, T = B * S flattened tokens, N segments.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.config import ATTN_IMPLS  # the names live with the config, which imports no model code
from lightning_moe.models.document_windows import WindowPlan, prefer_windows, warm_window_plans, windowed_causal
from lightning_moe.models.heads import expand_kv

__all__ = ["ATTN_IMPLS", "DocumentMask", "DocumentSegments", "document_ids", "document_segments", "resolve_attn_impl",
           "segment_lengths"]


def resolve_attn_impl(impl: str, device: torch.device, same_head_dims: bool) -> str:
    """The kernel ``impl`` means on ``device`` (a ValueError for one that cannot run there); for "auto" on CUDA the
    kernel of batches of many short documents (:meth:`DocumentMask.build` takes "split" for long ones)."""
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


def _segment_starts(doc_BS: Tensor) -> Tensor:
    """Bool [B * S]: where a segment (a run of one document id inside a row of the flattened tokens) starts."""
    S = doc_BS.shape[1]
    flat_T = doc_BS.reshape(-1)
    start_T = torch.ones_like(flat_T, dtype=torch.bool)
    start_T[1:] = flat_T[1:] != flat_T[:-1]
    start_T[::S] = True  # a row never continues the previous one
    return start_T


def varlen_segments(doc_BS: Tensor) -> tuple[Tensor, int]:
    """``cu_seqlens`` (int32 [N + 1]) and the longest segment of the flattened [B * S] tokens. On a CUDA tensor two
    host syncs (the segment count and the longest): the fallback for batches without :func:`document_segments`."""
    starts_N = _segment_starts(doc_BS).nonzero().squeeze(1)
    cu_N1 = torch.cat([starts_N, starts_N.new_tensor([doc_BS.numel()])]).to(torch.int32)
    return cu_N1, int((cu_N1[1:] - cu_N1[:-1]).max())


class DocumentSegments(NamedTuple):
    """The segments of a packed batch, computed on the CPU by the collate (:func:`document_segments`): what the
    varlen kernel and the single-document shortcut need, without a host sync in the forward. A batch entry
    (``batch["document_segments"]``); Lightning moves ``cu_seqlens`` to the device with the batch.

    ``cu_seqlens``: int32 [N + 1], the segment boundaries of the flattened [B * S] tokens (a segment is a run of one
    document inside a row; every padding token is a segment of its own); ``max_seqlen``: the longest segment;
    ``row_segments``: the number of segments of each row (1: the row is one document, no padding);
    ``lengths``: every segment's length, in order (what "split" plans its windows with; empty: read from
    ``cu_seqlens``, a host sync)."""

    cu_seqlens: Tensor
    max_seqlen: int
    row_segments: tuple[int, ...]
    lengths: tuple[int, ...] = ()


def document_segments(position_ids_BS: Tensor, attention_mask_BS: Optional[Tensor] = None) -> DocumentSegments:
    """:class:`DocumentSegments` of a batch's ``position_ids`` (and padding mask); meant for CPU tensors (the
    collate), where it syncs nothing."""
    B, S = position_ids_BS.shape
    valid = None if attention_mask_BS is None else attention_mask_BS.bool()
    doc_BS = document_ids(torch.arange(S, device=position_ids_BS.device), position_ids_BS, valid)
    start_BS = _segment_starts(doc_BS).view(B, S)
    cu, longest = varlen_segments(doc_BS)
    return DocumentSegments(cu, longest, tuple(int(n) for n in start_BS.sum(1).tolist()),
                            tuple(int(n) for n in (cu[1:] - cu[:-1]).tolist()))


def segment_lengths(doc_BS: Tensor, segments: Optional[DocumentSegments] = None) -> list[int]:
    """The length of every segment of the flattened [B * S] tokens, in order, on the host: from the collate's
    ``segments`` when they carry them, else read back from the device (a sync)."""
    if segments is not None and segments.lengths:
        return list(segments.lengths)
    cu = segments.cu_seqlens if segments is not None else varlen_segments(doc_BS)[0]
    return (cu[1:] - cu[:-1]).tolist()


def check_document_segments(segments: DocumentSegments, position_ids_BS: Tensor,
                            attention_mask_BS: Optional[Tensor] = None) -> None:
    """ValueError unless ``segments`` are those of ``position_ids_BS`` (what :func:`document_segments` computes):
    a batch's precomputed segments must describe its own documents, or attention would cross them."""
    want = document_segments(position_ids_BS.cpu(), None if attention_mask_BS is None else attention_mask_BS.cpu())
    got_cu = segments.cu_seqlens.detach().cpu() if isinstance(segments.cu_seqlens, Tensor) else None
    if (got_cu is None or got_cu.tolist() != want.cu_seqlens.tolist() or int(segments.max_seqlen) != want.max_seqlen
            or tuple(segments.row_segments) != want.row_segments
            or (segments.lengths and tuple(segments.lengths) != want.lengths)):
        raise ValueError("batch['document_segments'] do not match the batch's position_ids / attention_mask: build "
                         "them with lightning_moe.models.document_mask.document_segments(position_ids, "
                         "attention_mask) in the collate (or leave them out)")


class DocumentMask:
    """What the attention seam receives for packed sequences (in place of a key padding mask): the document id and
    global position of every local token, and the chosen kernel's inputs, built once for all layers.

    ``DocumentMask(doc_BS, positions_S, impl, segments)`` builds the single-process inputs of a resolved kernel
    (:meth:`build` resolves ``attn_impl`` first); ``segments`` (:class:`DocumentSegments`, optional) is the batch's
    structure known on the host: no sync, and the single-document shortcut (see the module docstring). Context
    parallelism builds its own (:meth:`gathered`): the dense mask of the local queries against the gathered keys.

    ``row_runs``: the rows in order as (first, end, kind) runs: kind "causal" (rows of one document each) or the
    kernel's ``impl``."""

    def __init__(self, doc_BS: Tensor, positions_S: Tensor, impl: str,
                 segments: Optional[DocumentSegments] = None, lengths: Optional[list[int]] = None) -> None:
        if impl not in ("sdpa", "flex", "varlen", "split"):
            raise ValueError(f"DocumentMask needs a resolved attn_impl ('sdpa', 'flex', 'varlen' or 'split'), got "
                             f"{impl!r}")
        self.doc_BS, self.positions_S, self.impl = doc_BS, positions_S, impl
        B, S = doc_BS.shape
        self.dense_B1SL: Optional[Tensor] = None
        self.block_mask = None
        self.cu_seqlens: Optional[Tensor] = None
        self.max_len = 0
        self.window_plan: Optional[WindowPlan] = None
        self.row_runs: list[tuple[int, int, str]] = [(0, B, impl)]
        self._run_cu: dict[int, Tensor] = {}
        if segments is not None and impl != "sdpa":
            assert len(segments.row_segments) == B, "document_segments describe another batch"
            single = [n == 1 for n in segments.row_segments]
            if all(single):
                self.row_runs = [(0, B, "causal")]
            elif impl == "varlen":
                self.row_runs = _runs(single, impl)
        if impl == "split" and self.row_runs != [(0, B, "causal")]:
            lengths = segment_lengths(doc_BS, segments) if lengths is None else lengths
            if all(n == S for n in lengths):  # no host structure given, yet every row is one document
                self.row_runs = [(0, B, "causal")]
            else:
                self.window_plan = WindowPlan.from_lengths(lengths, S)
        if impl == "sdpa":
            self.dense_B1SL = dense_document_mask(doc_BS, positions_S, doc_BS, positions_S)
        elif self.row_runs == [(0, B, "causal")] or impl == "split":
            pass  # every row is one document (the plain causal kernel), or the windows: no mask to build
        elif impl == "flex":
            _, create_block_mask = _flex_functions(doc_BS.device)

            def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                return (doc_BS[b, q] == doc_BS[b, kv]) & (kv <= q)

            self.block_mask = create_block_mask(same_document_causal, B, None, S, S, device=doc_BS.device)
        elif segments is None:
            self.cu_seqlens, self.max_len = varlen_segments(doc_BS)
        else:
            # max_seqlen of the whole batch bounds every run's (the kernel only sizes its grid with it)
            self.cu_seqlens, self.max_len = segments.cu_seqlens.to(doc_BS.device, non_blocking=True), segments.max_seqlen
            first_segment = [0]
            for n in segments.row_segments:
                first_segment.append(first_segment[-1] + n)
            for r0, r1, kind in self.row_runs:
                if kind == "varlen" and (r0, r1) != (0, B):  # the run's segments, rebased to its first token
                    self._run_cu[r0] = self.cu_seqlens[first_segment[r0]:first_segment[r1] + 1] - r0 * S

    @classmethod
    def build(cls, doc_BS: Tensor, positions_S: Tensor, attn_impl: str, same_head_dims: bool,
              segments: Optional[DocumentSegments] = None, windows: bool = True) -> "DocumentMask":
        """The model's per-forward builder on one process: ``attn_impl`` resolved for the device ("auto" on CUDA: for
        this batch's segment lengths; ``windows`` False: never "split", for a model that recomputes or offloads
        activations, see :mod:`.document_windows`), then built."""
        impl = resolve_attn_impl(attn_impl, doc_BS.device, same_head_dims)
        lengths = None
        if attn_impl == "auto" and impl != "sdpa" and windows:
            lengths = segment_lengths(doc_BS, segments)
            if prefer_windows(lengths):
                impl = "split"
        return cls(doc_BS, positions_S, impl, segments, lengths)

    @classmethod
    def gathered(cls, doc_BS: Tensor, positions_S: Tensor, k_doc_BL: Tensor, k_pos_L: Tensor) -> "DocumentMask":
        """The SDPA mask of local queries against keys gathered from elsewhere (context parallelism)."""
        self = cls.__new__(cls)
        self.doc_BS, self.positions_S, self.impl = doc_BS, positions_S, "sdpa"
        self.block_mask, self.cu_seqlens, self.max_len, self.window_plan = None, None, 0, None
        self.row_runs, self._run_cu = [(0, doc_BS.shape[0], "sdpa")], {}
        self.dense_B1SL = dense_document_mask(doc_BS, positions_S, k_doc_BL, k_pos_L)
        return self

    def __repr__(self) -> str:
        return f"DocumentMask(impl={self.impl!r}, shape={tuple(self.doc_BS.shape)}, row_runs={self.row_runs})"

    def attend(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, scale: Optional[float],
               k_shared_B1SP: Optional[Tensor] = None) -> Tensor:
        """o [B, H, S, V] on one process: k/v may hold fewer heads (GQA) and a key part shared by every head
        (MLA's RoPE key), as at :class:`~lightning_moe.models.transformer.CoreAttention`."""
        if self.impl == "split":
            self._warm_windows(q_BHSK, k_BGSK, v_BGSV, scale, k_shared_B1SP)
        if len(self.row_runs) == 1:
            return self._attend_rows(self.row_runs[0][2], 0, q_BHSK, k_BGSK, v_BGSV, scale, k_shared_B1SP)
        # rows of one document through the causal kernel, the others through the kernel; the pieces are [b, S, H, V]
        # views of their kernels' outputs, concatenated once
        pieces = []
        for r0, r1, kind in self.row_runs:
            rows = slice(r0, r1)
            o = self._attend_rows(kind, r0, q_BHSK[rows], k_BGSK[rows], v_BGSV[rows], scale,
                                  None if k_shared_B1SP is None else k_shared_B1SP[rows])
            pieces.append(o.transpose(1, 2))
        return torch.cat(pieces, dim=0).transpose(1, 2)

    def _attend_rows(self, kind: str, r0: int, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, scale: Optional[float],
                     k_shared_B1SP: Optional[Tensor]) -> Tensor:
        H = q_BHSK.shape[1]
        if kind == "split":
            return self._split(q_BHSK, k_BGSK, v_BGSV, scale, k_shared_B1SP)
        if kind == "varlen":
            return self._varlen(q_BHSK, k_BGSK, v_BGSV, scale, k_shared_B1SP, self._run_cu.get(r0, self.cu_seqlens))
        if kind == "flex":
            flex_attention, _ = _flex_functions(q_BHSK.device)
            if k_shared_B1SP is not None:
                k_BGSK = torch.cat([k_BGSK, k_shared_B1SP.expand(-1, k_BGSK.shape[1], -1, -1)], dim=-1)
            return flex_attention(q_BHSK, k_BGSK, v_BGSV, block_mask=self.block_mask, scale=scale,
                                  enable_gqa=k_BGSK.shape[1] != H)
        k_BHSK, v_BHSV = expand_kv(H, k_BGSK, v_BGSV, k_shared_B1SP)
        if kind == "causal":  # the kernel of unpacked batches (CoreAttention's)
            return F.scaled_dot_product_attention(q_BHSK, k_BHSK, v_BHSV, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q_BHSK, k_BHSK, v_BHSV, attn_mask=self.dense_B1SL, scale=scale)

    @torch.compiler.disable  # per-batch Python (the windows): eager, one graph break, no guard on the plan
    def _split(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, scale: Optional[float],
               k_shared_B1SP: Optional[Tensor]) -> Tensor:
        assert self.window_plan is not None
        B, H, S, _ = q_BHSK.shape
        G, T = k_BGSK.shape[1], B * S
        # [B, S, heads, K] tensors viewed as [B, heads, S, K]: flattening them is free, and windows are views of it;
        # GQA's kv heads stay G (the kernel groups them); MLA's shared key part goes to every head
        q_THK = q_BHSK.transpose(1, 2).reshape(T, H, -1)
        k_TGK, v_TGV = k_BGSK.transpose(1, 2).reshape(T, G, -1), v_BGSV.transpose(1, 2).reshape(T, G, -1)
        if k_shared_B1SP is not None:
            if G != H:
                k_TGK, v_TGV = k_TGK.repeat_interleave(H // G, dim=1), v_TGV.repeat_interleave(H // G, dim=1)
            k_TP = k_shared_B1SP.transpose(1, 2).reshape(T, 1, -1)
            k_TGK = torch.cat([k_TGK, k_TP.expand(-1, k_TGK.shape[1], -1)], dim=-1)
        # one memory layout for every window (a view of a strided slice, e.g. MLA's v, would be another shape to
        # the kernel's plan cache than the warmed one and than a padded last window: a plan build in a later step)
        q_THK, k_TGK, v_TGV = q_THK.contiguous(), k_TGK.contiguous(), v_TGV.contiguous()
        o_THV = windowed_causal(q_THK, k_TGK, v_TGV, self.window_plan, scale)
        return o_THV.view(B, S, H, -1).transpose(1, 2)

    def _warm_windows(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, scale: Optional[float],
                      k_shared_B1SP: Optional[Tensor]) -> None:
        """The windows' kernel plans for this batch shape, built on the first "split" forward of it (also one whose
        rows are all single documents, the causal shortcut), so that no later step pays for one. The shapes are
        those :meth:`_split` hands the kernel: G kv heads, or every head when MLA's shared key part is appended."""
        if not q_BHSK.is_cuda:
            return
        H = q_BHSK.shape[1]
        G = k_BGSK.shape[1] if k_shared_B1SP is None else H
        k_dim = k_BGSK.shape[-1] + (0 if k_shared_B1SP is None else k_shared_B1SP.shape[-1])
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHSK, k_BGSK, v_BGSV))
        warm_window_plans(self.doc_BS.shape[1], H, G, k_dim, v_BGSV.shape[-1], q_BHSK.dtype, q_BHSK.device, scale,
                          backward)

    def _varlen(self, q_BHSK: Tensor, k_BGSK: Tensor, v_BGSV: Tensor, scale: Optional[float],
                k_shared_B1SP: Optional[Tensor], cu_seqlens: Tensor) -> Tensor:
        from torch.nn.attention.varlen import varlen_attn

        B, H, S, _ = q_BHSK.shape
        G = k_BGSK.shape[1]
        params = _varlen_params()
        # the model hands over [B, S, heads, K] tensors viewed as [B, heads, S, K]: flattening them back is free
        q_BSHK, k_BSGK, v_BSGV = q_BHSK.transpose(1, 2), k_BGSK.transpose(1, 2), v_BGSV.transpose(1, 2)
        kw: dict = {}
        if G != H and ("enable_gqa" not in params or k_shared_B1SP is not None):
            # no native GQA in this torch's varlen_attn (or a shared key part to append per head): repeat kv heads
            k_BSGK, v_BSGV = k_BSGK.repeat_interleave(H // G, dim=2), v_BSGV.repeat_interleave(H // G, dim=2)
            G = H
        elif G != H:
            kw["enable_gqa"] = True  # flash attention reads each kv head for its query heads: no repeat copies
        if k_shared_B1SP is not None:
            k_BSGK = torch.cat([k_BSGK, k_shared_B1SP.transpose(1, 2).expand(-1, -1, G, -1)], dim=-1)
        T = B * S
        if "window_size" in params:
            kw.update(scale=scale, window_size=(-1, 0))
        elif scale is None:
            kw["is_causal"] = True
        else:
            raise ValueError("this torch's varlen_attn takes no scale: use attn_impl='flex'")
        o_THV = varlen_attn(q_BSHK.reshape(T, H, -1), k_BSGK.reshape(T, G, -1), v_BSGV.reshape(T, G, -1),
                            cu_seqlens, cu_seqlens, self.max_len, self.max_len, **kw)
        return o_THV.view(B, S, H, -1).transpose(1, 2)


def _runs(single: list[bool], impl: str) -> list[tuple[int, int, str]]:
    """Maximal runs of consecutive rows of one kind: ("causal" for single-document rows, else ``impl``)."""
    runs: list[tuple[int, int, str]] = []
    for b, one in enumerate(single):
        kind = "causal" if one else impl
        if runs and runs[-1][2] == kind:
            runs[-1] = (runs[-1][0], b + 1, kind)
        else:
            runs.append((b, b + 1, kind))
    return runs
