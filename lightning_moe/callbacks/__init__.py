"""Lightning callbacks of lightning_moe (each configurable from YAML under ``trainer.callbacks``)."""

from lightning_moe.callbacks.activation_offload import ActivationOffload
from lightning_moe.callbacks.load_balance import LoadBalanceMonitor

__all__ = ["ActivationOffload", "LoadBalanceMonitor"]
