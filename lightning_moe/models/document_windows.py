"""Document-masked attention through the plain causal kernel, once per document (``attn_impl="split"``).

Block-causal attention over packed documents is, document by document, ordinary causal attention. This kernel runs
``scaled_dot_product_attention(is_causal=True)`` (on Hopper: cuDNN's fused attention, the kernel unpacked training
runs) once per document, on a *window* of the flattened [B * S] tokens that starts at the document's first token:

* A window may run past its document into the tokens after it (the next document, the next row): under the causal
  mask the document's own queries never see those keys, so its rows are exact; the extra rows are computed and
  dropped, and their gradients are exactly zero (their output gradient is zero). So each window is rounded up to
  one of a few *bucket* lengths (:func:`window_length`: a step of 1/16 of the length's power of two, at least 128,
  capped at S): the cuDNN plan cache sees a few dozen shapes instead of one per document length. Only a window that
  would run past the last token is copied into a zero-padded buffer.
* One-token segments (padding, a one-token document) attend only themselves: their output is their value row, with
  no kernel call.
* The plans of every bucket length up to S are built once, on the first packed batch of a new shape
  (:func:`warm_window_plans`), so later steps build none (cuDNN builds a plan per new shape; one costs tens of ms).

With gradients, :class:`_WindowedCausal` keeps each window's own autograd graph (views of the inputs, no copies) and
writes every window's rows of the input gradients into one buffer: slicing overlapping windows out of the inputs
directly would make autograd add a zero-filled full-size gradient per window. The costs of that: each window's
output is kept for its backward beside the assembled output (one extra attention output per layer), and what the
windows save bypasses saved-tensor hooks, so recomputation (``attn_core``, ``full``) and activation offload leave the
attention's saved tensors on the GPU (correct, but without their memory saving). ``attn_impl="auto"`` therefore
takes the windows only for models that neither recompute nor offload, and per batch (:func:`prefer_windows`) only for
few, long documents, where the fast kernel wins; many short ones go to varlen / flex, where one call per document
would cost more on the host than it saves on the GPU.

Legend: T = B * S flattened tokens, H query heads, G kv heads (G divides H), K q/k head dim, V v head dim,
W window length, N segments.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["WindowPlan", "prefer_windows", "warm_window_plans", "window_length", "window_lengths", "windowed_causal"]

log = logging.getLogger(__name__)

MIN_STEP = 128  # the bucket step of short windows (cuDNN's tile along the sequence is 64 or 128)
STEPS_PER_OCTAVE = 16  # longer windows step by 1/16 of their power of two: <= 6% longer than their document
# "auto" takes the windows when the batch's documents average at least this many tokens and are at most MAX_WINDOWS
# (per call: ~0.1-0.3 ms of host work, hidden behind the GPU's work only for long documents)
MIN_MEAN_LENGTH = 1024
MAX_WINDOWS = 64


def window_length(n: int, seq_len: int) -> int:
    """The bucket length of the window of an ``n``-token document in rows of ``seq_len`` tokens."""
    assert 1 <= n <= seq_len, (n, seq_len)
    step = max(MIN_STEP, (1 << (n.bit_length() - 1)) // STEPS_PER_OCTAVE)
    return min(-(-n // step) * step, seq_len)


@functools.cache
def window_lengths(seq_len: int) -> tuple[int, ...]:
    """Every bucket length a document of 2..seq_len tokens can get (the shapes the kernel will meet)."""
    return tuple(sorted({window_length(n, seq_len) for n in range(2, seq_len + 1)}))


class WindowPlan(NamedTuple):
    """Host-side plan of one packed batch: ``windows`` (start, document length, window length) of every segment of
    two or more tokens, ``singles`` the (start, end) runs of one-token segments; together they cover [0, T)."""

    windows: tuple[tuple[int, int, int], ...]
    singles: tuple[tuple[int, int], ...]
    total: int

    @classmethod
    def from_lengths(cls, lengths: list[int], seq_len: int) -> "WindowPlan":
        """The plan of segments of ``lengths`` tokens (in order; each inside one row of ``seq_len``)."""
        windows, singles = [], []
        start = 0
        for n in lengths:
            if n < 1 or n > seq_len:
                raise ValueError(f"a segment of {n} tokens cannot lie in a row of {seq_len}")
            if n == 1:
                if singles and singles[-1][1] == start:
                    singles[-1] = (singles[-1][0], start + 1)
                else:
                    singles.append((start, start + 1))
            else:
                windows.append((start, n, window_length(n, seq_len)))
            start += n
        return cls(tuple(windows), tuple(singles), start)


def prefer_windows(lengths: list[int]) -> bool:
    """Whether the windows beat one varlen / flex call on segments of ``lengths`` (the "auto" choice)."""
    real = [n for n in lengths if n > 1]
    return bool(real) and len(real) <= MAX_WINDOWS and sum(real) >= MIN_MEAN_LENGTH * len(real)


def _window(x_THD: Tensor, start: int, w: int) -> Tensor:
    """Rows [start, start + w) of ``x_THD``: a view, or a zero-padded copy where they run past the end."""
    T = x_THD.shape[0]
    if start + w <= T:
        return x_THD[start:start + w]
    return F.pad(x_THD[start:], (0, 0, 0, 0, 0, start + w - T))


def _sdpa_window(q_WHK: Tensor, k_WGK: Tensor, v_WGV: Tensor, scale: Optional[float]) -> Tensor:
    """Causal attention of one window: o [1, H, W, V], in the [1, W, H, *] layout unpacked training hands over; k/v
    with fewer heads (GQA) through the kernel's own grouping (no repeated copies)."""
    return F.scaled_dot_product_attention(q_WHK.unsqueeze(0).transpose(1, 2), k_WGK.unsqueeze(0).transpose(1, 2),
                                          v_WGV.unsqueeze(0).transpose(1, 2), is_causal=True, scale=scale,
                                          enable_gqa=k_WGK.shape[1] != q_WHK.shape[1])


