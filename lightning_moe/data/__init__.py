"""Data for lightning_moe: packed text batches, the byte tokenizer and the embedded default corpus."""

from lightning_moe.data.collate import collate, validate_batch
from lightning_moe.data.datamodule import (
    PackedDataset,
    ResumableDataLoader,
    ResumableDistributedSampler,
    TextDataModule,
)
from lightning_moe.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "PackedDataset", "ResumableDataLoader", "ResumableDistributedSampler", "TextDataModule",
           "collate", "validate_batch"]
