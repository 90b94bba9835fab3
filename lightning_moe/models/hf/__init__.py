"""Hugging Face adapters: configs and weights of ``qwen3_moe``, ``mixtral``, ``deepseek_v3`` and ``olmoe`` models.

Import::

    hf = load_hf_config(path)                    # config.json, read as JSON (never code)
    cfg = config_from_hf(hf, max_seq_len=4096)   # every field that changes the computation, or a ValueError
    model = MoETransformer(cfg)                  # (on meta, parallelize, to_empty: any layout)
    result = load_hf_weights_(model, path)       # each rank reads only the rows of its local shards

Export::

    save_hf(model, out_dir, model_type="qwen3_moe", max_shard_bytes=5 * 2**30)   # config.json + safetensors

Conversions made at the edge (DESIGN invariant 3; our model is never changed to suit a format):

- Routed experts: our stacked ``w1`` (gate) / ``w3`` (up) [E, F, D] and ``w2`` (down) [E, D, F] <-> the per-expert
  ``experts.{j}.gate_proj/up_proj/down_proj`` (Mixtral: ``block_sparse_moe.experts.{j}.w1/w3/w2``) that checkpoints
  hold on disk, or transformers 5's in-memory fused ``experts.gate_up_proj`` [E, 2F, D] (gate rows first) and
  ``experts.down_proj`` [E, D, F]. Export writes the per-expert form, which is what transformers' ``save_pretrained``
  writes and ``from_pretrained`` converts.
- DeepSeek-V3 with ``rope_interleave`` (its default) rotates the pairs (2i, 2i+1) of ``q_pe`` / ``k_pe``; our model
  rotates (i, i + r/2) (rotate-half). The rope rows of ``q_proj`` / ``q_b_proj`` (per head) and of
  ``kv_a_proj_with_mqa`` are permuted (evens then odds) at import, and back at export. q.k is unchanged.
- ``e_score_correction_bias`` <-> our router's ``expert_bias`` buffer (used for the choice only, in both).

Reading is safetensors only (``safe_open`` + ``get_slice``): a parameter that is a DTensor shard (EP ``Shard(0)`` of
the experts, FSDP ``Shard(0)``, TP ``Shard(0)/Shard(1)``) gets only the rows / experts of its local shard read from
disk. ``HFCheckpointReader.bytes_read`` counts what was read.
"""

from lightning_moe.models.hf.config import (
    ARCHITECTURES,
    DENSE_MODEL_TYPES,
    EXPORT_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    _config_differences,  # noqa: F401  (MoELanguageModel's check of a pretrained folder against its config)
    config_from_hf,
    config_to_hf,
    export_families,
    load_hf_config,
)
from lightning_moe.models.hf.io import (
    HFCheckpointReader,
    HFLoadResult,
    from_hf,
    load_hf_state_dict_,
    load_hf_weights_,
    save_hf,
    to_hf_state_dict,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "EXPORT_MODEL_TYPES",
    "DENSE_MODEL_TYPES",
    "ARCHITECTURES",
    "load_hf_config",
    "config_from_hf",
    "config_to_hf",
    "export_families",
    "HFCheckpointReader",
    "HFLoadResult",
    "load_hf_weights_",
    "load_hf_state_dict_",
    "from_hf",
    "to_hf_state_dict",
    "save_hf",
]
