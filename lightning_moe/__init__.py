"""lightning_moe: Mixture-of-Experts training for PyTorch Lightning."""

from lightning_moe.callbacks import LoadBalanceMonitor, LowPrecisionTraining
from lightning_moe.config import MoEConfig, ModelConfig, YaRNScaling
from lightning_moe.module import MoELanguageModel
from lightning_moe.strategies import MoEParallelStrategy

__all__ = ["LoadBalanceMonitor", "LowPrecisionTraining", "MoEConfig", "ModelConfig", "MoELanguageModel", "MoEParallelStrategy", "YaRNScaling"]
__version__ = "0.1.0"
