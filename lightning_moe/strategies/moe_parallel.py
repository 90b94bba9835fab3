"""MoEParallelStrategy: MoE Parallel Folding on DTensor meshes for the Lightning Trainer.

One piece (about 650 lines): one Lightning strategy whose hooks (setup, the finalize hook, checkpoint save and load,
teardown) share its meshes and state; parallelisation, finalisation and the checkpoint format live in parallel/ and
checkpoint/.

A Lightning ``ParallelStrategy`` whose meshes are owned by :class:`~lightning_moe.parallel.ParallelDims`: one
world, a dense view (dp_replicate x dp_shard x cp x tp), an expert view (dp_replicate x edp_shard x ep x etp) and a
batch view (dp_replicate x dp_shard). Besides Lightning's strategy duties (processes, devices, collectives,
checkpoint IO) it owns what makes MoE training exact under every layout:

* the layout (``parallelize_model``, run by the module's build pipeline after the model transforms);
* gradient finalisation (tp sync, 1/N token normalisation, routing reductions, expert-bias update) through ONE
  hook, :meth:`finalize_step`: the module calls it with the step's record between the last backward and any
  ``on_before_optimizer_step`` hook, and the strategy adds only its layout's groups (it never reads the module);
* layout checks: sizes at Trainer construction, the model at setup, the batch at the first step, each a
  ValueError naming the fix, before any collective runs on bad sizes;
* what it needs of the module (the model's config, the master-weight dtype) through ONE documented seam,
  ``module.parallel_requirements()`` (:mod:`lightning_moe.strategies.requirements`): a module without it is a
  TypeError at setup; the strategy reads nothing else of it;
* checkpoints through torch.distributed.checkpoint with layout-independent keys (parameter names, global shapes)
  and the optimizer state by parameter name.

Registered in Lightning's strategy registry: ``Trainer(strategy="moe_parallel")`` is ``MoEParallelStrategy()``.

One piece (over 500 lines): a Lightning strategy is one class whose hooks (setup, parallelize, step, save and
load) share the meshes and the model it holds.
"""

from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Mapping, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_moe.checkpoint.files import SafeCheckpointIO, save_fsynced, verify_dir_checksums, write_dir_checksums
from lightning_moe.checkpoint.format import META_FILE
from lightning_moe.checkpoint.optimizer_state import check_shapes, is_by_name, regroup
from lightning_moe.checkpoint.publish import new_staging_dir, publish, remove, resolve
from lightning_moe.flags import check_flags
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.finalize import finalize_step
from lightning_moe.parallel.compile import resolve_compile
from lightning_moe.parallel.layout import check_recompute_num_layers, parse_activation_checkpointing
from lightning_moe.parallel.parallelize import DISPATCHERS, check_fsdp_dtypes, parallelize
from lightning_moe.step import StepRecord, StepResult
from lightning_moe.strategies.requirements import requirements_of

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_moe.config import ModelConfig

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp16": torch.float16, "float16": torch.float16}


def _dtype(name: Optional[str], what: str) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"{what} must be one of {sorted(_DTYPES)} or None, got {name!r}")
    return _DTYPES[name]


