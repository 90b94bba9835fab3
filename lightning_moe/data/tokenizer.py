"""Tokenizers for :mod:`lightning_moe.data`.

``ByteTokenizer`` is the default: UTF-8 bytes are token ids 0..255, followed by a few special tokens.
It needs no files, so it works offline on every machine, and its vocabulary (260) matches the ``tiny``
model preset.

A Hugging Face tokenizer can be used instead through :func:`load_hf_tokenizer`, which only ever reads a
local directory (``local_files_only=True``) and imports ``transformers`` lazily.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch

__all__ = ["ByteTokenizer", "load_hf_tokenizer"]


class ByteTokenizer:
    """UTF-8 byte tokenizer with special tokens.

    Ids ``0..255`` are the bytes of the UTF-8 encoding, ``256`` is BOS, ``257`` is EOS (end of document),
    ``258`` is PAD, ``259`` is reserved; ``vocab_size`` is 260.
    """

    BOS = 256
    EOS = 257
    PAD = 258
    RESERVED = 259
    VOCAB_SIZE = 260

    bos_id = BOS
    eos_id = EOS
    pad_id = PAD

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    def __len__(self) -> int:
        return self.VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids, optionally framed by BOS / EOS."""
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.BOS)
        if add_eos:
            ids.append(self.EOS)
        return ids

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Fast path of :meth:`encode`: a 1-D int32 tensor of the UTF-8 bytes (no specials)."""
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.int32)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Bytes back to text; special ids (>= 256) are skipped, invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.VOCAB_SIZE}, bos={self.BOS}, eos={self.EOS}, pad={self.PAD})"


def load_hf_tokenizer(path: str) -> Any:
    """Load a Hugging Face tokenizer from a *local* directory; never downloads.

    Raises ``ValueError`` if ``path`` is not an existing directory and ``ImportError`` if ``transformers``
    is not installed.
    """
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise ValueError(
            f"tokenizer directory {path!r} does not exist. Set `tokenizer` to a local Hugging Face tokenizer "
            "directory (one holding tokenizer.json / tokenizer_config.json; nothing is downloaded), "
            "or to null for the built-in byte tokenizer."
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ImportError(
            f"`tokenizer={path!r}` needs the `transformers` package, which is not installed. Install it with "
            "`pip install 'lightning_moe[hf]'` (or `pip install transformers`), or set `tokenizer` to null "
            "for the built-in byte tokenizer."
        ) from err
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"could not load a Hugging Face tokenizer from the local directory {path!r}: {err}. "
            "It should hold the files saved by `tokenizer.save_pretrained(...)`."
        ) from err
