"""Row movement of the dispatchers, as autograd functions that only ever gather (no atomics).

Legend: T tokens, k top-k, D hidden, R rows (grouped by expert). ``pos_TK``: the row holding each assignment's
output (-1: none); ``asg_R``: the assignment (flat index into [T, k]) of each row (-1: a padding row).

:mod:`lightning_moe.moe.permute`'s permute / unpermute are the reference (index_select forward, index_add backward
/ forward). On an H200 an index_add of bf16 rows runs on atomics at ~7x the time of a gather, and an index_copy ~3x,
so the dispatchers keep both maps and only ever gather: token-side sums are a gather of [T, k, D] and a k-sum (a
bmm with the weights), row-side results a gather by token (and a row scale). Tested against the reference in
tests/test_dispatcher.py. With the Triton kernels (:mod:`lightning_moe.moe.kernels`, on CUDA by default) the same
autograd functions run fused gathers: no [T, k, D] copy, the k-sums in fp32, and the unpermute backward in one pass
over the rows.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_moe.moe import kernels


def _gather_tokens(rows_RD: Tensor, pos_TK: Tensor) -> Tensor:
    """[T, k, D] rows of every assignment (row 0 where pos < 0: the caller masks it; needs rows_RD non-empty)."""
    T, k = pos_TK.shape
    return rows_RD.index_select(0, pos_TK.clamp(min=0).reshape(-1)).view(T, k, rows_RD.shape[1])


def _weighted_k_sum(rows_RD: Tensor, pos_TK: Tensor, w_TK: Optional[Tensor]) -> Tensor:
    """out[t] = sum_k w[t, k] * rows[pos[t, k]] (w None: plain sum, every pos valid), in rows' dtype."""
    T = pos_TK.shape[0]
    if T == 0 or rows_RD.shape[0] == 0:
        return rows_RD.new_zeros(T, rows_RD.shape[1])
    G_TKD = _gather_tokens(rows_RD, pos_TK)
    if w_TK is None:
        return G_TKD.sum(1)  # fp32 accumulation for low-precision dtypes
    return torch.bmm(w_TK.to(rows_RD.dtype).unsqueeze(1), G_TKD).squeeze(1)


def _rows_to_tokens(asg_R: Tensor, k: int, rows_covered: bool, T: int) -> Tensor:
    """Token of each row; padding rows (asg -1) read row T, a zero row the caller appends."""
    tok_R = torch.div(asg_R, k, rounding_mode="floor")
    return tok_R if rows_covered else torch.where(asg_R < 0, torch.full_like(tok_R, T), tok_R)


def _with_zero_row(x_TD: Tensor, rows_covered: bool) -> Tensor:
    return x_TD if rows_covered else torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])], dim=0)


