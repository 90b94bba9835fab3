"""Attach a parallel layout to a single-device MoETransformer, from outside (DESIGN invariant 1).

``parallelize`` applies, in order: tensor parallelism with sequence parallel (``apply_tp``), context parallelism
(``apply_cp``), expert parallelism and expert tensor parallelism (``apply_ep``), the router's reduction groups
(``apply_router_groups``), activation checkpointing of whole blocks or selected regions (``apply_ac``), regional torch.compile (``apply_compile``) and FSDP2 on the dense and expert meshes
(``apply_fsdp``, last). Each is a small free function with explicit mesh arguments. Works on a meta-device model:
the caller materialises (``to_empty``) and initialises afterwards.

Under sequence parallel every tensor-parallel rank keeps its own distinct tokens through the MoE layer (no
all-gather before routing); parameters that are replicated over tp but fed those distinct tokens (router weights,
shared experts, per-head qk norms) need their gradients summed over tp: ``parallelize`` returns them so the
strategy can do that once per optimizer step. MLA splits its heads after the low-rank projections: the latent
down-projections and norms run whole on the gathered sequence of every tp rank and get the full gradient there
(the column-parallel up-projections sum their input gradients over tp; a hook does it for the shared RoPE key).
Padded batches: the attention sees the whole (gathered) sequence and its key padding mask; the MoE layer's padding
mask is cut over tp like its tokens.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_moe.activation_plan import plan_activations
from lightning_moe.models.transformer import MLAttention, MoETransformer
from lightning_moe.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher, DeepEPDispatcher
from lightning_moe.parallel.compile import apply_compile
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.layout import (AC_MODES, DISPATCHERS, TP_COLWISE, TP_ROWWISE, check_recompute_num_layers,
                                          parse_activation_checkpointing)
from lightning_moe.parallel.recompute import apply_recompute
from lightning_moe.parallel.vocab_parallel_loss import VocabParallelLoss



def apply_tp(model: MoETransformer, tp_mesh: DeviceMesh) -> list[nn.Module]:
    """Megatron-style TP with sequence parallel on embeddings, attention (GQA, or MLA with heads split after its
    latent projections), dense MLPs and the LM head (split over the vocabulary, with the vocab-parallel loss).
    Returns the modules whose own parameters are tp-replicated but
    fed distinct tokens or heads: their gradients must be summed over tp (modules, not parameters: FSDP later swaps
    the parameter objects). Decided by placement, whatever the module's class: every parameter the plan leaves a plain
    tensor (not a DTensor over tp), except the routed experts' (the expert mesh reduces them) and those the plan
    runs whole on every tp rank (MLA's latent path, before its heads split)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    cfg = model.config
    # ParallelDims.validate rejects qk_norm="full" with tp > 1 with the fix; here it is an invariant
    assert cfg.qk_norm != "full", "layout not validated by ParallelDims"
    top_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    }
    if model.output is not None:  # tied embeddings: the LM head is the (row-parallel) embedding's weight
        # vocab-sharded logits, never gathered by the plan: the loss runs on each rank's vocabulary shard
        # (VocabParallelLoss, below) and MoETransformer.logits gathers only when logits are asked for
        top_plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top_plan)
    # the LM head's weight (the output projection's, or the tied embedding's) is Shard(0) over tp either way
    model.lm_loss = VocabParallelLoss(tp_mesh)
    not_synced: set[nn.Module] = set()
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            "ffn_norm": SequenceParallel(),
        }
        if block.is_moe:
            # the MoE layer works on this rank's own sequence shard: hand it the local tensor (its padding mask is
            # cut the same way by the hook below)
            plan["moe"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Shard(1), None), use_local_output=True
            )
            not_synced.update(block.moe.experts.modules())
        else:
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        # the split modules: parallel.layout's tables (plan counts per-GPU bytes from the same tables), those this
        # block has (GQA or MLA projections; dense MLP or not)
        for name in TP_COLWISE:
            if _has_submodule(block, name):
                plan[name] = ColwiseParallel()
        for name in TP_ROWWISE:
            if _has_submodule(block, name):
                plan[name] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(block, tp_mesh, plan)
        if block.is_moe:
            block.moe.register_forward_pre_hook(_shard_padding_mask_hook(tp_mesh))
        attn = block.attention
        if isinstance(attn, MLAttention):
            attn.wkv_a.register_forward_hook(_mla_shared_key_hook(attn.kv_lora_rank, tp_mesh))
            # the latent projections and norms run on the gathered sequence and the up-projections sum their input
            # gradients over tp: every tp rank holds their full gradient already
            not_synced.update(attn.modules())
    return [m for m in model.modules() if m not in not_synced
            and any(not isinstance(p, DTensor) for p in m.parameters(recurse=False))]


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _sum_grad_over(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """Identity forward; the backward sums the gradient over ``mesh`` (Megatron's copy to the tensor-parallel region)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _mla_shared_key_hook(kv_lora_rank: int, tp_mesh: DeviceMesh) -> Callable:
    """Forward hook on MLA's ``wkv_a`` under tp: its output is [c_kv | k_pe], computed whole on every tp rank. c_kv
    feeds the column-parallel ``wkv_b``, whose input gradient DTensor already sums over tp; k_pe, the RoPE key shared
    by all heads, is used by this rank's heads only, so its gradient is summed over tp here. Every tp rank then
    holds the full gradient of ``wkv_a`` and of the attention input, as their replicated layout requires."""

    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        c_kv, k_pe = out.split([kv_lora_rank, out.shape[-1] - kv_lora_rank], dim=-1)
        return torch.cat([c_kv, _sum_grad_over(k_pe, tp_mesh)], dim=-1)

    return hook


def _shard_padding_mask_hook(tp_mesh: DeviceMesh) -> Callable:
    """Forward pre-hook on an MoE layer under sequence parallel (after its PrepareModuleInput): the padding mask
    [B, S], the same on every tp rank, is cut like the activations (Shard(1) over tp), so each rank's router sees
    the mask of its own tokens."""

    def hook(module: nn.Module, args: tuple) -> Optional[tuple]:
        if len(args) < 2 or args[1] is None:
            return None
        mask = DTensor.from_local(args[1], tp_mesh, [Replicate()], run_check=False)
        return (args[0], mask.redistribute(placements=[Shard(1)]).to_local(), *args[2:])

    return hook


def apply_cp(model: MoETransformer, cp_mesh: DeviceMesh) -> None:
    """Context parallel attention: all-gather K/V over cp on load-balanced causal chunks (works on gloo and NCCL)."""
    from lightning_moe.parallel.context_parallel import AllGatherKVAttention

    core = AllGatherKVAttention(cp_mesh.get_group())
    for block in model.layers.values():
        block.attention.core_attention = core
    model.build_document_mask = core.document_mask  # packed batches: document ids gathered once per forward


def _shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placements: list) -> None:
    """Replace a (meta or real) parameter by a DTensor with the given placements, without communication:
    every rank slices its own shard (the tensor is the same global tensor on every rank)."""
    p = getattr(module, name)
    assert not isinstance(p, DTensor), f"{name} is already distributed"
    dt = torch.distributed.tensor.distribute_tensor(p.detach(), mesh, placements, src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def apply_ep(model: MoETransformer, dims: ParallelDims, dispatcher: str = "alltoall") -> None:
    """Expert weights become DTensors Shard(0) over ep (and split along F over etp); the MoE layers get a
    distributed dispatcher over the expert mesh's ep (and etp) groups. ``"deepep"`` (optional, DeepEP's intranode
    kernels): RuntimeError without the package or CUDA, ValueError for etp > 1 or ``pad_to_capacity`` (its static
    splits have no meaning there)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    if not (dims.ep_enabled or dims.etp_enabled):
        return
    if dispatcher == "deepep" and model.config.moe.pad_to_capacity:
        raise ValueError("moe.pad_to_capacity pads the all-to-all to static split sizes; DeepEP sizes its transfers "
                         "itself: set pad_to_capacity=False with dispatcher='deepep' (capacity dropping still works)")
    if dims.etp_enabled:
        mesh = dims.expert_mesh["ep", "etp"]
        w13, w2 = [Shard(0), Shard(1)], [Shard(0), Shard(2)]
    else:
        mesh = dims.expert_mesh["ep"]
        w13, w2 = [Shard(0)], [Shard(0)]
    ep_group = dims.expert_mesh.get_group("ep")
    etp_group = dims.expert_mesh.get_group("etp") if dims.etp_enabled else None
    for layer in model.moe_layers():
        _shard_param(layer.experts, "w1", mesh, w13)
        _shard_param(layer.experts, "w3", mesh, w13)
        _shard_param(layer.experts, "w2", mesh, w2)
        if dispatcher == "alltoall":
            layer.replan(dispatcher=AllToAllDispatcher(ep_group, etp_group,
                                                       pad_to_capacity=layer.config.pad_to_capacity))
        elif dispatcher == "deepep":
            layer.replan(dispatcher=DeepEPDispatcher(ep_group, etp_group))
        else:
            layer.replan(dispatcher=AllGatherDispatcher(ep_group, etp_group))


