"""What :class:`~lightning_moe.MoEParallelStrategy` needs of the LightningModule it trains, handed over through one
documented, typed seam: ``module.parallel_requirements() -> ParallelRequirements``. The strategy reads nothing else
of the module (as Lightning's strategies, it stays model-agnostic); :class:`~lightning_moe.MoELanguageModel`
implements the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_moe.config import ModelConfig

__all__ = ["ParallelRequirements", "requirements_of"]


@dataclass(frozen=True)
class ParallelRequirements:
    """``config``: the model's configuration, checked against the layout before any process group exists (sizes
    that divide, ``tie_embeddings`` under tp) and with the first batch (``max_seq_len``; ``moe.pad_to_capacity``
    under ep). ``master_dtype``: the dtype the module's optimizer keeps master weights in (None: the parameters
    themselves); FSDP2 reduces gradients in it unless the strategy's ``reduce_dtype`` is set."""

    config: ModelConfig
    master_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, ModelConfig):
            raise TypeError(f"ParallelRequirements.config must be a lightning_moe.ModelConfig, got "
                            f"{type(self.config).__name__}")
        if self.master_dtype is not None and not isinstance(self.master_dtype, torch.dtype):
            raise TypeError(f"ParallelRequirements.master_dtype must be a torch.dtype or None, got "
                            f"{self.master_dtype!r}")


def requirements_of(module: Any, strategy_name: str = "MoEParallelStrategy") -> ParallelRequirements:
    """``module.parallel_requirements()``, checked: a TypeError naming the fix for a module without the method or
    one returning something else."""
    get = getattr(module, "parallel_requirements", None)
    if not callable(get):
        raise TypeError(f"{strategy_name} trains a LightningModule that declares parallel_requirements() -> "
                        f"lightning_moe.strategies.ParallelRequirements and builds its model through the strategy "
                        f"in configure_model, as lightning_moe.MoELanguageModel does; got {type(module).__name__}")
    req = get()
    if not isinstance(req, ParallelRequirements):
        raise TypeError(f"{type(module).__name__}.parallel_requirements() must return a "
                        f"lightning_moe.strategies.ParallelRequirements, got {type(req).__name__}")
    return req
