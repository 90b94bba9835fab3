"""Lightning callbacks of lightning_moe (each configurable from YAML under ``trainer.callbacks``)."""

from lightning_moe.callbacks.activation_offload import ActivationOffload
from lightning_moe.callbacks.load_balance import LoadBalanceMonitor
from lightning_moe.callbacks.low_precision import LowPrecisionTraining

__all__ = ["ActivationOffload", "LoadBalanceMonitor", "LowPrecisionTraining"]
