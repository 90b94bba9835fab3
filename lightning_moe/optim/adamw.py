"""AdamW for parameters that live on several meshes and as plain tensors at once.

torch's fused and foreach AdamW kernels take one list of tensors per parameter group and cannot mix DTensors with
plain tensors (e.g. the router, replicated over tp without FSDP, beside DTensor attention weights). Splitting the
*groups* by that would make the grouping, and with it the optimizer and LR-scheduler state, depend on the layout.
This AdamW keeps the groups as the user made them (layout-independent: decay / no-decay) and splits each group by
kind only inside ``step``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step updates a group's DTensor and plain parameters in separate kernel calls.
    Same arguments, state and state dict as torch's."""

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            # the closure (Lightning's: training_step, backward, hooks, clipping) sees the groups as they are
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        split = []
        for g in groups:
            kinds: dict[bool, list[torch.Tensor]] = {}
            for p in g["params"]:
                kinds.setdefault(isinstance(p, DTensor), []).append(p)
            split += [{**g, "params": ps} for ps in kinds.values()] if len(kinds) > 1 else [g]
        if len(split) == len(groups):
            super().step()
            return loss
        self.param_groups = split
        try:
            super().step()
        finally:
            self.param_groups = groups
        return loss
