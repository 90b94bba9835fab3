"""Batch checks and collation: what reaches the model is valid for it, or a ValueError that names the limit.

Batches follow the Hugging Face convention: ``input_ids`` [B, S] (integers), optional ``labels`` [B, S] (-100 =
ignore), optional ``attention_mask`` [B, S] (1 = token, 0 = padding; bool, integer or float) and optional
``position_ids`` [B, S] (packed documents: 0 at each document start, +1 per token inside one). One difference:
our ``labels`` are pre-shifted (``labels[t]`` is the token after ``input_ids[t]``), while Hugging Face models shift
inside the loss; unshifted labels (every valid label equal to its own input, as ``DataCollatorWithFlattening``
writes) are refused rather than trained off by one. Packed batches from :func:`collate` also carry
``document_segments`` (:class:`~lightning_moe.models.document_mask.DocumentSegments`): the documents' structure computed
here on the CPU, so the model's forward needs no host sync to find it.
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
    token ids < 0 or >= ``vocab_size`` (``labels`` may also hold -100); ``labels`` / ``attention_mask`` /
    ``position_ids`` of another shape; an ``attention_mask`` holding anything but 0 and 1 (NaN included: padding
    masks, not additive masks); ``labels`` in the unshifted convention; ``position_ids`` that are negative, reach
    ``max_seq_len``, or neither restart at 0 nor count up by one.
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
        _check_label_convention(ids, labels)
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
    positions = batch.get("position_ids")
    if positions is not None:
        _check_position_ids(positions, ids, max_seq_len)
    segments = batch.get("document_segments")
    if segments is not None:
        from lightning_moe.models.document_mask import check_document_segments

        if positions is None:
            raise ValueError("batch['document_segments'] describe packed documents: the batch needs their "
                             "position_ids too")
        check_document_segments(segments, positions, mask)
    return batch


def _check_label_convention(ids: torch.Tensor, labels: torch.Tensor) -> None:
    valid = labels != IGNORE_INDEX
    if int(valid.sum()) > 1 and bool((labels[valid] == ids[valid]).all()):
        raise ValueError(
            "every label equals its own input token: these are Hugging Face's unshifted labels (as "
            "DataCollatorWithFlattening writes), but lightning_moe's labels are pre-shifted (labels[t] is the token "
            "after input_ids[t]). Leave `labels` out (the module shifts input_ids and masks document ends), or shift "
            "them: labels[:, :-1] = hf_labels[:, 1:] and labels[:, -1] = -100"
        )


def _check_position_ids(positions: torch.Tensor, ids: torch.Tensor, max_seq_len: Optional[int]) -> None:
    if tuple(positions.shape) != tuple(ids.shape):
        raise ValueError(f"position_ids have shape {tuple(positions.shape)}, input_ids {tuple(ids.shape)}: they must "
                         "match ([batch, seq_len] per-document positions of packed sequences)")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"position_ids must hold integers, got dtype {positions.dtype}")
    if positions.numel() == 0:
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0:
        raise ValueError(f"position_ids hold {low}; positions must be >= 0 (0 starts a document)")
    if max_seq_len is not None and high >= max_seq_len:
        raise ValueError(f"position_ids hold {high} >= the model's max_seq_len={max_seq_len} (its RoPE table): restart "
                         "positions at 0 at each document start, or raise model.config.max_seq_len")
    step = positions[:, 1:] - positions[:, :-1]
    bad = (positions[:, 1:] != 0) & (step != 1)
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"position_ids[{b}] goes from {int(positions[b, t])} to {int(positions[b, t + 1])} at index {t + 1}: "
            "packed positions must restart at 0 at a document start and count up by one inside a document"
        )


def collate(samples: Sequence[dict[str, torch.Tensor]], vocab_size: Optional[int] = None,
            max_seq_len: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Stack a list of samples (dicts of equal-length 1-D tensors) into a batch and :func:`validate_batch` it.
    Samples with ``position_ids`` (packed documents) also get the batch's ``document_segments``.

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
    batch = validate_batch(batch, vocab_size, max_seq_len)
    if "position_ids" in batch:
        from lightning_moe.models.document_mask import document_segments

        batch["document_segments"] = document_segments(batch["position_ids"], batch.get("attention_mask"))
    return batch
