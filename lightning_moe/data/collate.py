"""Batch checks and collation: what reaches the model is valid for it, or a ValueError that names the limit.

Batches follow the Hugging Face convention: ``input_ids`` [B, S] (integers), optional ``labels`` [B, S] (-100 =
ignore) and optional ``attention_mask`` [B, S] (1 = token, 0 = padding; bool, integer or float).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["IGNORE_INDEX", "collate", "validate_batch"]

IGNORE_INDEX = -100


def _check_ids(name: str, ids: torch.Tensor, vocab_size: Optional[int], allow_ignore: bool) -> None:
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    valid = ids[ids != IGNORE_INDEX] if allow_ignore else ids
    if valid.numel() == 0:
        return
    low, high = int(valid.min()), int(valid.max())
    if low < 0:
        extra = " (or -100 to ignore a position)" if allow_ignore else ""
        raise ValueError(f"{name} holds the negative token id {low}; token ids must be in [0, vocab_size){extra}")
    if vocab_size is not None and high >= vocab_size:
        raise ValueError(
            f"{name} holds token id {high} >= vocab_size={vocab_size} (the model's embedding size): use a tokenizer "
            f"whose ids fit, or set model.config.vocab_size >= {high + 1}"
        )


def validate_batch(batch: dict[str, Any], vocab_size: Optional[int] = None,
                   max_seq_len: Optional[int] = None) -> dict[str, Any]:
    """Checks a batch against the model's limits and returns it unchanged.

    Raises ValueError for: ``input_ids`` that are not integer [B, S] with B, S > 0; sequences longer than ``max_seq_len``;
    token ids < 0 or >= ``vocab_size`` (``labels`` may also hold -100); ``labels`` / ``attention_mask`` of another
    shape; an ``attention_mask`` holding anything but 0 and 1 (NaN included: padding masks, not additive masks).
    """
    if "input_ids" not in batch:
        raise ValueError(f"a batch needs 'input_ids'; got the keys {sorted(batch)}")
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be a [batch, seq_len] tensor, got {shape}")
    if ids.numel() == 0:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}: a batch needs at least one sequence of at least "
                         "one token")
    seq_len = ids.shape[1]
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(
            f"sequences of {seq_len} tokens exceed the model's max_seq_len={max_seq_len}: lower data.seq_len (or cut "
            f"the sequences) to <= {max_seq_len}, or raise model.config.max_seq_len"
        )
    _check_ids("input_ids", ids, vocab_size, allow_ignore=False)
    labels = batch.get("labels")
    if labels is not None:
        if labels.shape != ids.shape:
            raise ValueError(f"labels have shape {tuple(labels.shape)}, input_ids {tuple(ids.shape)}: they must match")
        _check_ids("labels", labels, vocab_size, allow_ignore=True)
    mask = batch.get("attention_mask")
    if mask is not None:
        if mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}: they must match"
            )
        if mask.is_floating_point() and bool(torch.isnan(mask).any()):
            raise ValueError("attention_mask holds NaN; it must hold 1 for tokens and 0 for padding")
        if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
            bad = mask[(mask != 0) & (mask != 1)].flatten()[0].item()
            raise ValueError(
                f"attention_mask holds {bad}; it must hold 1 for tokens and 0 for padding (a padding mask, not an "
                "additive -inf mask)"
            )
    return batch


def collate(samples: Sequence[dict[str, torch.Tensor]], vocab_size: Optional[int] = None,
            max_seq_len: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Stack a list of samples (dicts of equal-length 1-D tensors) into a batch and :func:`validate_batch` it.

    Use it as a DataLoader's ``collate_fn`` (``functools.partial(collate, vocab_size=..., max_seq_len=...)``) for
    datasets of your own."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    keys = list(samples[0])
    batch = {}
    for key in keys:
        values = [s[key] for s in samples]
        lengths = {tuple(v.shape) for v in values}
        if len(lengths) > 1:
            raise ValueError(
                f"samples have {key} of different shapes {sorted(lengths)}: pad them to one length (labels with -100, "
                "attention_mask with 0) or pack them, as TextDataModule does"
            )
        batch[key] = torch.stack(values)
    return validate_batch(batch, vocab_size, max_seq_len)
