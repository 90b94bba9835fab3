"""``TextDataModule``: packed next-token-prediction batches for :mod:`lightning_moe`.

Packing
    Documents are tokenised without special tokens, each is followed by one EOS token (so an EOS sits
    between every two documents, and after the last), and everything is concatenated into one flat int32
    token stream ``t`` (cut to ``max_tokens`` if given). Sample ``i`` is the window of ``seq_len + 1``
    tokens starting at ``i * seq_len``::

        input_ids = t[i*S     : (i+1)*S]
        labels    = t[i*S + 1 : (i+1)*S + 1]      # input_ids shifted left by one

    so every position has a label, consecutive samples share exactly one token (the last label of sample
    ``i`` is the first input of sample ``i + 1``) and no token is wasted. Samples never contain padding,
    so there is no ``attention_mask`` and no ``-100`` label (the Hugging Face ignore index the loss honours).
    Attention crosses document boundaries inside a sample, as usual for packed pre-training data, unless
    ``document_mask=True``: samples then also carry ``position_ids`` that restart at 0 at every document start
    (and at the sample's start, for the piece of a document the previous sample began), so attention stays inside
    each document (:mod:`lightning_moe.models.document_mask`), and the label of each document's last token (its
    EOS, which would predict the next document's first token) is -100.

Chat data (``format="chat"``)
    JSON Lines conversations (``messages``, or ``prompt`` / ``completion``) rendered with the chat template of
    ``tokenizer``, loss on the assistant's tokens, several conversations to a row with ``position_ids`` restarting
    per conversation and padding after the last (:mod:`lightning_moe.data.chat`). Samples are those rows; the
    split, sampling and resume below work on them as on text windows.

Train / validation split
    A contiguous tail of the sample sequence: with ``n = (len(t) - 1) // seq_len`` samples,
    the last ``ceil(n * val_fraction)`` are validation samples and the rest are training samples. This
    depends only on the corpus, the tokenizer, ``seq_len``, ``max_tokens`` and ``val_fraction``; never on
    the world size, the rank or the seed. Train and validation windows are disjoint (they touch in one
    label token at the boundary).

Sampling
    Lightning swaps a training DataLoader's sampler for ``DistributedSampler(shuffle=True)`` over the
    strategy's ``distributed_sampler_kwargs`` unless the loader already holds a ``DistributedSampler``.
    So both loaders *always* use our own :class:`ResumableDistributedSampler` (a ``DistributedSampler``
    subclass; also on one process), built over the *batch view* of the strategy: ranks that must see the
    same samples (tensor- / context- / expert-parallel peers) share a batch-view rank. The view is
    ``set_batch_view(num_replicas, rank)`` if that was called, else ``trainer.strategy.distributed_sampler_kwargs``
    of an attached trainer, else (1, 0). Lightning calls ``sampler.set_epoch(epoch)`` each epoch, so the
    shuffle order (``seed + epoch``) is the same on every rank and every run.

Global batch
    ``batch_size`` is per batch-view (data-parallel) rank and per micro-batch: one optimizer step reads
    ``batch_size x num_replicas x accumulate_grad_batches`` samples (the *global batch*). Each epoch has one
    global order of the training samples (the seeded permutation, cut to a multiple of ``num_replicas``);
    rank ``r`` reads positions ``r, r + R, r + 2R, ...`` of it, so the ``k``-th micro-batches of all ranks
    together are positions ``[k*b*R, (k+1)*b*R)``: the same samples under every layout with the same
    ``b*R``. ``global_batch_size`` derives ``batch_size`` from the layout and the trainer's
    ``accumulate_grad_batches``, so a change of layout keeps the global batches.

Mid-epoch resume
    Both loaders are :class:`ResumableDataLoader` objects, stateful in Lightning's sense (``state_dict`` /
    ``load_state_dict``): Lightning stores the training loader's state in the fit loop's checkpoint state and
    restores it on ``fit(ckpt_path=...)``. The state is the epoch and the number of *global* samples of that
    epoch's order consumed (by every rank together), plus the seed and dataset size it refers to; it is the
    same on every rank, so rank 0's copy restores every rank, under this layout or another one. The resumed
    epoch continues at the next sample of the same order: nothing is repeated or skipped.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any, Optional, Union

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_moe.data.chat import CHAT_OVERLONG, CHAT_TRAIN_ON, tokenize_chat_files
from lightning_moe.data.collate import collate
from lightning_moe.data.corpus import EMBEDDED_CORPUS_MAX_BYTES, load_documents
from lightning_moe.flags import check_flags
from lightning_moe.data.tokenizer import ByteTokenizer, load_hf_tokenizer
from lightning_moe.data.datasets import PackedDataset, RowsDataset, document_positions, pack_documents
from lightning_moe.data.resumable import ResumableDataLoader, ResumableDistributedSampler

__all__ = ["PackedDataset", "ResumableDataLoader", "ResumableDistributedSampler", "RowsDataset", "TextDataModule",
           "document_positions", "pack_documents"]


class TextDataModule(LightningDataModule):
    """Packed language-modelling batches from local text files or the embedded corpus.

    Args:
        files: one path or a list of paths: ``.txt`` files (one document each), ``.jsonl`` files (one document per
            line, the text under ``text_field``), ``.json`` files (an array of strings or of objects with
            ``text_field``), any of them ``.gz`` / ``.bz2`` / ``.xz`` compressed, and directories of them (searched
            recursively, sorted). ``None`` uses the embedded corpus: Python's standard-library sources, ~8 MB (see
            :mod:`lightning_moe.data.corpus`). Binary files are refused.
        text_field: key of the text in ``.jsonl`` / ``.json`` records.
        tokenizer: ``None`` for the byte tokenizer (vocab 260), else the path of a *local* Hugging Face
            tokenizer directory (needs ``transformers``; nothing is downloaded).
        seq_len: tokens per sample.
        batch_size: samples per micro-batch on each data-parallel (batch-view) rank; an optimizer step reads
            ``batch_size x data-parallel ranks x accumulate_grad_batches`` samples (the global batch).
        val_fraction: fraction of samples, taken from the tail of the stream, used for validation; 0 = none.
        shuffle: shuffle training samples (each epoch, seeded with ``seed + epoch``).
        seed: shuffle seed; identical on all ranks.
        num_workers: DataLoader worker processes.
        max_tokens: cap on the packed stream length (tokens). For the embedded corpus a cap above 8M also
            reads more of the standard library (up to all of it).
        drop_last: drop the incomplete last training batch (and the shard remainder so ranks stay even).
        global_batch_size: samples per optimizer step over all data-parallel ranks; None = off (use
            ``batch_size``). When set, the per-rank ``batch_size`` is derived from the layout as
            ``global_batch_size / (data-parallel ranks x accumulate_grad_batches)`` (ValueError when that is
            not an integer), so a change of layout keeps the global batch and a resumed run reads the same
            steps as an uninterrupted one.
        test_files: files for ``trainer.test`` / ``lightning-moe test`` (same formats as ``files``), packed whole;
            None = the validation split.
        predict_prompts: prompts for ``trainer.predict`` / ``lightning-moe predict`` (one string or a list); each
            batch is left-padded with an ``attention_mask`` and carries the prompts under ``"prompt"``.
        format: ``"text"`` (documents, packed into windows) or ``"chat"`` (``.jsonl`` / ``.json`` records with
            ``messages`` or ``prompt`` / ``completion``, rendered with the chat template of ``tokenizer``; see
            :mod:`lightning_moe.data.chat`).
        document_mask: text: samples carry ``position_ids`` restarting per document, so attention never crosses
            documents and no label predicts the next document (see *Packing*). Chat data is always packed so.
        train_on: chat: ``"assistant"`` (loss on the assistant turns' tokens) or ``"all"`` (every token).
        overlong: chat: a conversation longer than ``seq_len`` is an error naming its line (``"error"``), cut to
            ``seq_len`` (``"truncate"``) or left out (``"drop"``); cut or dropped ones are counted and reported.
    """

    def __init__(
        self,
        files: Optional[Union[str, list[str]]] = None,
        text_field: str = "text",
        tokenizer: Optional[str] = None,
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        max_tokens: Optional[int] = None,
        drop_last: bool = True,
        global_batch_size: Optional[int] = None,
        test_files: Optional[Union[str, list[str]]] = None,
        predict_prompts: Optional[Union[str, list[str]]] = None,
        format: str = "text",
        document_mask: bool = False,
        train_on: str = "assistant",
        overlong: str = "error",
    ) -> None:
        super().__init__()
        check_flags("TextDataModule", shuffle=shuffle, drop_last=drop_last, document_mask=document_mask)
        if format not in ("text", "chat"):
            raise ValueError(f"format must be 'text' or 'chat', got {format!r}")
        if format == "chat":
            if files is None:
                raise ValueError("format='chat' needs `files`: .jsonl files of conversations (there is no embedded "
                                 "chat corpus)")
            if tokenizer is None:
                raise ValueError("format='chat' needs `tokenizer`: a local Hugging Face tokenizer directory with a "
                                 "chat template (the byte tokenizer has none)")
        if train_on not in CHAT_TRAIN_ON:
            raise ValueError(f"train_on must be one of {CHAT_TRAIN_ON}, got {train_on!r}")
        if overlong not in CHAT_OVERLONG:
            raise ValueError(f"overlong must be one of {CHAT_OVERLONG}, got {overlong!r}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}; set e.g. `seq_len: 256`.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}; set e.g. `batch_size: 8`.")
        if not isinstance(val_fraction, (int, float)) or not 0.0 <= float(val_fraction) < 1.0:
            raise ValueError(
                f"val_fraction must be in [0, 1), got {val_fraction!r}; use e.g. 0.05 (or 0 for no validation)."
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}.")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0
        ):
            raise ValueError(f"max_tokens must be a positive integer or null, got {max_tokens!r}.")
        if global_batch_size is not None and (
            isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size <= 0
        ):
            raise ValueError(
                f"global_batch_size must be a positive integer or null, got {global_batch_size!r}."
            )
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        self.files = None if files is None else [os.fspath(f) for f in files]
        if isinstance(test_files, (str, os.PathLike)):
            test_files = [test_files]
        self.test_files = None if test_files is None else [os.fspath(f) for f in test_files]
        for f in self.test_files or []:
            if not os.path.exists(os.path.expanduser(f)):
                raise ValueError(f"test file or directory {f!r} does not exist; fix the path in `test_files`.")
        if isinstance(predict_prompts, str):
            predict_prompts = [predict_prompts]
        self.predict_prompts = None if predict_prompts is None else [str(p) for p in predict_prompts]
        self.test_dataset: Optional[Dataset] = None
        for f in self.files or []:
            if not os.path.exists(os.path.expanduser(f)):
                raise ValueError(f"data file or directory {f!r} does not exist; fix the path in `files`.")
        self.text_field = text_field
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.max_tokens = max_tokens
        self.drop_last = drop_last
        self.global_batch_size = global_batch_size
        self.format = format
        self.document_mask = bool(document_mask) or format == "chat"
        self.train_on = train_on
        self.overlong = overlong
        self.chat_stats = None  # what building chat rows did (lightning_moe.data.chat.ChatStats)
        self.save_hyperparameters()

        self._tokenizer_obj: Any = None
        self._batch_view: Optional[tuple[int, int]] = None
        self._model_limits: Optional[tuple[Optional[int], Optional[int]]] = None
        self._token_range: Optional[tuple[int, int]] = None
        self.tokens: Optional[torch.Tensor] = None
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None

    # ------------------------------------------------------------------ tokenizer
    def get_tokenizer(self) -> Any:
        """The tokenizer object: a :class:`ByteTokenizer` or the loaded Hugging Face tokenizer."""
        if self._tokenizer_obj is None:
            self._tokenizer_obj = ByteTokenizer() if self.tokenizer is None else load_hf_tokenizer(self.tokenizer)
        return self._tokenizer_obj

    @property
    def vocab_size(self) -> int:
        """260 for the byte tokenizer, ``len(tokenizer)`` (including added tokens) for Hugging Face ones."""
        tok = self.get_tokenizer()
        return ByteTokenizer.VOCAB_SIZE if isinstance(tok, ByteTokenizer) else len(tok)

    @property
    def eos_id(self) -> int:
        tok = self.get_tokenizer()
        if isinstance(tok, ByteTokenizer):
            return ByteTokenizer.EOS
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            eos = getattr(tok, "sep_token_id", None)
        if eos is None:
            raise ValueError(
                f"the tokenizer at {self.tokenizer!r} has neither an eos_token nor a sep_token to separate "
                "documents; set `tokenizer.eos_token` and save it again, or use another tokenizer."
            )
        return int(eos)

    # ------------------------------------------------------------------ batch view
    def set_batch_view(self, num_replicas: int, rank: int) -> None:
        """Shard samples over ``num_replicas`` batch-view ranks; this process reads shard ``rank``."""
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}.")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank!r}.")
        self._batch_view = (num_replicas, rank)

    def batch_view(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` used for sharding (see the module docstring)."""
        if self._batch_view is not None:
            return self._batch_view
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
            if kwargs:
                num_replicas, rank = int(kwargs["num_replicas"]), int(kwargs["rank"])
                if num_replicas < 1 or not 0 <= rank < num_replicas:
                    raise ValueError(f"invalid distributed_sampler_kwargs {kwargs!r} from the strategy.")
                return num_replicas, rank
        return 1, 0

    # ------------------------------------------------------------------ model limits
    def set_model_limits(self, vocab_size: Optional[int] = None, max_seq_len: Optional[int] = None) -> None:
        """The vocabulary size and maximum sequence length of the model this data feeds (the CLI sets them); the
        packed stream, ``seq_len`` and every batch are checked against them."""
        self._model_limits = (vocab_size, max_seq_len)

    def model_limits(self) -> tuple[Optional[int], Optional[int]]:
        """``(vocab_size, max_seq_len)`` of the model: :meth:`set_model_limits`, else the ``config`` of the
        attached trainer's LightningModule, else ``(None, None)`` (unchecked)."""
        if self._model_limits is not None:
            return self._model_limits
        trainer = getattr(self, "trainer", None)
        cfg = getattr(getattr(trainer, "lightning_module", None), "config", None) if trainer is not None else None
        return getattr(cfg, "vocab_size", None), getattr(cfg, "max_seq_len", None)

    def check_limits(self) -> None:
        """ValueError, naming the limit, if ``seq_len`` exceeds the model's ``max_seq_len`` or the packed token ids
        fall outside ``[0, vocab_size)`` of the tokenizer or the model."""
        vocab, max_seq_len = self.model_limits()
        if max_seq_len is not None and self.seq_len > max_seq_len:
            raise ValueError(
                f"data.seq_len={self.seq_len} exceeds the model's max_seq_len={max_seq_len}: lower data.seq_len to "
                f"<= {max_seq_len} or raise model.config.max_seq_len"
            )
        if self._token_range is None:
            return
        low, high = self._token_range
        if low < 0:
            raise ValueError(f"the tokenizer produced the negative token id {low}; token ids must be >= 0")
        tok_vocab = self.vocab_size
        if high >= tok_vocab:
            raise ValueError(
                f"the tokenizer produced token id {high} >= its own vocabulary size {tok_vocab}; check `tokenizer`"
            )
        if vocab is not None and high >= vocab:
            raise ValueError(
                f"the data holds token id {high} >= the model's vocab_size={vocab}: set model.config.vocab_size >= "
                f"{max(high + 1, tok_vocab)} (the tokenizer has {tok_vocab} tokens) or use a smaller tokenizer"
            )

    # ------------------------------------------------------------------ batch size
    def per_rank_batch_size(self) -> int:
        """Samples per micro-batch on this batch-view rank: ``batch_size``, or with ``global_batch_size``
        ``global_batch_size / (num_replicas x accumulate_grad_batches)`` of the attached trainer."""
        if self.global_batch_size is None:
            return self.batch_size
        num_replicas, _ = self.batch_view()
        trainer = getattr(self, "trainer", None)
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if trainer is not None else 1
        per_step = num_replicas * accumulate
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not divide over {num_replicas} data-parallel "
                f"rank(s) x accumulate_grad_batches={accumulate}: choose a multiple of {per_step}, or set "
                "`global_batch_size: null` and a per-rank `batch_size`"
            )
        return self.global_batch_size // per_step

    # ------------------------------------------------------------------ data
    def prepare_data(self) -> None:
        """Nothing to download: every source is local. Tokenising happens in :meth:`setup` on each process."""

    def setup(self, stage: Optional[str] = None) -> None:
        """Tokenise and pack the corpus (once per process) and build the train / val datasets."""
        if self.tokens is not None:
            return
        if self.format == "chat":
            return self._setup_chat()
        tok = self.get_tokenizer()
        eos_id = self.eos_id
        embedded_cap = max(EMBEDDED_CORPUS_MAX_BYTES, self.max_tokens or 0)
        docs = load_documents(self.files, self.text_field, embedded_cap)
        if not docs:
            raise ValueError(
                f"the corpus is empty: no text in {self.files!r}; add text to the files or point `files` elsewhere."
            )
        tokens = pack_documents(docs, tok, eos_id, self.max_tokens)
        S = self.seq_len
        num_samples = (tokens.numel() - 1) // S if tokens.numel() > 0 else 0
        if num_samples < 1:
            raise ValueError(
                f"the corpus has {tokens.numel()} tokens, too few for one sample of seq_len={S} (needs {S + 1}); "
                "lower `seq_len`, raise `max_tokens` or add data."
            )
        num_val = math.ceil(num_samples * self.val_fraction) if self.val_fraction > 0 else 0
        num_train = num_samples - num_val
        if num_train < 1:
            raise ValueError(
                f"the corpus gives {num_samples} sample(s) of seq_len={S}, none left for training after "
                f"val_fraction={self.val_fraction}; lower `seq_len` or `val_fraction`, or add data."
            )
        self.tokens = tokens
        self._token_range = (int(tokens.min()), int(tokens.max()))
        positions = document_positions(tokens, eos_id) if self.document_mask else None
        self.train_dataset = PackedDataset(tokens, S, 0, num_train, positions)
        self.val_dataset = PackedDataset(tokens, S, num_train, num_val, positions)

    def _chat_rows(self, files: list[str]) -> tuple[dict[str, torch.Tensor], Any]:
        rows, stats = tokenize_chat_files(files, self.get_tokenizer(), self.seq_len, self.train_on, self.overlong,
                                          tokenizer_name=self.tokenizer)
        (rank_zero_warn if stats.cut or stats.dropped else rank_zero_info)(stats.summary(self.seq_len))
        return rows, stats

    def _setup_chat(self) -> None:
        """Chat rows (see *Chat data*), split like text samples: the last ``ceil(rows * val_fraction)`` validate."""
        rows, self.chat_stats = self._chat_rows(self.files or [])
        n = rows["input_ids"].shape[0]
        num_val = math.ceil(n * self.val_fraction) if self.val_fraction > 0 else 0
        if n - num_val < 1:
            raise ValueError(f"the chat data packs into {n} row(s) of seq_len={self.seq_len}, none left for training "
                             f"after val_fraction={self.val_fraction}; lower `val_fraction` or add conversations.")
        self.tokens = rows["input_ids"]
        self._token_range = (int(self.tokens.min()), int(self.tokens.max()))
        self.train_dataset = RowsDataset(rows, 0, n - num_val)
        self.val_dataset = RowsDataset(rows, n - num_val, num_val)

    def _loader(self, dataset: Dataset, sampler: DistributedSampler, drop_last: bool) -> DataLoader:
        self.check_limits()
        vocab, max_seq_len = self.model_limits()
        return ResumableDataLoader(
            dataset,
            batch_size=self.per_rank_batch_size(),
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=partial(collate, vocab_size=vocab, max_seq_len=max_seq_len),
        )

    def train_dataloader(self) -> DataLoader:
        """Training batches in a :class:`ResumableDataLoader` (see *Mid-epoch resume* in the module docstring)."""
        self.setup("fit")
        assert self.train_dataset is not None
        num_replicas, rank = self.batch_view()
        batch_size = self.per_rank_batch_size()
        n = len(self.train_dataset)
        full_batches = (n // num_replicas) // batch_size  # per rank, with drop_last
        if (full_batches if self.drop_last else n) < 1:
            raise ValueError(
                f"{len(self.train_dataset)} training samples (seq_len={self.seq_len}) over {num_replicas} "
                f"data-parallel rank(s) give no full batch of batch_size={batch_size}; lower `batch_size` "
                "or `seq_len`, add data, or set `drop_last: false`."
            )
        sampler = ResumableDistributedSampler(
            self.train_dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )
        return self._loader(self.train_dataset, sampler, self.drop_last)

    def val_dataloader(self) -> Any:
        """Validation batches; an empty list when ``val_fraction == 0`` (Lightning then skips validation).

        Sharded over the batch view without shuffling and without dropping; with several replicas the
        sampler repeats a few samples so every rank gets the same number of batches. Also a
        :class:`ResumableDataLoader` (each validation run reads the whole set from its start).
        """
        self.setup("validate")
        assert self.val_dataset is not None
        if len(self.val_dataset) == 0:
            return []
        num_replicas, rank = self.batch_view()
        sampler = ResumableDistributedSampler(
            self.val_dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False
        )
        return self._loader(self.val_dataset, sampler, False)

    def test_dataloader(self) -> Any:
        """``test_files`` packed whole (sharded over the batch view like validation), else the validation split."""
        if self.test_files is None:
            return self.val_dataloader()
        if self.test_dataset is None and self.format == "chat":
            rows, _ = self._chat_rows(self.test_files)
            self.test_dataset = RowsDataset(rows, 0, rows["input_ids"].shape[0])
        if self.test_dataset is None:
            docs = load_documents(self.test_files, self.text_field, EMBEDDED_CORPUS_MAX_BYTES)
            tokens = pack_documents(docs, self.get_tokenizer(), self.eos_id)
            n = (tokens.numel() - 1) // self.seq_len if tokens.numel() > 0 else 0
            if n < 1:
                raise ValueError(f"test_files {self.test_files!r} hold {tokens.numel()} tokens, too few for one sample "
                                 f"of seq_len={self.seq_len}; add text or lower `seq_len`.")
            positions = document_positions(tokens, self.eos_id) if self.document_mask else None
            self.test_dataset = PackedDataset(tokens, self.seq_len, 0, n, positions)
        num_replicas, rank = self.batch_view()
        sampler = ResumableDistributedSampler(self.test_dataset, num_replicas=num_replicas, rank=rank, shuffle=False,
                                              drop_last=False)
        return self._loader(self.test_dataset, sampler, False)

    def predict_dataloader(self) -> Any:
        """The ``predict_prompts``, tokenised (no EOS appended), left-padded per batch with an attention mask."""
        if not self.predict_prompts:
            raise ValueError("nothing to predict: give the prompts with `predict_prompts` (e.g. "
                             "--data.predict_prompts '[\"def main(\"]')")
        tok = self.get_tokenizer()
        rows = [{"prompt": p, "ids": torch.tensor(tok.encode(p), dtype=torch.long)} for p in self.predict_prompts]
        if any(r["ids"].numel() == 0 for r in rows):
            raise ValueError("an empty prompt cannot be continued: remove it from `predict_prompts`")
        pad = self.eos_id

        def left_pad(batch: list[dict[str, Any]]) -> dict[str, Any]:
            S = max(r["ids"].numel() for r in batch)
            ids = torch.full((len(batch), S), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), S), dtype=torch.long)
            for i, r in enumerate(batch):
                n = r["ids"].numel()
                ids[i, S - n:] = r["ids"]
                mask[i, S - n:] = 1
            return {"input_ids": ids, "attention_mask": mask, "prompt": [r["prompt"] for r in batch]}

        return DataLoader(rows, batch_size=self.per_rank_batch_size(), shuffle=False, collate_fn=left_pad)