def _heads(v_NGV: Tensor, heads: int) -> Tensor:
    """The kv heads' rows for every query head (GQA: head h reads kv head h // (heads / G))."""
    return v_NGV if v_NGV.shape[1] == heads else v_NGV.repeat_interleave(heads // v_NGV.shape[1], dim=1)


def _keep(t: Tensor) -> Tensor:
    return t


class _WindowedCausal(torch.autograd.Function):
    """The windows with gradients: each window's graph kept in ``ctx`` and run by ``torch.autograd.grad``."""

    @staticmethod
    def forward(ctx, q_THK: Tensor, k_TGK: Tensor, v_TGV: Tensor, plan: WindowPlan,  # type: ignore[override]
                scale: Optional[float]) -> Tensor:
        T, H, _ = q_THK.shape
        o_THV = q_THK.new_empty(T, H, v_TGV.shape[2])
        q, k, v = q_THK.detach(), k_TGK.detach(), v_TGV.detach()
        graphs = []
        for start, n, w in plan.windows:
            # the windows' graphs are held here, so the saved-tensor hooks around the call (recomputation, offload)
            # must not take what they save: a checkpoint would re-run its region once per window's backward
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                leaves = [_window(x, start, w).requires_grad_() for x in (q, k, v)]
                o_1HWV = _sdpa_window(*leaves, scale)
            o_THV[start:start + n] = o_1HWV[0, :, :n].transpose(0, 1)
            graphs.append((leaves, o_1HWV))
        for a, b in plan.singles:
            o_THV[a:b] = _heads(v[a:b], H)
        ctx.graphs, ctx.plan = graphs, plan
        ctx.shapes = (q_THK.shape, k_TGK.shape, v_TGV.shape)
        return o_THV

    @staticmethod
    def backward(ctx, do_THV: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        q_shape, k_shape, v_shape = ctx.shapes
        dq_THK = do_THV.new_empty(q_shape)
        dk_TGK = do_THV.new_empty(k_shape)
        dv_TGV = do_THV.new_empty(v_shape)
        graphs, ctx.graphs = ctx.graphs, None
        for (start, n, w), (leaves, o_1HWV) in zip(ctx.plan.windows, graphs):
            do_1HWV = do_THV[start:start + n].unsqueeze(0).transpose(1, 2)
            if w != n or do_1HWV.stride() != o_1HWV.stride():
                # the extra rows' output gradient is zero; the output's strides (cuDNN's backward takes it as is)
                do_1HWV = torch.zeros_like(o_1HWV)
                do_1HWV[0, :, :n] = do_THV[start:start + n].transpose(0, 1)
            dq, dk, dv = torch.autograd.grad(o_1HWV, leaves, do_1HWV)
            dq_THK[start:start + n], dk_TGK[start:start + n], dv_TGV[start:start + n] = dq[:n], dk[:n], dv[:n]
        for a, b in ctx.plan.singles:  # o = v there (each kv head serving its group of query heads)
            dq_THK[a:b], dk_TGK[a:b] = 0, 0
            G = v_shape[1]
            dv_TGV[a:b] = do_THV[a:b].unflatten(1, (G, -1)).sum(2)
        return dq_THK, dk_TGK, dv_TGV, None, None


@torch.compiler.disable  # a Python loop over the batch's windows: eager (a graph break under torch.compile)
def windowed_causal(q_THK: Tensor, k_TGK: Tensor, v_TGV: Tensor, plan: WindowPlan,
                    scale: Optional[float]) -> Tensor:
    """o [T, H, V]: causal attention within each segment of ``plan`` (k and v with G heads, G dividing H)."""
    assert q_THK.shape[0] == plan.total, "the plan describes another batch"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_THK, k_TGK, v_TGV)):
        return _WindowedCausal.apply(q_THK, k_TGK, v_TGV, plan, scale)
    o_THV = q_THK.new_empty(*q_THK.shape[:2], v_TGV.shape[2])
    for start, n, w in plan.windows:
        o_1HWV = _sdpa_window(*(_window(x, start, w) for x in (q_THK, k_TGK, v_TGV)), scale)
        o_THV[start:start + n] = o_1HWV[0, :, :n].transpose(0, 1)
    for a, b in plan.singles:
        o_THV[a:b] = _heads(v_TGV[a:b], q_THK.shape[1])
    return o_THV


