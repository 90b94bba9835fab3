"""Everything that knows about meshes: ParallelDims (the one owner of meshes), parallelize and gradient helpers."""

from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.grads import all_reduce_grads, clip_grad_norm_, global_grad_norm
from lightning_moe.parallel.parallelize import (
    apply_ac,
    apply_cp,
    apply_ep,
    apply_fsdp,
    apply_router_groups,
    apply_tp,
    parallelize,
)

__all__ = [
    "ParallelDims", "parallelize", "apply_tp", "apply_cp", "apply_ep", "apply_router_groups", "apply_ac",
    "apply_fsdp", "all_reduce_grads", "clip_grad_norm_", "global_grad_norm",
]
