"""The layout rules in one place: which mesh dims split each parameter of the built-in model.

``parallelize`` applies them (its tensor-parallel plan is built from the tables below) and ``plan`` counts per-GPU
bytes from them, so the two cannot drift apart. Pure Python: no process group, no torch.distributed.

* tensor parallel (sequence parallel): the names in :data:`TP_COLWISE` / :data:`TP_ROWWISE` inside a block, the
  embedding (vocab rows) and the LM head (vocab columns); everything else of the dense view (norms, per-head qk
  norms, the router, shared experts) is replicated over tp;
* FSDP2 shards every dense parameter over ``dp_shard * cp`` (dp_replicate replicates);
* routed experts (:data:`EXPERT_WEIGHTS`): ``Shard(0)`` over ep, F over etp, FSDP over edp_shard;
* buffers (the expert bias, rope tables) are not split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from lightning_moe.parallel.dims import ParallelDims

__all__ = ["AC_MODES", "DISPATCHERS", "TP_COLWISE", "TP_ROWWISE", "TP_MODEL", "EXPERT_WEIGHTS", "block_relative",
           "split_factors"]

AC_MODES = ("none", "full")
DISPATCHERS = ("alltoall", "allgather")
# block-relative module names split by tensor parallelism
TP_COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
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
