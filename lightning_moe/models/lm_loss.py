"""Language-model loss: the output projection and the token cross-entropy, summed over valid tokens.

Legend: N tokens, D hidden, V vocabulary, C tokens of one chunk.

``impl`` picks how (DESIGN invariant 7: every fast path keeps its reference, and asking for a missing backend is
an error):

* ``"torch"`` -- the reference: ``logits_NV = h @ w.T`` in the activation dtype, then ``F.cross_entropy`` on an
  fp32 copy. Holds [N, V] logits in bf16 and fp32 (and their gradients) between forward and backward: 25 GiB
  for 16384 tokens of a 151936-token vocabulary.
* ``"chunked"`` -- the same numbers computed C tokens at a time, the gradients of ``h`` and ``w`` taken during
  the forward (the loss is the graph's last node, so its incoming gradient is one scalar and backward only
  scales them). Only one chunk's logits live at a time; the weight gradient accumulates in fp32 where the
  device's matmul can write fp32 (CUDA), so it is rounded once, as in the reference. On CUDA the per-chunk
  softmax arithmetic is one compiled kernel (``torch.compile``); elsewhere it runs eagerly.
* ``"liger"`` -- ``liger_kernel``'s fused linear cross-entropy (Triton; the ``lm`` extra), fp32 accumulation.
* ``"auto"`` -- ``"chunked"`` on CUDA, ``"torch"`` elsewhere (small CPU vocabularies gain nothing from chunks).

The model calls the loss through :class:`LMLoss`, a seam (like its core attention): every path here needs plain
(non-DTensor) tensors, and tensor parallelism replaces the seam by the vocab-parallel loss
(:mod:`lightning_moe.parallel.vocab_parallel_loss`), which runs the chunked loop below over each rank's vocabulary
shard.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["LOSS_IMPLS", "IGNORE_INDEX", "LMLoss", "chunk_tokens_for", "chunked_linear_cross_entropy", "compiled_on_cuda",
           "linear_cross_entropy", "resolve_loss_impl", "token_loss_sum"]

IGNORE_INDEX = -100
LOSS_IMPLS = ("auto", "torch", "chunked", "liger")
_CHUNK_BYTES = 2 * 1024**3  # fp32 logits of one chunk


class LMLoss:
    """The model's loss seam: ``(h_BSD, w_VD, labels_BS, impl) -> `` the fp32 sum of the token losses. An object, not
    a submodule (no state-dict keys); tensor parallelism replaces it (``parallel.parallelize.apply_tp``)."""

    def __call__(self, h_BSD: Tensor, w_VD: Tensor, labels_BS: Tensor, impl: str) -> Tensor:
        assert not isinstance(w_VD, DTensor) and not isinstance(h_BSD, DTensor), (
            "a tensor-parallel LM head needs the vocab-parallel loss seam (parallelize installs it)")
        return linear_cross_entropy(h_BSD.flatten(0, 1), w_VD.to(h_BSD.dtype), labels_BS.flatten(), impl)


def chunk_tokens_for(V: int) -> int:
    """Tokens per chunk of the ``"chunked"`` loss over a vocabulary (or vocabulary shard) of V: fp32 logits of
    about ``_CHUNK_BYTES``."""
    return max(16, _CHUNK_BYTES // (4 * V))


def resolve_loss_impl(impl: str, device: torch.device) -> str:
    """The implementation ``impl`` means on ``device`` (a ValueError for an unknown or unavailable one)."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss_impl must be one of {LOSS_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "chunked" if device.type == "cuda" else "torch"
    if impl == "liger":
        try:
            import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"loss_impl='liger' needs liger-kernel (pip install 'lightning_moe[lm]'): {e}; or use 'chunked'"
            ) from e
        if device.type != "cuda":
            raise ValueError("loss_impl='liger' runs on CUDA only (Triton kernels); use 'chunked' or 'torch'")
    return impl


def linear_cross_entropy(h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, impl: str = "auto",
                         chunk_tokens: Optional[int] = None) -> Tensor:
    """Sum over tokens with ``labels_N != -100`` of ``-log softmax(h @ w.T)[label]``, an fp32 scalar.

    ``h_ND`` and ``w_VD`` share one dtype; ``chunk_tokens`` overrides the chunk size of ``"chunked"``."""
    if h_ND.dim() != 2 or w_VD.dim() != 2 or h_ND.shape[1] != w_VD.shape[1] or labels_N.shape != h_ND.shape[:1]:
        raise ValueError(f"linear_cross_entropy expects h [N, D], w [V, D], labels [N]; got {tuple(h_ND.shape)}, "
                         f"{tuple(w_VD.shape)}, {tuple(labels_N.shape)}")
    impl = resolve_loss_impl(impl, h_ND.device)
    dev = h_ND.device.type
    if impl != "torch" and torch.is_autocast_enabled(dev):
        # the fused paths do their own precision: run them on the autocast dtype with autocast off
        dtype = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            return linear_cross_entropy(h_ND.to(dtype), w_VD.to(dtype), labels_N, impl, chunk_tokens)
    if impl == "torch":
        return token_loss_sum(h_ND @ w_VD.t(), labels_N)
    if impl == "liger":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        out = LigerFusedLinearCrossEntropyFunction.apply(h_ND, w_VD, labels_N, None, None, IGNORE_INDEX, 0.0, 0.0,
                                                         "sum", None, False, torch.float32)
        return (out[0] if isinstance(out, tuple) else out).float()
    return chunked_linear_cross_entropy(h_ND, w_VD, labels_N, chunk_tokens or chunk_tokens_for(w_VD.shape[0]))


