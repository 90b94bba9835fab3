"""Device helpers of the suites: synchronisation, memory readings, building modules on a device."""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator, Optional

import torch

GIB = 1024**3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / GIB


def allocated_gib(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device) / GIB


def pick_device(name: str) -> Optional[torch.device]:
    """The benchmark device for ``--device`` (None, with a message, when CUDA is asked for but absent)."""
    if name == "cuda" and not torch.cuda.is_available():
        print("--device cuda but CUDA is not available; use --device cpu", flush=True)
        return None
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


@contextlib.contextmanager
def building(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside are created on ``device`` with ``dtype`` as the default floating dtype (no fp32 copy on
    the host first)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(prev)


def build_on(cls: Any, config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``cls(config)`` created on ``device`` with ``dtype`` as the default dtype."""
    with building(device, dtype):
        return cls(config)
