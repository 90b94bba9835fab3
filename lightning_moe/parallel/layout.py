"""The layout rules in one place: which mesh dims split each parameter of the built-in model.

``parallelize`` applies them (its tensor-parallel plan is built from the tables below) and ``plan`` counts per-GPU
bytes from them, so the two cannot drift apart. Pure Python: no process group, no torch.distributed.

* tensor parallel (sequence parallel): the names in :data:`TP_COLWISE` / :data:`TP_ROWWISE` inside a block, the
  embedding (vocab rows) and the LM head (vocab columns); everything else of the dense view (norms, per-head qk
  norms, MLA's latent down-projections and norms, the router, shared experts) is replicated over tp;
* FSDP2 shards every dense parameter over ``dp_shard * cp`` (dp_replicate replicates);
* routed experts (:data:`EXPERT_WEIGHTS`): ``Shard(0)`` over ep, F over etp, FSDP over edp_shard;
* buffers (the expert bias, rope tables) are not split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from lightning_moe.parallel.dims import ParallelDims

__all__ = ["AC_MODES", "RECOMPUTE_KINDS", "DISPATCHERS", "TP_COLWISE", "TP_ROWWISE", "TP_MODEL", "EXPERT_WEIGHTS",
           "block_relative", "check_recompute_num_layers", "parse_activation_checkpointing",
           "format_activation_checkpointing", "split_factors"]

AC_MODES = ("none", "full")
# module kinds ``activation_checkpointing`` may list (Megatron's --recompute-modules); none of them holds a collective
RECOMPUTE_KINDS = ("norm", "attn_core", "moe_act", "experts", "shared_experts", "mla_up_proj")
DISPATCHERS = ("alltoall", "allgather", "deepep")  # deepep: optional backend, lightning_moe.moe.dispatch.deepep
# block-relative module names split by tensor parallelism (a model has the ones its attention kind defines). MLA splits
# its heads after the low-rank projections (as Megatron does): the up-projections wq_b / wkv_b (wq without q
# compression) column-wise; the latent down-projections wq_a / wkv_a (with the shared RoPE key) and their norms
# stay whole on every tp rank.
TP_COLWISE = ("attention.wq", "attention.wk", "attention.wv", "attention.wq_b", "attention.wkv_b",
              "feed_forward.w1", "feed_forward.w3")
TP_ROWWISE = ("attention.wo", "feed_forward.w2")
# model-level modules split by tensor parallelism (vocab rows / columns)
TP_MODEL = ("tok_embeddings", "output")
EXPERT_WEIGHTS = ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3")


def block_relative(fqn: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``attention.wq.weight``; model-level names unchanged."""
    parts = fqn.split(".")
    return ".".join(parts[2:]) if len(parts) > 2 and parts[0] == "layers" else fqn


def split_factors(fqn: str, dims: "ParallelDims") -> dict[str, int]:
    """The mesh sizes that divide parameter ``fqn`` of the built-in model under ``dims``: keys among ``tp``,
    ``fsdp`` (dp_shard*cp), ``ep``, ``etp``, ``edp``."""
    rel = block_relative(fqn)
    module = rel.rsplit(".", 1)[0]
    if module in EXPERT_WEIGHTS or rel in EXPERT_WEIGHTS:
        return {"ep": dims.ep, "etp": dims.etp, "edp": dims.edp_shard}
    factors = {"fsdp": int(dims.dp_shard) * dims.cp}
    if module in TP_COLWISE + TP_ROWWISE or (module == rel.split(".")[0] and module in TP_MODEL):
        factors = {"tp": dims.tp, **factors}
    return factors


def parse_activation_checkpointing(value: "str | Sequence[str] | None") -> tuple[str, ...]:
    """``"none"`` -> ``()``; ``"full"`` -> ``("full",)``; a list of kinds (a YAML list, or a comma-separated string,
    brackets optional: ``"[norm, moe_act]"``) -> the kinds in :data:`RECOMPUTE_KINDS` order. ``"full"`` may be
    combined with kinds (nested recomputation). ValueError for unknown kinds or ``"none"`` among others."""
    valid = AC_MODES + RECOMPUTE_KINDS
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return ()  # the parsed form of "none"
    if isinstance(value, str):
        items = [s.strip().strip("'\"") for s in value.strip().removeprefix("[").removesuffix("]").split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise ValueError(f"activation_checkpointing must be a string or a list of strings among {valid}, got {value!r}")
    items = [s for s in items if s]
    bad = [s for s in items if s not in valid]
    if bad or not items:
        raise ValueError(f"activation_checkpointing: unknown {bad or value!r}; valid: 'none', 'full' or a list of "
                         f"{RECOMPUTE_KINDS} (optionally with 'full')")
    if "none" in items:
        if len(set(items)) > 1:
            raise ValueError(f"activation_checkpointing: 'none' cannot be combined with other kinds, got {value!r}")
        return ()
    return tuple(k for k in ("full",) + RECOMPUTE_KINDS if k in items)


def check_recompute_num_layers(num_layers: Optional[int], kinds: Sequence[str], num_blocks: Optional[int] = None) -> None:
    """ValueError unless ``num_layers`` is None, or a positive int with ``"full"`` among ``kinds`` and (when
    ``num_blocks`` is known) at most the model's number of transformer blocks."""
    if num_layers is None:
        return
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"recompute_num_layers must be a positive integer or None, got {num_layers!r}")
    if "full" not in kinds:
        raise ValueError("recompute_num_layers selects how many blocks 'full' recomputes: add 'full' to "
                         f"activation_checkpointing (got {format_activation_checkpointing(kinds)!r}) or leave "
                         "recompute_num_layers unset")
    if num_blocks is not None and num_layers > num_blocks:
        raise ValueError(f"recompute_num_layers={num_layers} but the model has {num_blocks} transformer blocks; use "
                         f"at most {num_blocks} (or None for all)")


def format_activation_checkpointing(kinds: Sequence[str]) -> str:
    """The inverse of :func:`parse_activation_checkpointing` for display: ``none``, ``full``, ``norm,moe_act``."""
    return ",".join(kinds) if kinds else "none"
