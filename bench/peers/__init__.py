"""The peers the suites measure against, built from our configs with our weights where that can be arranged:
``transformers`` models and MoE blocks (``bench.peers.hf``) and torchtitan's MoE layer (``bench.peers.torchtitan``)."""

from __future__ import annotations

from typing import Any

import torch


def copy_into(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Copy ``values`` (by parameter / buffer name) into ``module``, keeping the module's dtypes; names of the
    module that got nothing are returned (the benchmark then runs them as initialised, and says so)."""
    own = dict(module.named_parameters())
    own.update({k: v for k, v in module.named_buffers() if v is not None})
    missing = sorted(set(own) - set(values))
    unknown = sorted(set(values) - set(own))
    with torch.no_grad():
        for name, v in values.items():
            if name in own:
                if tuple(own[name].shape) != tuple(v.shape):
                    raise ValueError(f"{name}: shape {tuple(own[name].shape)} vs ours {tuple(v.shape)}")
                own[name].copy_(v)
    return {"unmapped": missing, "unused": unknown}
