"""Gradient utilities across meshes: global-norm clipping, gradient scaling, and gradient all-reduce.

Why this module exists (DESIGN.md, invariants 4-6): dense parameters are DTensors on the dense mesh (FSDP2
``Shard(0)`` over ``dp_shard_cp``, TP placements over ``tp``) while routed experts are DTensors on the separate
expert mesh (``Shard(0)`` over ``ep``, FSDP over ``edp_shard``), and some parameters may be plain tensors. Clipping
must see every parameter once and clip everything by one global norm. ``torch.nn.utils.clip_grad_norm_`` cannot do
that: it stacks the per-parameter norms, and DTensor refuses to stack operands that live on different meshes
("All operands in aten.stack.default must have the same mesh").

Functions
---------
:func:`global_norm` / :func:`global_grad_norm`
    The true p-norm (p > 0 finite, or ``inf``) of the *logical* (unsharded) tensors, each counted once, as an
    fp32 scalar tensor that is identical on every rank. Plain tensors are taken as replicated on every rank.
:func:`clip_grad_norm_`
    ``global_grad_norm`` and then every gradient (its local shard for DTensors) multiplied in place by
    ``clamp(max_norm / (total + 1e-6), max=1)``; no host sync; returns the pre-clip norm.
:func:`scale_grads_`
    Multiply every gradient (local shard) by a scalar or 0-dim tensor, e.g. ``1 / step_tokens`` (invariant 4).
:func:`all_reduce_grads`
    Sum the local gradients of some parameters over a process group in place, bucketed per (device, dtype): for
    parameters replicated across tensor-parallel ranks that see different tokens (router under sequence parallel).

Reduction strategy of the norm
------------------------------
For each gradient, the local statistic is ``sum |g_local|^p`` (or ``max |g_local|`` for ``inf``), computed in fp32.
A DTensor gradient's local shards are disjoint pieces of the logical tensor along its non-``Replicate`` mesh dims
and identical copies along its ``Replicate`` dims, so the logical statistic is the sum (max) of the local
statistics over exactly the mesh dims whose placement shards (``Shard``, and ``_StridedShard`` which FSDP2 + TP on
the same tensor dim produce; any placement that is neither ``Replicate`` nor ``Partial`` is treated as a shard).

* Gradients are grouped by ``(mesh, shard dims)``; each group's local statistics are added (maxed) into one scalar,
  and that scalar is all-reduced (``SUM`` or ``MAX``) once per shard dim, on ``mesh.get_group(dim)``. Reducing
  over the dims one after the other covers the product of those dims (sum and max are associative and the dims
  are orthogonal), so a ``(Shard, Shard)`` group costs two 4-byte all-reduces. Size-1 dims are skipped. Plain
  tensors and all-``Replicate`` DTensors need no collective.
* Why per-dim groups and not a flattened group: ``mesh.get_group(dim)`` is public, exists for every mesh, and costs
  no group creation, whereas flattening (``DeviceMesh._flatten``) is private API and creates process groups (a
  collective call on every rank of the mesh) the first time a dim combination is seen. The groups of a clip
  are scalars, so the cost is latency: ``sum over groups of (#shard dims)`` tiny all-reduces, typically 2-4
  per step (dense FSDP dim, tp dim, expert ep dim, expert FSDP dim).
* Why not one all-reduce over the world with each local statistic divided by its replica count: that assumes
  every mesh spans exactly the world, and the division makes the result depend on rounding.
* Groups are keyed by the mesh *value* (``DeviceMesh.__eq__``: rank layout, dim names, device type), which is the
  same on every rank, and visited in order of first appearance. This keeps the sequence of collectives identical
  on all ranks as long as every rank passes the same parameters (SPMD), with the same grads being ``None``.
  Keying on process-group identity could merge more groups but could order collectives differently per rank.
* The group results are combined in the same order on every rank, after the reductions, so the final value is
  identical on every rank (replicated copies of a shard are assumed identical, as DTensor requires).

``Partial`` gradient placements should not occur (FSDP2 reduce-scatters to ``Shard``; DDP-like replicate
all-reduces). If one does, summing ``|g|^p`` over the partial ranks would be *wrong* (the norm of a sum is not
the sum of norms), so the gradient is first redistributed to ``Replicate`` along its ``Partial`` dims (one
collective per such parameter, on a temporary; ``.grad`` is left as it is). Clipping a ``Partial`` gradient by
scaling every rank's partial value scales the logical sum, so it stays correct.

Non-finite gradients: the norm is returned as it is (``nan`` or ``inf``) and, as in
``torch.nn.utils.clip_grad_norm_``, the gradients are still multiplied by the coefficient (``nan``, or 0 for an
infinite norm), so the caller decides (skip the step, raise, lower the learning rate). ``error_if_nonfinite=True``
raises instead (that costs a host sync).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["global_norm", "global_grad_norm", "clip_grad_norm_", "scale_grads_", "all_reduce_grads"]

TensorOrTensors = Union[torch.Tensor, Iterable[torch.Tensor]]

_EPS = 1e-6  # as in torch.nn.utils.clip_grad_norm_


def _as_list(tensors: TensorOrTensors) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return list(tensors)


def _grads(parameters: TensorOrTensors) -> list[torch.Tensor]:
    return [p.grad for p in _as_list(parameters) if p.grad is not None]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor (no autograd: call under ``torch.no_grad``) of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not (math.isinf(p) and p > 0) and not (math.isfinite(p) and p > 0):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


def _use_foreach(tensors: list[torch.Tensor], foreach: Optional[bool]) -> bool:
    if foreach is not None:
        return foreach
    return all(t.device.type in ("cpu", "cuda") for t in tensors)


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def _local_stat(tensors: list[torch.Tensor], p: float, device: torch.device, foreach: Optional[bool]) -> torch.Tensor:
    """fp32 scalar on ``device``: sum of |t|^p over all tensors (max |t| for p = inf). Empty tensors count 0."""
    tensors = [t for t in tensors if t.numel() > 0]  # inf-norm of an empty tensor has no identity in torch
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms: list[torch.Tensor] = []
    for (dev, _), ts in _by_device_dtype(tensors).items():
        if _use_foreach(ts, foreach):
            ns = torch._foreach_norm(ts, p, dtype=torch.float32)
        else:
            ns = [torch.linalg.vector_norm(t, p, dtype=torch.float32) for t in ts]
        norms.extend(n.to(device) for n in ns)
    stacked = torch.stack(norms)
    if math.isinf(p):
        return stacked.max()
    return stacked.square().sum() if p == 2.0 else stacked.pow(p).sum()


def _reduce_device(mesh: DeviceMesh, fallback: torch.device) -> torch.device:
    """Device a collective on ``mesh`` runs on: the local tensors' device unless it is of another type (CPU offload)."""
    if fallback.type == mesh.device_type:
        return fallback
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _resolve_partial(g: DTensor) -> DTensor:
    """Redistribute ``Partial`` dims to ``Replicate`` (on a new tensor) so local statistics can be combined."""
    placements = tuple(Replicate() if pl.is_partial() else pl for pl in g.placements)
    return g.redistribute(g.device_mesh, placements)