class _PermuteRows(torch.autograd.Function):
    """rows[r] = x[asg_R[r] // k] (asg -1: a zero row); backward grad_x[t] = sum_k grad_rows[pos_TK[t, k]]."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, asg_R: Tensor, pos_TK: Tensor, has_dropped: bool, rows_covered: bool) -> Tensor:
        ctx.save_for_backward(pos_TK)
        ctx.has_dropped = has_dropped
        ctx.fused = kernels.use_triton(x_TD)
        T, k = pos_TK.shape
        if ctx.fused:
            return kernels.gather_rows(x_TD, asg_R, k)
        tok_R = _rows_to_tokens(asg_R, k, rows_covered, T)
        return _with_zero_row(x_TD, rows_covered).index_select(0, tok_R)

    @staticmethod
    def backward(ctx, g_RD: Tensor):
        (pos_TK,) = ctx.saved_tensors
        if ctx.fused:
            return kernels.k_sum(g_RD, pos_TK), None, None, None, None
        mask = (pos_TK >= 0).to(g_RD.dtype) if ctx.has_dropped else None
        return _weighted_k_sum(g_RD.contiguous(), pos_TK, mask), None, None, None, None


class _UnpermuteRows(torch.autograd.Function):
    """out[t] = sum_k probs[t, k] * y[pos_TK[t, k]] over assignments with a row (pos >= 0).

    Backward without scatters: grad_y[r] = w(asg_R[r]) * g[token of r] (a gather and a row scale) and
    grad_probs(asg_R[r]) = <y[r], g[token of r]> (fp32 sums)."""

    @staticmethod
    def forward(ctx, y_RD: Tensor, probs_TK: Tensor, pos_TK: Tensor, asg_R: Tensor, has_dropped: bool,
                rows_covered: bool) -> Tensor:
        ctx.fused = kernels.use_triton(y_RD)
        if ctx.fused:  # rows only hold kept assignments: no masking of the weights needed
            ctx.save_for_backward(y_RD, probs_TK, asg_R)
            return kernels.k_sum(y_RD, pos_TK, probs_TK)
        w_TK = torch.where(pos_TK >= 0, probs_TK, torch.zeros_like(probs_TK)) if has_dropped else probs_TK
        ctx.save_for_backward(y_RD, w_TK, asg_R)
        ctx.flags = (rows_covered, probs_TK.dtype)
        return _weighted_k_sum(y_RD, pos_TK, w_TK)

    @staticmethod
    def backward(ctx, g_TD: Tensor):
        y_RD, w_TK, asg_R = ctx.saved_tensors
        if ctx.fused:
            grad_y, grad_p = kernels.unpermute_backward(g_TD, y_RD, w_TK, asg_R, *ctx.needs_input_grad[:2])
            return grad_y, grad_p, None, None, None, None
        rows_covered, probs_dtype = ctx.flags
        T, k = w_TK.shape
        R = y_RD.shape[0]
        g_RD = _with_zero_row(g_TD.contiguous(), rows_covered).index_select(
            0, _rows_to_tokens(asg_R, k, rows_covered, T)
        )
        asg_c = asg_R if rows_covered else asg_R.clamp(min=0)
        w_R = w_TK.reshape(-1).index_select(0, asg_c) if T * k else w_TK.new_zeros(R)
        if not rows_covered:
            w_R = torch.where(asg_R < 0, torch.zeros_like(w_R), w_R)
        grad_y = grad_p = None
        if ctx.needs_input_grad[0]:
            grad_y = g_RD * w_R.to(g_RD.dtype).unsqueeze(1)
        if ctx.needs_input_grad[1]:
            p_R = (y_RD.to(g_RD.dtype) * g_RD).sum(-1, dtype=torch.float32)
            if rows_covered:
                grad_p = p_R.new_zeros(T * k).index_copy_(0, asg_R, p_R)
            else:  # padding rows land on a sentinel, cut off
                grad_p = p_R.new_zeros(T * k + 1).index_copy_(0, torch.where(asg_R < 0, T * k, asg_R), p_R)[: T * k]
            grad_p = grad_p.view(T, k).to(probs_dtype)
        return grad_y, grad_p, None, None, None, None


class _SumRows(torch.autograd.Function):
    """out[t] = sum_k y[pos_TK[t, k]] over pos >= 0 (the combine when the experts applied the weights); backward
    grad_y[r] = g[token of r] (padding rows: 0), a gather: nothing of y is kept."""

    @staticmethod
    def forward(ctx, y_RD: Tensor, pos_TK: Tensor, asg_R: Tensor, has_dropped: bool, rows_covered: bool) -> Tensor:
        ctx.save_for_backward(asg_R)
        ctx.flags = (pos_TK.shape, rows_covered)
        ctx.fused = kernels.use_triton(y_RD)
        if ctx.fused:
            return kernels.k_sum(y_RD, pos_TK)
        mask = (pos_TK >= 0).to(y_RD.dtype) if has_dropped else None
        return _weighted_k_sum(y_RD, pos_TK, mask)

    @staticmethod
    def backward(ctx, g_TD: Tensor):
        (asg_R,) = ctx.saved_tensors
        (T, k), rows_covered = ctx.flags
        if ctx.fused:
            grad_y = kernels.gather_rows(g_TD, asg_R, k)
        else:
            grad_y = _with_zero_row(g_TD.contiguous(), rows_covered).index_select(
                0, _rows_to_tokens(asg_R, k, rows_covered, T))
        return grad_y, None, None, None, None


class _RowProbs(torch.autograd.Function):
    """p_R[r] = probs[asg_R[r]] (0 for padding rows, asg -1); backward grad_probs[t, k] = g[pos_TK[t, k]] (0 where
    pos < 0): gathers both ways, no scatter."""

    @staticmethod
    def forward(ctx, probs_TK: Tensor, asg_R: Tensor, pos_TK: Tensor) -> Tensor:
        ctx.save_for_backward(pos_TK)
        flat = probs_TK.reshape(-1)
        if flat.numel() == 0:
            return probs_TK.new_zeros(asg_R.shape[0])
        return torch.where(asg_R >= 0, flat.index_select(0, asg_R.clamp(min=0)), flat.new_zeros(()))

    @staticmethod
    def backward(ctx, g_R: Tensor):
        (pos_TK,) = ctx.saved_tensors
        if g_R.numel() == 0:
            return g_R.new_zeros(pos_TK.shape), None, None
        picked = g_R.index_select(0, pos_TK.clamp(min=0).reshape(-1)).view(pos_TK.shape)
        return torch.where(pos_TK >= 0, picked, picked.new_zeros(())), None, None


class _Reindex(torch.autograd.Function):
    """out = x[index] with backward grad_x = grad[inverse]: for index maps that hit each row at most once (rows of
    x no index reaches get an arbitrary row's gradient: callers only use this where such rows are cut off)."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, index_R: Tensor, inverse_A: Tensor) -> Tensor:
        ctx.save_for_backward(inverse_A)
        return x_ND.index_select(0, index_R)

    @staticmethod
    def backward(ctx, g_RD: Tensor):
        (inverse_A,) = ctx.saved_tensors
        return g_RD.contiguous().index_select(0, inverse_A), None, None