_WARMED: set[tuple] = set()


@torch.compiler.disable  # runs kernels once per shape: never traced into a compiled region
def warm_window_plans(seq_len: int, heads: int, kv_heads: int, qk_dim: int, v_dim: int, dtype: torch.dtype,
                      device: torch.device, scale: Optional[float], backward: bool) -> None:
    """Run every bucket window of ``seq_len`` once (forward, and backward if ``backward``) so that the kernel's
    per-shape plans (cuDNN's) exist before the timed steps; once per shape and process, CUDA only."""
    key = (seq_len, heads, kv_heads, qk_dim, v_dim, dtype, device, scale, backward)
    if device.type != "cuda" or key in _WARMED:
        return
    _WARMED.add(key)
    t0 = time.perf_counter()
    lengths = window_lengths(seq_len)
    with torch.enable_grad() if backward else torch.no_grad():
        for w in lengths:
            q = torch.zeros(w, heads, qk_dim, dtype=dtype, device=device, requires_grad=backward)
            k = torch.zeros(w, kv_heads, qk_dim, dtype=dtype, device=device, requires_grad=backward)
            v = torch.zeros(w, kv_heads, v_dim, dtype=dtype, device=device, requires_grad=backward)
            o = _sdpa_window(q, k, v, scale)
            if backward:
                torch.autograd.grad(o, (q, k, v), torch.zeros_like(o))
    torch.cuda.synchronize(device)
    log.info("attn_impl='split': ran the %d window lengths of seq_len %d once (%s, %d heads) in %.1f s",
             len(lengths), seq_len, "forward + backward" if backward else "forward", heads, time.perf_counter() - t0)
