"""Environment capture of a benchmark call and the device machines' NCCL policy.

The policy (no NVLink SHARP / multicast: harmless on one GPU, required on the multi-GPU device machines) is set by
the runner at startup, ``apply_policy()``, never at import, and handed to every child process through
``child_env()``.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Optional

POLICY = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PACKAGES = ("torch", "lightning", "triton", "torchao", "transformers", "torchtitan")


def apply_policy() -> None:
    """Set the policy variables in this process (what ``python -m bench`` does before a suite is imported)."""
    os.environ.update(POLICY)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this one's, the policy and ``extra``."""
    return {**os.environ, **POLICY, **extra}


def package_version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unavailable (not installed)"


def environment(device: Any = None, packages: tuple[str, ...] = PACKAGES) -> dict[str, Any]:
    """Python, the installed versions of ``packages``, the GPU (name, CUDA), date, command line and the policy
    variables as this process sees them."""
    env: dict[str, Any] = {"python": platform.python_version(), "device": str(device) if device is not None else None,
                           "date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                           "host": platform.node()}
    for dist in packages:
        env[dist] = package_version(dist)
    gpu = _gpu(device)
    if gpu:
        env.update(gpu)
    env["policy_env"] = {k: os.environ.get(k) for k in POLICY}
    return env


def _gpu(device: Any) -> Optional[dict[str, Any]]:
    import torch

    if device is None or getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    return {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
