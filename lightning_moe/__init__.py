"""lightning_moe: Mixture-of-Experts training for PyTorch Lightning."""

from lightning_moe.config import MoEConfig, ModelConfig, YaRNScaling

__all__ = ["MoEConfig", "ModelConfig", "YaRNScaling"]
__version__ = "0.1.0"
