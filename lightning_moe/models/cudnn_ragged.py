"""Block-causal attention over packed documents with cuDNN's ragged (``cu_seqlens``) flash attention.

On the H200 (torch 2.11, cuDNN 9) cuDNN's fused attention is the fastest causal kernel SDPA has: 4.45 ms against
flash attention's 7.2 ms (``varlen_attn``'s kernel) for a [4 x 4096, 32 heads, 128] forward + backward
(``bench/results/attn_micro_h200.json``). Its ragged mode runs causal attention over every segment of the flattened
[T] tokens at once: what document masking needs, at that speed, with q/k and v head dims that may differ (MLA).

No public torch API reaches it: ``varlen_attn`` has a cuDNN branch that is switched off (torch 2.11 to 2.13), and
nested-tensor SDPA refuses ``is_causal``. So this module calls the ATen op ``_cudnn_attention_forward`` (the one nested-tensor SDPA
uses; its registered derivative runs ``_cudnn_attention_backward``); the benchmark's kernel checks and ``tests/test_cudnn_ragged.py`` compare it with the SDPA reference. Opt in with
``attn_impl="cudnn"``.

Legend: T flattened tokens, H heads (k/v repeated to H: cuDNN's ragged mode takes no GQA), K q/k head dim, V v head
dim, N segments.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["cudnn_ragged_attention"]


def _forward_op():
    """The ATen op (one seam, so a CPU test can stand in a reference for it). It is differentiable: ATen's own
    derivative calls ``_cudnn_attention_backward`` with the forward's saved output, logsumexp and segments."""
    return torch.ops.aten._cudnn_attention_forward


def cudnn_ragged_attention(q_THK: Tensor, k_THK: Tensor, v_THV: Tensor, cu_seqlens_N1: Tensor, max_len: int,
                           scale: Optional[float] = None) -> Tensor:
    """o [T, H, V]: causal attention inside each segment ``cu_seqlens_N1[i]:cu_seqlens_N1[i + 1]`` of the flattened
    tokens (int32 boundaries, ``max_len`` the longest); q, k and v with H heads each (repeat GQA's first)."""
    assert q_THK.shape[:2] == k_THK.shape[:2] == v_THV.shape[:2], "q, k and v need T and H alike"
    out = _forward_op()(q_THK.contiguous(), k_THK.contiguous(), v_THV.contiguous(), None, cu_seqlens_N1,
                        cu_seqlens_N1, int(max_len), int(max_len), True, 0.0, True, False, scale=scale)
    return out[0]
