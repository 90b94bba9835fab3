"""Lightning callbacks of lightning_moe, each configurable from YAML (``trainer.callbacks``)."""

from lightning_moe.callbacks.activation_offload import ActivationOffload

__all__ = ["ActivationOffload"]