def global_norm(tensors: TensorOrTensors, norm_type: float = 2.0, *, foreach: Optional[bool] = None) -> torch.Tensor:
    """p-norm of the logical tensors ``tensors`` (plain tensors and DTensors on any meshes), each counted once.

    Returns an fp32 0-dim tensor, identical on every rank, on the device of the first tensor's local data.
    Every rank must call it with the same tensors (SPMD): it issues collectives on the DTensors' meshes.
    See the module docstring for the reduction strategy.
    """
    p = _check_norm_type(norm_type)
    tensors = _as_list(tensors)
    with torch.no_grad():
        if not tensors:
            return torch.zeros((), dtype=torch.float32)
        out_device = _local(tensors[0]).device
        plain: list[torch.Tensor] = []
        groups: dict[tuple[DeviceMesh, tuple[int, ...]], list[torch.Tensor]] = {}
        for t in tensors:
            if not isinstance(t, DTensor):
                plain.append(t)
                continue
            if any(pl.is_partial() for pl in t.placements):
                t = _resolve_partial(t)
            shard_dims = tuple(d for d, pl in enumerate(t.placements) if not pl.is_replicate())
            if not shard_dims:  # replicated everywhere: counted once, like a plain tensor
                plain.append(t.to_local())
                continue
            groups.setdefault((t.device_mesh, shard_dims), []).append(t.to_local())

        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        total = _local_stat(plain, p, out_device, foreach)
        for (mesh, shard_dims), locals_ in groups.items():
            dev = _reduce_device(mesh, locals_[0].device)
            stat = _local_stat(locals_, p, dev, foreach)
            for d in shard_dims:
                if mesh.size(d) > 1:
                    dist.all_reduce(stat, op=op, group=mesh.get_group(d))
            stat = stat.to(out_device)
            total = torch.maximum(total, stat) if math.isinf(p) else total + stat
        if math.isinf(p):
            return total
        return total.sqrt() if p == 2.0 else total.pow(1.0 / p)