def apply_router_groups(model: MoETransformer, dims: ParallelDims) -> None:
    """Reduction groups for the routers' loss normalisers and bias counts (None on one process)."""
    for layer in model.moe_layers():
        layer.router.token_group = dims.token_group
        layer.router.global_group = dims.global_group
        layer.router.num_data_shards = dims.num_data_shards


def apply_ac(model: MoETransformer, mode: Union[str, Sequence[str]] = "full",
             num_layers: Optional[int] = None) -> None:
    """Activation checkpointing, planned into each module's activation plan (:mod:`lightning_moe.activation_plan`;
    state-dict keys unchanged): ``"full"`` recomputes whole transformer blocks; a list of kinds recomputes only those
    collective-free regions (:mod:`lightning_moe.parallel.recompute`); both may be combined. ``num_layers``: with
    ``"full"``, recompute only the first n blocks (Megatron's ``--recompute-method block --recompute-num-layers n``), the dial between no and full
    recomputation; the selected kinds still apply to every block. ValueError for unknown kinds, or a
    ``num_layers`` without ``"full"`` or outside 1..number of blocks."""
    kinds = parse_activation_checkpointing(mode)
    check_recompute_num_layers(num_layers, kinds, len(model.layers))
    apply_recompute(model, [k for k in kinds if k != "full"])
    if "full" not in kinds:
        return
    blocks = list(model.layers.values())
    for block in blocks[: len(blocks) if num_layers is None else num_layers]:
        plan_activations(block, recompute=["forward"])


