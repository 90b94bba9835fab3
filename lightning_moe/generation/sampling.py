"""The next token from logits: greedy, or temperature / top-k / top-p (nucleus) sampling."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def _check_sampling(temperature: float, top_p: float, top_k: Optional[int]) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")


def sample_next_token(logits_BV: Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: Optional[int] = None,
                      generator: Optional[torch.Generator] = None) -> Tensor:
    """Next token ids [B] from logits [B, V]: argmax when ``temperature == 0``; otherwise sample from
    softmax(logits / temperature) restricted to the ``top_k`` most likely tokens and to the smallest set of most
    likely tokens whose probability reaches ``top_p`` (nucleus; the most likely token always stays)."""
    _check_sampling(temperature, top_p, top_k)
    logits_BV = logits_BV.float()
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_BV = (probs_BV.cumsum(dim=-1) - probs_BV) >= top_p
        drop_BV[:, 0] = False
        logits_BV = logits_BV.masked_fill(drop_BV.scatter(1, order_BV, drop_BV), float("-inf"))
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
