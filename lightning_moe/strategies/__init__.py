from lightning_moe.strategies.moe_parallel import MoEParallelStrategy
from lightning_moe.strategies.requirements import ParallelRequirements

__all__ = ["MoEParallelStrategy", "ParallelRequirements"]