class MoEParallelStrategy(ParallelStrategy):
    """Expert, tensor (with sequence parallel), context and fully sharded data parallelism for MoE models.

    Args:
        dp_replicate: replicas (HSDP outer dimension); shared by the dense and the expert view.
        dp_shard: FSDP2 shards of the dense parameters; ``"auto"`` takes what the world leaves.
        cp: context parallel size (load-balanced causal chunks; sequence length divisible by 2*cp).
        tp: tensor parallel size (with sequence parallel) for attention, dense MLPs, embeddings and LM head.
        ep: expert parallel size; may borrow ranks from dp_shard, cp and tp (folding).
        etp: expert tensor parallel size (splits the expert hidden size).
        dispatcher: ``"alltoall"`` or ``"allgather"`` token dispatch over ep, or ``"deepep"``: DeepEP's intranode
            kernels (optional package built from source, docs/deepep.md; CUDA, bf16 activations, ep in (2, 4, 8) on
            one node, etp=1; each checked with an error naming the fix).
        reshard_after_forward: FSDP2 option.
        param_dtype, reduce_dtype: FSDP2 mixed precision (``"bf16"``, ``"fp32"``): the dtype parameters are
            all-gathered and computed in, and the dtype gradients are reduce-scattered in. None = the parameter dtype;
            ``reduce_dtype`` None is fp32 when the module keeps fp32 master weights
            (``MoELanguageModel(master_dtype="fp32")``, the one spelling of bf16 compute with fp32 master state on
            every layout). They act through FSDP2 only: a layout that applies FSDP2 to no parameter, or not to the
            routed experts (ep x etp = world size), refuses them with a ValueError.
        activation_checkpointing: ``"none"``, ``"full"`` (whole blocks) or a list of module kinds to recompute
            (``[norm, moe_act]``; a comma-separated string works too): ``norm``, ``attn_core``, ``moe_act``,
            ``experts``, ``shared_experts``, ``mla_up_proj``, optionally with ``full``. Communication is never
            recomputed (see :mod:`lightning_moe.parallel.recompute`).
        recompute_num_layers: with ``"full"``, recompute only the first n transformer blocks (Megatron's
            ``--recompute-method block --recompute-num-layers n``): memory and step time between none and full.
            None (default) = every block.
        compile: regional ``torch.compile`` (:mod:`lightning_moe.parallel.compile`): True for every region, or a
            list of ``"norm"``, ``"attention"``, ``"router"``, ``"mlp"``; the routed experts and the dispatch stay
            eager. Off by default (compilation takes a minute at the start of a run).
        save_distributed_checkpoint: one DCP shard per rank (True) or a full checkpoint file written by rank 0.
        async_save: distributed checkpoints saved during training are written in the background (DCP
            ``async_save``); training stalls only for the state-dict copy to the CPU. The checkpoint appears at its
            path (atomically, with its checksums) once written: at the next save, a load, or the end of fit.
        process_group_backend: None = nccl on CUDA, gloo on CPU.
        timeout: process group timeout.
        free_grads_after_step: set the gradients to None right after each optimizer step (True by default).
            Lightning zeroes them between the next forward and its backward, so without this the previous step's
            gradients (2 bytes a parameter in bf16) stay allocated through every forward, at the step's memory
            peak. Turn it off only if something reads ``.grad`` after the optimizer step.

    A distributed checkpoint's path is a symbolic link to its current version in ``.checkpoint_versions/`` next to
    it, swapped atomically by each save (:mod:`lightning_moe.checkpoint.publish`): a kill at any moment of a save
    leaves the previous checkpoint or the new one at the path, never a mix or nothing. Copy one with ``cp -rL``.
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
        activation_checkpointing: Union[str, list[str]] = "none",
        recompute_num_layers: Optional[int] = None,
        compile: Union[bool, str, list[str]] = False,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        free_grads_after_step: bool = True,
        **strategy_kwargs: Any,  # accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin
    ) -> None:
        strategy_kwargs.setdefault("checkpoint_io", SafeCheckpointIO())
        super().__init__(**strategy_kwargs)
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
        if dispatcher == "deepep":  # missing package or unsupported sizes: an error now, not after launch
            from lightning_moe.moe.dispatch.deepep import check_deepep_sizes, import_deep_ep

            import_deep_ep()
            check_deepep_sizes(ep, etp)
        ac_kinds = parse_activation_checkpointing(activation_checkpointing)  # ValueError naming the valid kinds
        check_recompute_num_layers(recompute_num_layers, ac_kinds)  # the block count is checked at parallelize
        self._sizes = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp)
        for name, v in self._sizes.items():
            if name == "dp_shard" and v in ("auto", -1):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        # (reshard_after_forward is FSDP2's, which also takes an int: left to FSDP2)
        check_flags("MoEParallelStrategy", save_distributed_checkpoint=save_distributed_checkpoint,
                    async_save=async_save, free_grads_after_step=free_grads_after_step)
        self._dispatcher = dispatcher
        self._reshard_after_forward = reshard_after_forward
        self._param_dtype = _dtype(param_dtype, "param_dtype")
        self._reduce_dtype = _dtype(reduce_dtype, "reduce_dtype")
        self._activation_checkpointing = ac_kinds
        self._recompute_num_layers = recompute_num_layers
        self._compile = resolve_compile(compile)
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._async_save = async_save
        self._pending_save: Optional[tuple[Any, Path, Path, dict[str, Any]]] = None
        self._gloo_group: Optional[Any] = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._free_grads_after_step = free_grads_after_step
        self._num_nodes = 1
        self._parallel_dims: Optional[ParallelDims] = None
        self._tp_sync_modules: list[nn.Module] = []
        self._batch_checked = False
        self._finalized_steps = 0  # finalize_step calls: optimizer_step checks that each step made one

    # ---- Lightning's strategy contract -------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:  # Lightning asks custom strategies this (sync_dist, distributed samplers)
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def compile_regions(self) -> tuple[str, ...]:
        """The regions regional ``torch.compile`` compiles (the ``compile`` argument resolved; empty: none)."""
        return self._compile

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is parallelised in setup: load into its shards

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers by parameter name

    @override
    def _configure_launcher(self) -> None:
        # Lightning's strategies choose their launcher by overriding this hook; there is no public one
        from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
            rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self.cluster_environment is not None and self.parallel_devices:
            # the Trainer's constructor gets here: a layout that cannot fit the world fails now, not after launch
            self._dims()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the accelerator sets up the device
        dims = self._dims()
        module = self.lightning_module
        if module is not None:
            # the model against the layout, before any process group is created
            dims.validate(requirements_of(module, type(self).__name__).config, seq_len=None)
        if self._dispatcher == "deepep" and dims.ep_enabled:
            self._check_deepep(dims)
        self._init_process_group()
        dims.build_meshes(self.root_device.type)
        self._parallel_dims = dims
        if module is not None:
            # LightningModule.device_mesh has no setter; Lightning's own ModelParallelStrategy sets it this way
            module._device_mesh = dims.dense_mesh

    def _check_deepep(self, dims: ParallelDims) -> None:
        """What DeepEP's intranode kernels need of the run, before any process group exists: CUDA devices, every ep
        group on one node, bf16 activations (the dispatcher checks the activations' dtype again at the first step)."""
        from lightning_moe.moe.dispatch.deepep import check_deepep_dtype, check_deepep_nodes

        if self.root_device.type != "cuda":
            raise RuntimeError(f"dispatcher='deepep' runs on CUDA GPUs, got {self.root_device.type} devices: use "
                               "dispatcher='alltoall' there")
        check_deepep_nodes(dims.rank_groups("ep"), self.num_processes)
        precision = getattr(self.precision_plugin, "precision", None)
        # the MoE layers' input: the parameters' dtype under "-true" precisions, else fp32 (autocast leaves the
        # residual stream in fp32); FSDP2's param_dtype casts both when given
        act = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}.get(precision,
                                                                                                   torch.float32)
        check_deepep_dtype(self._param_dtype or act,
                           what=f"activations (precision={precision!r}, param_dtype={self._param_dtype})")

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            return
        env = self.cluster_environment
        assert env is not None
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        dist.init_process_group(backend, rank=self.global_rank, world_size=self.world_size, **kwargs)
        if backend == "nccl":  # NCCL warns at exit about a process group that was never destroyed
            atexit.register(_destroy_process_group)

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The dense mesh (``dp_replicate, dp_shard, cp, tp``); :attr:`parallel_dims` has every view."""
        return self.parallel_dims.dense_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dims = self.parallel_dims
        # tp and cp peers read the same samples; ep never changes what a rank reads
        return {"num_replicas": dims.num_data_shards, "rank": dims.batch_rank(self.global_rank)}

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        requirements_of(self.lightning_module, type(self).__name__)  # also without setup_environment (tests)
        assert self.model is not None
        self.model_to_device()  # anything not built by the pipeline (e.g. a user's extra module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # the build pipeline puts the model on meta and materialises it itself: only the precision's dtype here
        with self.precision_plugin.tensor_init_context():
            yield

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return tensor
        mean = reduce_op is None or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"))
        if isinstance(reduce_op, str) and not mean:
            names = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            if reduce_op.lower() not in names:
                raise ValueError(f"reduce_op must be 'mean', 'sum', 'max' or 'min', got {reduce_op!r}")
            op = names[reduce_op.lower()]
        else:
            op = dist.ReduceOp.SUM if mean else reduce_op
        out = tensor.float().clone() if mean else tensor.clone()
        dist.all_reduce(out, op=op, group=group)
        return out / dist.get_world_size(group) if mean else out

    @override
    def teardown(self) -> None:
        """The end of a stage. The model and its optimizer state stay where they are, as under Lightning's
        ``ModelParallelStrategy``: the generic strategy's teardown moves both to the CPU, which with fp32 masters
        would copy about 14 bytes a parameter of every rank's shards into its host's memory (more RAM than a node
        may have), usually only for them to be dropped."""
        if self._pending_save is not None and dist.is_initialized():
            self.finish_pending_save()  # an asynchronous save still in flight becomes visible before the end
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---- the layout ----------------------------------------------------------------------------------------
    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError("the parallel layout exists once the processes are initialised (Trainer.fit)")
        return self._parallel_dims

    def _dims(self) -> ParallelDims:
        sizes = dict(self._sizes)
        if sizes["dp_shard"] == "auto":
            sizes["dp_shard"] = -1
        dims = ParallelDims(world_size=self.world_size, **sizes)
        check_fsdp_dtypes(dims, param_dtype=self._param_dtype, reduce_dtype=self._reduce_dtype)
        return dims

    def model_transforms(self) -> list[Callable[[nn.Module], Optional[nn.Module]]]:
        """The strategy's own step of the build pipeline's transforms: the precision plugin converts the meta
        model (a dtype cast under "bf16-true"; routing state stays fp32), before FSDP2 takes the parameters."""
        return [self.precision_plugin.convert_module]

    def parallelize_model(self, model: nn.Module) -> nn.Module:
        # fp32 master weights (the module's optimizer): their bf16 gradients are reduce-scattered in fp32
        module = self.lightning_module
        master = requirements_of(module, type(self).__name__).master_dtype if module is not None else None
        self._tp_sync_modules = parallelize(
            model,
            self.parallel_dims,
            dispatcher=self._dispatcher,
            activation_checkpointing=self._activation_checkpointing,
            recompute_num_layers=self._recompute_num_layers,
            param_dtype=self._param_dtype,
            reduce_dtype=self._reduce_dtype or master,
            reshard_after_forward=self._reshard_after_forward,
            compile=self._compile,
        )
        return model

    def reduce_token_sum(self, t: Tensor) -> Tensor:
        """Sum over the ranks holding distinct tokens of one micro-batch stream (dp_replicate x dp_shard x cp)."""
        dims = self.parallel_dims
        if dims.num_data_shards * dims.cp == 1:
            return t
        from lightning_moe.collectives import all_reduce

        return all_reduce(t, "sum", dims.dp_cp_mesh.get_group())

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a (labelled) batch: the load-balanced context-parallel chunks and their positions.
        The first batch is checked against the layout before any collective runs."""
        dims = self.parallel_dims
        if not self._batch_checked:
            _check_batch_layout(batch, dims, requirements_of(self.lightning_module, type(self).__name__).config)
            self._batch_checked = True
        if not dims.cp_enabled:
            return batch
        from lightning_moe.parallel.context_parallel import shard_batch_for_cp

        return shard_batch_for_cp(batch, dims.cp, dims.cp_mesh.get_local_rank())

    # ---- gradient finalisation -------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union["pl.LightningModule", nn.Module]] = None, **kwargs: Any) -> Any:
        finalized_before = self._finalized_steps

        def checked_closure() -> Any:
            out = closure()
            if self._finalized_steps == finalized_before:
                raise RuntimeError(
                    "MoEParallelStrategy: the optimizer step ran without gradient finalisation (the module must call "
                    "strategy.finalize_step after the backward, inside the optimizer closure). A LightningModule that "
                    "overrides optimizer_step must call super().optimizer_step(...)")
            return out

        out = super().optimizer_step(optimizer, checked_closure, model, **kwargs)
        if self._free_grads_after_step:
            # free them now rather than after the next forward (Lightning's zero_grad runs before the backward)
            optimizer.zero_grad(set_to_none=True)
        return out

    def finalize_step(self, record: StepRecord, **kwargs: Any) -> StepResult:
        """THE gradient-finalisation hook of a step (see :mod:`lightning_moe.parallel.finalize`): called by the
        module once per optimizer step, after the last backward and before any ``on_before_optimizer_step`` hook,
        with the step's record and what only the module knows (``parameters``, ``accumulate_grad_batches``,
        ``update_expert_bias``, ``skip_empty``, ``step``, ``tp_reduce_dtype``: :func:`finalize_step`'s keywords).
        The strategy adds its layout's reduction groups and the modules whose gradients need the tp sync.
        Collective."""
        dims = self.parallel_dims
        result = finalize_step(record, tp_sync_modules=self._tp_sync_modules,
                               tp_group=dims.tp_mesh.get_group() if dims.tp_enabled else None,
                               global_group=dims.global_group, **kwargs)
        self._finalized_steps += 1
        return result

    # ---- checkpoints ---------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict by parameter name: sharded DTensors (distributed checkpoint) or full tensors
        (on rank 0, ``save_distributed_checkpoint=False``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        opts = StateDictOptions(full_state_dict=not self._save_distributed_checkpoint, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint already loaded the weights into the shards

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state by parameter name (``{"state": {name: ...}, "param_groups": [...]}``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        assert self.model is not None
        opts = StateDictOptions(full_state_dict=not self._save_distributed_checkpoint, cpu_offload=True)
        return get_optimizer_state_dict(self.model, inner, options=opts)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint already restored the optimizers

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, Path],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        self.finish_pending_save()
        path = Path(self.broadcast(str(filepath)))
        if not self._save_distributed_checkpoint:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, path)
            self.barrier()
            return
        import torch.distributed.checkpoint as dcp

        if path.is_file():
            raise FileExistsError(f"{path} is a file; a distributed checkpoint is a directory: choose another path")
        # written into a new version directory and published by swapping the link at PATH (see the class docstring)
        staging = Path(self.broadcast(str(new_staging_dir(path)) if self.is_global_zero else None))
        tensors: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        groups = []
        for i, osd in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = {"state": osd["state"]}
            groups.append(osd["param_groups"])  # names and hyper-parameters: plain data, in the metadata file
        checkpoint["optimizer_param_groups"] = groups
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._async_save and trainer is not None and trainer.training:
            # the state is already on the CPU (cpu_offload in the state-dict calls): the files are written in the
            # background; the checkpoint appears at PATH once complete (at the next save or at the end of fit)
            future = dcp.async_save(tensors, checkpoint_id=str(staging), process_group=self._cpu_group())
            self._pending_save = (future, staging, path, checkpoint)
            return
        dcp.save(tensors, checkpoint_id=str(staging))
        self._complete_save(staging, path, checkpoint)

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        """ModelCheckpoint's removal of an old top-k or last checkpoint: a distributed one goes link and versions."""
        if self.is_global_zero and not remove(filepath):
            self.checkpoint_io.remove_checkpoint(filepath)

    def _cpu_group(self) -> Optional[Any]:
        """A group of its own for the background writer's collectives: they run on another thread while training
        issues its own (NCCL is for the training stream; one gloo group must not serve two threads at once)."""
        if self._gloo_group is None:
            self._gloo_group = dist.new_group(backend="gloo")
        return self._gloo_group

    def _complete_save(self, staging: Path, path: Path, checkpoint: dict[str, Any]) -> None:
        """Metadata file, checksum manifest, then the link swap that makes the checkpoint visible (collective)."""
        if self.is_global_zero:
            save_fsynced(checkpoint, staging / META_FILE)
        self.barrier()
        write_dir_checksums(staging, self.global_rank, self.world_size, self._all_gather_object)
        if self.is_global_zero:
            publish(staging, path)
        self.barrier()

    def finish_pending_save(self) -> None:
        """Wait for an asynchronous save in flight and make it visible (collective: every rank calls it). Called
        by the next save, by ``load_checkpoint`` and at teardown."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        future, staging, path, checkpoint = pending
        done = getattr(future, "upload_completion", future)  # torch >= 2.12 may return an AsyncSaveResponse
        done.result()
        self._complete_save(staging, path, checkpoint)

    def _all_gather_object(self, obj: Any) -> list[Any]:
        if not dist.is_initialized() or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load weights and optimizer states into this layout's shards by parameter name, from a distributed
        checkpoint (a directory, any layout) or a single file (e.g. written by one process); returns the rest of
        the checkpoint (loops, schedulers, callbacks, hyper-parameters) for Lightning."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self.finish_pending_save()
        path = Path(self.broadcast(str(resolve(checkpoint_path))))  # rank 0's view: one version on every rank
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        if not path.exists():
            raise FileNotFoundError(f"checkpoint not found: {path}")
        if path.is_dir():
            import torch.distributed.checkpoint as dcp

            verify_dir_checksums(path, self.global_rank, self.world_size, self._all_gather_object)
            meta = torch.load(path / META_FILE, weights_only=True, map_location="cpu")
            template = get_model_state_dict(self.model)
            saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            check_shapes({k: tuple(v.shape) for k, v in template.items()},
                         {k.removeprefix("state_dict."): tuple(m.size) for k, m in saved.items()
                          if k.startswith("state_dict.") and hasattr(m, "size")}, str(path), strict=strict)
            state: dict[str, Any] = {"state_dict": template}
            for i, opt in enumerate(optimizers):
                state[f"optimizer_{i}"] = {"state": get_optimizer_state_dict(self.model, opt)["state"]}
            if not optimizers:
                state = {"state_dict": state["state_dict"]}
            dcp.load(state, checkpoint_id=str(path))
            set_model_state_dict(self.model, state["state_dict"], options=StateDictOptions(strict=strict))
            saved_groups = meta.pop("optimizer_param_groups", [])
            for i, opt in enumerate(optimizers):
                osd = {"state": state[f"optimizer_{i}"]["state"],
                       "param_groups": regroup(saved_groups[i], opt, self.model)}
                set_optimizer_state_dict(self.model, opt, osd)
            return meta
        ckpt = self.checkpoint_io.load_checkpoint(path) if isinstance(self.checkpoint_io, SafeCheckpointIO) else (
            torch.load(path, weights_only=True, map_location="cpu"))
        check_shapes({k: tuple(v.shape) for k, v in get_model_state_dict(self.model).items()},
                     {k: tuple(v.shape) for k, v in ckpt["state_dict"].items()}, str(path), strict=strict)
        full = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, dict(ckpt.pop("state_dict")), options=full)  # a copy: set_* rewrites it
        for opt, osd in zip(optimizers, ckpt.pop("optimizer_states", [])):
            if not is_by_name(osd):
                raise ValueError(f"{path}: its optimizer state is keyed by position, not by parameter name; it was "
                                 "not written by lightning_moe and cannot be mapped onto this layout")
            osd = {"state": dict(osd["state"]), "param_groups": regroup(osd["param_groups"], opt, self.model)}
            set_optimizer_state_dict(self.model, opt, osd, options=full)
        return ckpt


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _check_batch_layout(batch: Mapping[str, Any], dims: ParallelDims, config: "ModelConfig") -> None:
    """The first batch against the layout: its sequence length (cp chunks, sequence-parallel split) and, for
    pad_to_capacity under ep, that it holds as many tokens as every other rank's will."""
    ids = batch["input_ids"]
    seq_len = int(ids.shape[1])
    dims.validate(seq_len=seq_len)
    if seq_len > config.max_seq_len:
        raise ValueError(f"the batch's sequence length {seq_len} exceeds the model's max_seq_len="
                         f"{config.max_seq_len}: lower the data's seq_len or raise max_seq_len")
    if config.moe.pad_to_capacity and dims.ep_enabled:
        # static all-to-all splits: every rank of the ep group must route the same number of tokens
        tokens = torch.tensor([ids.numel()], device=ids.device)
        group = dims.ep_mesh.get_group()
        gathered = [torch.empty_like(tokens) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tokens, group=group)
        counts = [int(t) for t in gathered]
        if len(set(counts)) > 1:
            raise ValueError(
                f"moe.pad_to_capacity under ep={dims.ep} needs the same number of tokens on every rank, but the "
                f"ranks of this ep group hold {counts}: use equal micro-batches (drop_last=True) or set "
                "pad_to_capacity=False"
            )


StrategyRegistry.register(
    MoEParallelStrategy.strategy_name,
    MoEParallelStrategy,
    description="MoE Parallel Folding (lightning_moe): FSDP2/HSDP, TP+SP, CP, EP/ETP on one world",
)