def global_grad_norm(
    parameters: TensorOrTensors, norm_type: float = 2.0, *, foreach: Optional[bool] = None
) -> torch.Tensor:
    """p-norm (2 or inf, any p > 0) of the full gradient over every parameter counted once, across all meshes.

    ``parameters`` may mix plain tensors (replicated on every rank) and DTensors on different meshes; parameters
    whose ``.grad`` is ``None`` are skipped. Returns an fp32 0-dim tensor, identical on every rank.
    """
    return global_norm(_grads(parameters), norm_type, foreach=foreach)


def _mul_(tensors: list[torch.Tensor], factor: torch.Tensor, foreach: Optional[bool]) -> None:
    for (dev, _), ts in _by_device_dtype(tensors).items():
        f = factor.to(dev)
        if _use_foreach(ts, foreach):
            torch._foreach_mul_(ts, f)
        else:
            for t in ts:
                t.mul_(f)


def scale_grads_(
    parameters: TensorOrTensors, scale: Union[float, torch.Tensor], *, foreach: Optional[bool] = None
) -> None:
    """Multiply every gradient in place by ``scale`` (a number or a 0-dim tensor; no host sync).

    DTensor gradients are scaled through their local tensors, so parameters may live on any number of meshes.
    """
    with torch.no_grad():
        local = [_local(g) for g in _grads(parameters)]
        if not local:
            return
        factor = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale), dtype=torch.float32)
        _mul_(local, factor, foreach)


def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    foreach: Optional[bool] = None,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (plain tensors and DTensors on any meshes) by one global norm.

    Computes :func:`global_grad_norm`, then multiplies every gradient (its local tensor for DTensors) in place by
    ``clamp(max_norm / (total + 1e-6), max=1.0)``, kept as a tensor (no host sync). Returns the pre-clip norm
    (fp32, identical on every rank). A non-finite norm is returned as it is and the gradients are still multiplied
    (by ``nan``, or by 0 for ``inf``), as torch does; pass ``error_if_nonfinite=True`` to raise instead.
    """
    grads = _grads(parameters)
    total = global_norm(grads, norm_type, foreach=foreach)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot be "
            "clipped; call with error_if_nonfinite=False to get the norm back and decide (e.g. skip the step)"
        )
    if not grads:
        return total
    with torch.no_grad():
        coef = torch.clamp(max_norm / (total + _EPS), max=1.0)
        _mul_([_local(g) for g in grads], coef, foreach)
    return total


def _group_of(group: Union[ProcessGroup, DeviceMesh, None]) -> Optional[ProcessGroup]:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"all_reduce_grads needs a 1-D mesh or a process group, got a {group.ndim}-D mesh")
        return group.get_group()
    return group


def all_reduce_grads(
    parameters: TensorOrTensors,
    group: Union[ProcessGroup, DeviceMesh, None],
    *,
    bucket_bytes: int = 256 * 2**20,
    reduce_dtype: Optional[torch.dtype] = None,
) -> None:
    """Sum the local gradients of ``parameters`` over ``group`` in place (``None``: the default group), in
    ``reduce_dtype`` (None: the gradients' own dtype; fp32 sums bf16 gradients without rounding every partial sum).

    For parameters that are replicated across some ranks (e.g. tensor-parallel peers) but were fed different
    tokens (the router under sequence parallel): their gradients must be summed over those ranks. DTensor
    gradients are reduced through their local tensors. Gradients are flattened per (device, dtype) into buckets
    of at most ``bucket_bytes`` (a single larger gradient gets a bucket of its own), one ``all_reduce`` per bucket,
    and copied back; a lone contiguous gradient is reduced in place without a copy. Parameters without a gradient
    are skipped (every rank must skip the same ones). Without an initialised process group, or on a group of
    one rank, nothing is done.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    pg = _group_of(group)
    if dist.get_world_size(pg) == 1:
        return
    with torch.no_grad():
        local = [_local(g) for g in _grads(parameters)]
        for ts in _by_device_dtype(local).values():
            buckets: list[list[torch.Tensor]] = [[]]
            size = 0
            for t in ts:
                nbytes = t.numel() * t.element_size()
                if buckets[-1] and size + nbytes > bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append(t)
                size += nbytes
            for bucket in buckets:
                cast = reduce_dtype is not None and reduce_dtype != bucket[0].dtype
                if len(bucket) == 1 and bucket[0].is_contiguous() and not cast:
                    dist.all_reduce(bucket[0], group=pg)
                    continue
                flat = torch.cat([t.reshape(-1).to(reduce_dtype) if cast else t.reshape(-1) for t in bucket])
                dist.all_reduce(flat, group=pg)
                for t, reduced in zip(bucket, flat.split([t.numel() for t in bucket])):
                    t.copy_(reduced.view_as(t))
