"""MoEParallelStrategy: MoE Parallel Folding on DTensor meshes for the Lightning Trainer.

A Lightning ``ModelParallelStrategy`` (launcher, DCP checkpoints, FSDP2 conventions) whose single 2-D mesh is
replaced by :class:`~lightning_moe.parallel.ParallelDims`: one world, a dense view (dp_replicate x dp_shard x cp x
tp), an expert view (dp_replicate x edp_shard x ep x etp) and a batch view (dp_replicate x dp_shard).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from typing_extensions import override

from lightning_moe.moe.router import TopKRouter
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.parallelize import AC_MODES, DISPATCHERS, parallelize

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp16": torch.float16, "float16": torch.float16}


def _dtype(name: Optional[str], what: str) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"{what} must be one of {sorted(_DTYPES)} or None, got {name!r}")
    return _DTYPES[name]


class MoEParallelStrategy(ModelParallelStrategy):
    """Expert, tensor (with sequence parallel), context and fully sharded data parallelism for MoE models.

    Args:
        dp_replicate: replicas (HSDP outer dimension); shared by the dense and the expert view.
        dp_shard: FSDP2 shards of the dense parameters; ``"auto"`` takes what the world leaves.
        cp: context parallel size (load-balanced causal chunks; sequence length divisible by 2*cp).
        tp: tensor parallel size (with sequence parallel) for attention, dense MLPs, embeddings and LM head.
        ep: expert parallel size; may borrow ranks from dp_shard, cp and tp (folding).
        etp: expert tensor parallel size (splits the expert hidden size).
        dispatcher: ``"alltoall"`` or ``"allgather"`` token dispatch over ep.
        reshard_after_forward: FSDP2 option.
        param_dtype, reduce_dtype: FSDP2 mixed precision (``"bf16"``, ``"fp32"``; None = the parameter dtype).
        activation_checkpointing: ``"none"`` or ``"full"`` (whole blocks).
        save_distributed_checkpoint: one DCP shard per rank (True) or a full checkpoint on rank 0.
        process_group_backend: None = nccl on CUDA, gloo on CPU.
        timeout: process group timeout.
    """

    strategy_name = "moe_parallel"

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: Union[int, str] = "auto",
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        etp: int = 1,
        dispatcher: str = "alltoall",
        reshard_after_forward: bool = True,
        param_dtype: Optional[str] = None,
        reduce_dtype: Optional[str] = None,
        activation_checkpointing: str = "none",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
        if activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing must be one of {AC_MODES}, got {activation_checkpointing!r}")
        self._sizes = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp)
        for name, v in self._sizes.items():
            if name == "dp_shard" and v in ("auto", -1):
                continue
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self._dispatcher = dispatcher
        self._reshard_after_forward = reshard_after_forward
        self._param_dtype = _dtype(param_dtype, "param_dtype")
        self._reduce_dtype = _dtype(reduce_dtype, "reduce_dtype")
        self._activation_checkpointing = activation_checkpointing
        self._parallel_dims: Optional[ParallelDims] = None
        self._tp_sync_modules: list[nn.Module] = []

    # ---- meshes ---------------------------------------------------------------------------------------
    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError("the parallel layout exists once the processes are initialised (Trainer.fit)")
        return self._parallel_dims

    def _dims(self) -> ParallelDims:
        sizes = dict(self._sizes)
        if sizes["dp_shard"] == "auto":
            sizes["dp_shard"] = -1
        return ParallelDims(world_size=self.world_size, **sizes)

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        if self.cluster_environment is not None and self.parallel_devices:
            # the Trainer's constructor gets here: a layout that cannot fit the world fails now, not after launch
            self._dims()

    @override
    def setup_environment(self) -> None:
        # validate sizes and the model against them before any process group is created
        dims = self._dims()
        module = self.lightning_module
        cfg = getattr(module, "config", None)
        if cfg is not None:
            dims.validate(cfg)
        self._setup_distributed()
        dims.build_meshes(self.root_device.type)
        self._parallel_dims = dims
        self._device_mesh = dims.dense_mesh
        if module is not None:
            module._device_mesh = dims.dense_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dims = self.parallel_dims
        # tp and cp peers read the same samples; ep never changes what a rank reads
        return {"num_replicas": dims.batch_size_world, "rank": dims.batch_rank(self.global_rank)}

    @override
    def setup(self, trainer: Any) -> None:
        # configure_model builds every parameter in the precision's dtype already (Lightning's init context);
        # the second module.to(dtype) of Lightning's precision plugin would cast the fp32 routing state, which
        # FSDP2 gives no way back from. Skip it, then check nothing was left in another dtype.
        plugin = self.precision_plugin
        plugin.convert_module = lambda module: module  # instance attribute shadows the method
        try:
            super().setup(trainer)
        finally:
            del plugin.convert_module
        self._check_param_dtypes()

    def _check_param_dtypes(self) -> None:
        want = getattr(self.precision_plugin, "_desired_input_dtype", None)
        if want is None or self.model is None:
            return
        routing = {id(p) for m in self.model.modules() if isinstance(m, TopKRouter) for p in m.parameters()}
        wrong = [n for n, p in self.model.named_parameters()
                 if p.is_floating_point() and id(p) not in routing and p.dtype != want]
        if wrong:
            raise ValueError(
                f"parameters {wrong[:3]} are not {want} under precision {self.precision_plugin.precision!r}: "
                "build the model inside configure_model (Lightning's init context sets the dtype there)"
            )

    # ---- hooks used by MoELanguageModel ---------------------------------------------------------------
    def parallelize_model(self, model: nn.Module) -> nn.Module:
        self._tp_sync_modules = parallelize(
            model,
            self.parallel_dims,
            dispatcher=self._dispatcher,
            activation_checkpointing=self._activation_checkpointing,
            param_dtype=self._param_dtype,
            reduce_dtype=self._reduce_dtype,
            reshard_after_forward=self._reshard_after_forward,
        )
        return model

    def reduce_token_sum(self, t: Tensor) -> Tensor:
        """Sum over the ranks holding distinct tokens of one micro-batch stream (dp_replicate x dp_shard x cp)."""
        dims = self.parallel_dims
        if dims.batch_size_world * dims.cp == 1:
            return t
        group = dims.dp_cp_mesh.get_group()
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(t, "sum", group)

    def sync_replicated_grads(self) -> None:
        """Sum the gradients of tp-replicated parameters that saw distinct (sequence-parallel) tokens."""
        if not self._tp_sync_modules:
            return
        from lightning_moe.parallel.grads import all_reduce_grads

        params = [p for m in self._tp_sync_modules for p in m.parameters() if p.grad is not None]
        all_reduce_grads(params, self.parallel_dims.tp_mesh.get_group())

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a (labelled) batch: the load-balanced context-parallel chunks and their positions."""
        dims = self.parallel_dims
        seq_len = batch["input_ids"].shape[1]
        if dims.tp_enabled and seq_len % dims.tp:
            raise ValueError(f"sequence length {seq_len} must be divisible by tp={dims.tp} (sequence parallel)")
        if not dims.cp_enabled:
            return batch
        from lightning_moe.parallel.context_parallel import shard_batch_for_cp

        return shard_batch_for_cp(batch, dims.cp, dims.cp_mesh.get_local_rank())
