"""The datasets behind TextDataModule: packed token streams cut into rows, and chat rows with their own targets."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from lightning_moe.data.collate import IGNORE_INDEX
from lightning_moe.data.tokenizer import ByteTokenizer


class _Samples(Dataset):
    """``num_samples`` samples numbered from ``first`` in some storage: length and index checks."""

    first: int
    num_samples: int

    def __len__(self) -> int:
        return self.num_samples

    def _sample(self, index: int) -> int:
        """The storage number of item ``index`` (negative indices count from the end)."""
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return self.first + index


class PackedDataset(_Samples):
    """``num_samples`` windows of a flat token stream; item ``i`` starts at ``first * seq_len + i * seq_len``.

    Items are ``{"input_ids": LongTensor[S], "labels": LongTensor[S]}`` with ``labels`` the inputs
    shifted by one token. With ``positions`` (the stream's per-document positions, :func:`document_positions`)
    items also hold ``position_ids`` (restarting at the window's start too) and -100 at documents' last tokens.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, first: int, num_samples: int,
                 positions: Optional[torch.Tensor] = None) -> None:
        if (first + num_samples) * seq_len + 1 > tokens.numel() and num_samples > 0:
            raise ValueError("PackedDataset: the token stream is too short for the requested samples")
        self.tokens = tokens
        self.seq_len = seq_len
        self.first = first
        self.num_samples = num_samples
        self.positions = positions

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self._sample(index) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        if self.positions is None:
            return {"input_ids": window[:-1], "labels": window[1:]}
        # a document begun in the previous window restarts at 0 here (RoPE positions stay below seq_len)
        pos = torch.minimum(self.positions[start : start + self.seq_len + 1].long(), torch.arange(self.seq_len + 1))
        labels = window[1:].masked_fill(pos[1:] == 0, IGNORE_INDEX)  # nothing predicts the next document
        return {"input_ids": window[:-1], "labels": labels, "position_ids": pos[:-1]}


def document_positions(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """int32 position of every token of a packed stream inside its document (0 after every EOS)."""
    idx = torch.arange(tokens.numel(), dtype=torch.int64)
    start = torch.zeros_like(tokens, dtype=torch.bool)
    start[1:] = tokens[:-1] == eos_id
    first = torch.cummax(torch.where(start, idx, 0), dim=0).values
    return (idx - first).to(torch.int32)


class RowsDataset(_Samples):
    """Rows ``first .. first + num_samples`` of ready-made [N, S] tensors (chat data): item ``i`` is every tensor's
    row ``first + i``."""

    def __init__(self, rows: dict[str, torch.Tensor], first: int, num_samples: int) -> None:
        self.rows, self.first, self.num_samples = rows, first, num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self._sample(index)
        return {k: v[row] for k, v in self.rows.items()}


def pack_documents(docs: list[str], tokenizer: Any, eos_id: int, max_tokens: Optional[int] = None) -> torch.Tensor:
    """Tokenise ``docs`` and concatenate them into one int32 stream, an EOS after every document.

    Stops early once ``max_tokens`` tokens are collected and cuts the stream to that length.
    """
    eos = torch.tensor([eos_id], dtype=torch.int32)
    pieces: list[torch.Tensor] = []
    count = 0
    for doc in docs:
        if isinstance(tokenizer, ByteTokenizer):
            ids = tokenizer.encode_tensor(doc)
        else:
            ids = torch.tensor(tokenizer.encode(doc, add_special_tokens=False), dtype=torch.int32)
        pieces.append(ids)
        pieces.append(eos)
        count += ids.numel() + 1
        if max_tokens is not None and count >= max_tokens:
            break
    if not pieces:
        return torch.empty(0, dtype=torch.int32)
    tokens = torch.cat(pieces)
    if max_tokens is not None:
        tokens = tokens[:max_tokens].clone()
    return tokens
