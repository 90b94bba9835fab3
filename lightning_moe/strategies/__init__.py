from lightning_moe.strategies.moe_parallel import MoEParallelStrategy

__all__ = ["MoEParallelStrategy"]
