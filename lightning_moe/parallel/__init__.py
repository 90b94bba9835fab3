"""Everything that knows about meshes: ParallelDims (the one owner of meshes), parallelize and gradient helpers.

Names are imported lazily: the MoE dispatchers (model code) import ``lightning_moe.parallel.collectives`` and must
not pull in ``parallelize`` (which imports the model) on the way.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ParallelDims": "dims",
    "parallelize": "parallelize", "apply_tp": "parallelize", "apply_cp": "parallelize", "apply_ep": "parallelize",
    "apply_router_groups": "parallelize", "apply_ac": "parallelize", "apply_fsdp": "parallelize",
    "all_reduce_grads": "grads", "clip_grad_norm_": "grads", "global_grad_norm": "grads",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_moe.parallel' has no attribute {name!r}")
    return getattr(import_module(f"lightning_moe.parallel.{_EXPORTS[name]}"), name)