def _expert_shard_placement(experts: nn.Module, edp: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP shard dim of the routed-expert weights: the local-expert dim when the local experts split evenly over
    the edp ranks, else the hidden dim D (w1/w3 [e, F, D]: dim 2; w2 [e, D, F]: dim 1), so no rank is left without
    a shard (e.g. Mixtral's 8 experts over 16 ranks with ep=1)."""
    w2 = experts.w2
    local_experts = (w2.to_local() if isinstance(w2, DTensor) else w2).shape[0]
    even = local_experts % edp == 0

    def placement(param: nn.Parameter) -> Shard:
        if even:
            return Shard(0)
        return Shard(1) if param is w2 else Shard(2)

    return placement


def apply_fsdp(
    model: MoETransformer,
    dense_mesh: Optional[DeviceMesh],
    expert_mesh: Optional[DeviceMesh],
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
) -> None:
    """FSDP2 per block on the dense mesh (HSDP when 2-D), routed experts on their own (expert) mesh first, the
    root last. Gradient division is off: the loss is normalised by the global token count (invariant 4)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    edp = expert_mesh.size(expert_mesh.ndim - 1) if expert_mesh is not None else 1  # HSDP: the inner dim shards
    for block in model.layers.values():
        ignored: set[nn.Parameter] = set()
        if block.is_moe:
            if expert_mesh is not None:
                fully_shard(block.moe.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                            shard_placement_fn=_expert_shard_placement(block.moe.experts, edp))
            elif any(isinstance(p, DTensor) for p in block.moe.experts.parameters()):
                # experts split over every rank (ep x etp = W): nothing to shard or reduce, and their ep mesh
                # must not meet the dense mesh in one FSDP group
                ignored = set(block.moe.experts.parameters())
            if dense_mesh is not None:
                # the router stays fp32 (its own FSDP group: one group cannot mix parameter dtypes under bf16-true,
                # and a bf16 all-gather would round its weight)
                # (kept gathered from forward to backward: E x D is small, and it spares one all-gather)
                fully_shard(block.moe.router, mesh=dense_mesh, mp_policy=fp32, reshard_after_forward=False)
        if dense_mesh is not None:
            fully_shard(block, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                        ignored_params=ignored or None)
    if dense_mesh is not None:
        fully_shard(model, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # plain SUM collectives (gloo has no PREMUL_SUM; a factor of 1 needs no pre-multiplication anyway)
            m.set_force_sum_reduction_for_comms(True)


def fsdp_meshes(dims: ParallelDims) -> tuple[Optional[DeviceMesh], Optional[DeviceMesh]]:
    """The meshes FSDP2 shards over (dense, routed experts), None where the layout has no data-parallel replicas to
    sum gradients over (one device; experts split over every rank). Meshes must exist (after build_meshes)."""
    dense = dims.fsdp_mesh() if _fsdp_dense(dims) else None
    expert = dims.expert_fsdp_mesh() if _fsdp_experts(dims) else None
    return dense, expert


def _fsdp_dense(dims: ParallelDims) -> bool:
    return dims.dp_replicate * dims.dp_shard * dims.cp > 1


def _fsdp_experts(dims: ParallelDims) -> bool:
    return dims.dp_replicate * dims.edp_shard > 1


def check_fsdp_dtypes(dims: ParallelDims, *, param_dtype: Optional[torch.dtype],
                      reduce_dtype: Optional[torch.dtype]) -> None:
    """FSDP2's mixed-precision dtypes act only on the parameters FSDP2 holds: a layout where some parameters are not
    under FSDP2 would silently ignore them there. ValueError naming the fix (before any process group exists)."""
    if param_dtype is None and reduce_dtype is None:
        return
    missing = []
    if not _fsdp_dense(dims):
        missing.append("the dense parameters (dp_replicate x dp_shard x cp = 1)")
    if not _fsdp_experts(dims):
        missing.append(f"the routed experts (ep x etp = {dims.ep * dims.etp} = the world size)")
    if not missing:
        return
    given = ", ".join(f"{n}={d}" for n, d in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)) if d)
    raise ValueError(
        f"{given}: FSDP2 mixed precision acts on the parameters FSDP2 shards, and this layout does not shard "
        f"{' nor '.join(missing)}, so the setting would be ignored there. For bf16 compute with fp32 master weights and moments on any layout use "
        "precision='bf16-true' with MoELanguageModel(master_dtype='fp32') (its gradients are reduced in fp32 where "
        "they are reduced); for plain bf16 use precision='bf16-true' alone"
    )


def parallelize(
    model: MoETransformer,
    dims: ParallelDims,
    *,
    dispatcher: str = "alltoall",
    activation_checkpointing: Union[str, Sequence[str]] = "none",
    recompute_num_layers: Optional[int] = None,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    compile: Union[bool, str, Sequence[str], None] = False,
) -> list[nn.Module]:
    """Apply the layout in ``dims`` to ``model`` in place. Returns the modules whose parameters' gradients must be
    summed over the tp group before the optimizer step. Idempotent: a second call returns the same list."""
    done = getattr(model, "_lightning_moe_tp_sync", None)
    if done is not None:
        return done
    dims.validate(model.config)
    sync: list[nn.Module] = []
    if dims.tp_enabled:
        sync = apply_tp(model, dims.tp_mesh)
    if dims.cp_enabled:
        apply_cp(model, dims.cp_mesh)
    apply_ep(model, dims, dispatcher)
    apply_router_groups(model, dims)
    apply_ac(model, activation_checkpointing, recompute_num_layers)
    apply_compile(model, compile)
    # data-parallel replicas of a parameter need FSDP (sharding and/or HSDP replication) to sum its gradient
    dense, expert = fsdp_meshes(dims)
    if dense is not None or expert is not None:
        apply_fsdp(model, dense, expert, param_dtype, reduce_dtype, reshard_after_forward)
    model._lightning_moe_tp_sync = sync
    return sync
