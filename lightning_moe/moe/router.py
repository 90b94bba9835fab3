"""Top-k router: fp32 gate GEMM and all routing math (Megatron-Core moe_utils semantics).

Legend: T tokens, D hidden, E experts, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class RoutingResult:
    """What the router decided for T tokens.

    probs: [T, k] fp32 combine weights (zero for dropped and padding assignments).
    expert_ids: [T, k] int64 chosen experts.
    tokens_per_expert: [E] int64 kept assignments per expert on this rank (after capacity, padding excluded).
    aux_loss, z_loss: fp32 scalars, coefficient applied, zero when disabled.
    keep_mask: [T, k] bool, False for assignments dropped by capacity or belonging to padding tokens;
        None when every assignment is kept.
    capacity: per-expert capacity in capacity mode, else None.
    num_dropped: int64 scalar, assignments of valid tokens dropped by capacity.
    scores: [T, E] fp32 normalised scores over all experts (monitoring; no bias).
    """

    probs: Tensor
    expert_ids: Tensor
    tokens_per_expert: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    keep_mask: Optional[Tensor] = None
    capacity: Optional[int] = None
    num_dropped: Optional[Tensor] = None
    scores: Optional[Tensor] = None
