"""Text generation from a trained MoETransformer.

- :mod:`~lightning_moe.generation.sampling`: :func:`sample_next_token` (greedy / temperature / top-k / top-p).
- :mod:`~lightning_moe.generation.decode`: :func:`generate` (token ids in, prompt + continuation ids out; left-padded
  batches through ``attention_mask``; KV cache), :func:`generate_text` (strings), :func:`generate_any`.
- :mod:`~lightning_moe.generation.cli`: :func:`generate_main`, the ``lightning-moe generate`` command.
- :func:`load_for_generation` / :func:`checkpoint_tokenizer` live in :mod:`lightning_moe.checkpoint.offline` (the
  one offline reader of checkpoints) and are re-exported here.
"""

from lightning_moe.checkpoint.offline import checkpoint_tokenizer, load_for_generation
from lightning_moe.generation.cli import generate_main
from lightning_moe.generation.decode import generate, generate_any, generate_text
from lightning_moe.generation.sampling import sample_next_token

__all__ = ["generate", "generate_text", "generate_any", "load_for_generation", "checkpoint_tokenizer", "generate_main",
           "sample_next_token"]
