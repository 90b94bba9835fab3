"""Attention heads' key/value layout shared by the attention kernels (models/transformer.py, models/document_mask.py,
parallel/context_parallel.py); a leaf, so the kernels need not import the model."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["expand_kv"]


def expand_kv(num_heads: int, k_BGSK: Tensor, v_BGSV: Tensor,
              k_shared_B1SP: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Keys and values for every query head: GQA's G kv heads repeated to ``num_heads``, and a key part shared by
    every head (MLA's decoupled RoPE key [B, 1, S, P]) appended to each head's key. Done after any gather, so
    context parallelism moves G heads and one shared part instead of ``num_heads`` copies."""
    rep = num_heads // k_BGSK.shape[1]
    assert rep * k_BGSK.shape[1] == num_heads and v_BGSV.shape[1] == k_BGSK.shape[1], "kv heads must divide q heads"
    if rep > 1:
        k_BGSK, v_BGSV = k_BGSK.repeat_interleave(rep, dim=1), v_BGSV.repeat_interleave(rep, dim=1)
    if k_shared_B1SP is not None:
        k_BGSK = torch.cat([k_BGSK, k_shared_B1SP.expand(-1, num_heads, -1, -1)], dim=-1)
    return k_BGSK, v_BGSV