CEChunk = Callable[[Tensor, Tensor, bool], "tuple[Tensor, Optional[Tensor]]"]


def chunked_linear_cross_entropy(h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, C: int,
                                 ce_chunk: Optional[CEChunk] = None) -> Tensor:
    """The ``"chunked"`` loop: ``ce_chunk(logits_CV, labels_C, want_grad)`` -> (the chunk's loss sum, d(sum)/d(logits)
    or None) runs on each chunk's logits ``h[c] @ w.T`` (default: the whole-vocabulary cross-entropy; the
    vocab-parallel loss passes one over a vocabulary shard). ``h_ND`` and ``w_VD`` are plain tensors of one dtype."""
    if ce_chunk is None:
        ce_chunk = _ce_chunk
    need_h, need_w = h_ND.requires_grad, w_VD.requires_grad
    if not torch.is_grad_enabled() or not (need_h or need_w):
        return _chunked_loss(h_ND, w_VD, labels_N, C, ce_chunk)
    return _ChunkedLinearCE.apply(h_ND, w_VD, labels_N, C, ce_chunk)


def token_loss_sum(logits_NV: Tensor, labels_N: Tensor) -> Tensor:
    """The reference: the sum of the token cross-entropies over labels != -100, on an fp32 copy of the logits."""
    return F.cross_entropy(logits_NV.float(), labels_N, ignore_index=IGNORE_INDEX, reduction="sum")


def _ce_chunk_eager(logits_CV: Tensor, labels_C: Tensor, want_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
    """(sum of token losses of the chunk, d(sum)/d(logits) in the logits' dtype or None)."""
    x_CV = logits_CV.float()
    valid_C = labels_C != IGNORE_INDEX
    tgt_C1 = labels_C.clamp(min=0).unsqueeze(1)
    lse_C = torch.logsumexp(x_CV, dim=-1)
    loss = torch.where(valid_C, lse_C - x_CV.gather(1, tgt_C1).squeeze(1), 0.0).sum()
    if not want_grad:
        return loss, None
    # softmax minus the one-hot label, zero on ignored tokens
    p_CV = torch.exp(x_CV - lse_C.unsqueeze(1))
    p_CV = p_CV.scatter_add(1, tgt_C1, torch.full_like(tgt_C1, -1, dtype=p_CV.dtype))
    g_CV = torch.where(valid_C.unsqueeze(1), p_CV, 0.0)
    return loss, g_CV.to(logits_CV.dtype)


def compiled_on_cuda(fn: Callable) -> Callable:
    """``fn(x, *args)`` through ``torch.compile`` (dynamic shapes, compiled on first use) when ``x`` is a CUDA tensor:
    one fused reduction + pointwise kernel instead of several passes over [C, V] in fp32; eager elsewhere."""
    compiled = functools.cache(lambda: torch.compile(fn, dynamic=True))

    @functools.wraps(fn)
    def run(x: Tensor, *args):
        return compiled()(x, *args) if x.is_cuda else fn(x, *args)

    return run


_ce_chunk = compiled_on_cuda(_ce_chunk_eager)


def _chunked_loss(h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, C: int, ce_chunk: CEChunk) -> Tensor:
    loss = h_ND.new_zeros((), dtype=torch.float32)
    for s in range(0, h_ND.shape[0], C):
        loss = loss + ce_chunk(h_ND[s:s + C] @ w_VD.t(), labels_N[s:s + C], False)[0]
    return loss


def _fp32_out_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda"  # torch.mm(..., out_dtype=torch.float32) for bf16/fp16 inputs: CUDA kernels only


class _ChunkedLinearCE(torch.autograd.Function):
    """Loss and both input gradients in one chunked forward; backward scales the stored gradients."""

    @staticmethod
    def forward(ctx, h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, C: int, ce_chunk: CEChunk) -> Tensor:
        N = h_ND.shape[0]
        low_precision = w_VD.dtype in (torch.bfloat16, torch.float16)
        fp32_acc = low_precision and _fp32_out_mm_supported(w_VD.device)
        grad_h_ND = torch.empty_like(h_ND)
        grad_w_VD: Optional[Tensor] = None
        loss = h_ND.new_zeros((), dtype=torch.float32)
        for s in range(0, N, C):
            h_CD = h_ND[s:s + C]
            chunk_loss, g_CV = ce_chunk(h_CD @ w_VD.t(), labels_N[s:s + C], True)
            assert g_CV is not None
            loss = loss + chunk_loss
            torch.mm(g_CV, w_VD, out=grad_h_ND[s:s + C])
            if fp32_acc:
                part_VD = torch.mm(g_CV.t(), h_CD, out_dtype=torch.float32)
            else:
                part_VD = g_CV.t() @ h_CD
            grad_w_VD = part_VD if grad_w_VD is None else grad_w_VD.add_(part_VD)
        if grad_w_VD is None:  # no tokens
            grad_w_VD = torch.zeros_like(w_VD)
        ctx.save_for_backward(grad_h_ND, grad_w_VD)
        ctx.w_dtype = w_VD.dtype
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        # the scale in fp32 (it is 1/N when the step's loss is pre-normalised): rounding it to bf16 would mis-scale
        grad_h = (grad_h_ND.float() * g).to(grad_h_ND.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (grad_w_VD * g).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None
