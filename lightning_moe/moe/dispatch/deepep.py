"""DeepEP token dispatch, an optional backend: ``DeepEPDispatcher`` moves tokens over ``ep`` with DeepEP's legacy
(V1) ``deep_ep.Buffer`` normal kernels, intranode (NVLink), behind the :class:`TokenDispatcher` contract.

Legend as in :mod:`lightning_moe.moe.dispatch.alltoall`; N: rows this rank receives (one per source token that chose at
least one of its experts, however many), a: ``expert_alignment``.

DeepEP moves TOKENS, not assignments: a token that chose several experts of one rank travels to it once, with its
top-k ids rewritten to that rank's local ids (-1 for experts elsewhere) and its weights (0 for those). The receiving
rank expands its N rows into the expert-grouped rows every dispatcher returns, with the same gather-only permute
as the other dispatchers, and sums them back per received row before DeepEP's combine adds up the ranks' partial
outputs on the token's owner::

    x_TD --Buffer.dispatch--> x_ND, ids_NK (local, -1), w_NK (0 off this rank) --permute--> x_RD by local expert
    y_RD --unpermute (weights w_NK; none if the experts applied them)--> y_ND --Buffer.combine (sum over ranks)--> y_TD

Inside a local expert the rows keep DeepEP's receive order (source rank, then token), as the all-to-all
dispatcher's do. With ``expert_alignment`` a > 1 every expert's row count is rounded up to a multiple of a (DeepEP
reports the aligned counts) and the extra rows are zero rows the combine never reads (for kernels that want
aligned groups; the low-precision grouped GEMMs pad by themselves).

Backward (the autograd functions below, as Megatron-Core's ``fused_a2a.FusedDispatch`` / ``FusedCombine``): the
dispatch's backward is ``Buffer.combine`` of the received rows' gradients (and of their weights' gradients: DeepEP's
combine sums top-k weights over ranks as well); the combine's backward is ``Buffer.dispatch`` of the output
gradient with the dispatch's cached handle. One host sync per dispatch, inside DeepEP (the CPU waits for the
received counts, as the all-to-all dispatcher does).

Mirrored API: DeepEP commit ``567632d`` (:data:`DEEPEP_COMMIT`, the last V1-only commit), ``deep_ep/buffer.py``
``class Buffer`` (the same class is ``deep_ep.buffers.legacy.Buffer`` in DeepEP 2.x): ``Buffer(group,
num_nvl_bytes, num_rdma_bytes)``, ``get_dispatch_config`` / ``get_combine_config`` (per-ep-size tables: 2, 4, 8
ranks intranode) with ``Config.get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint``, ``set_num_sms``,
``get_dispatch_layout``, ``dispatch`` (non-cached with top-k, and cached with ``handle``) and ``combine``. Its
kernels take bf16 rows (dispatch also FP8) and fp32 top-k weights, ``topk_idx`` of ``deep_ep.topk_idx_t`` (int64),
hidden sizes whose rows are multiples of 16 bytes, at most 8 NVLink peers (``NUM_MAX_NVL_PEERS``).

Requirements, each checked with an error that names the fix (DESIGN invariant 7: no silent fallback): the
``deep_ep`` package, built from source (docs/deepep.md); CUDA; every rank of an ep group on one node; ep in
(2, 4, 8); etp = 1; bf16 activations. The CUDA parts are checked on GPUs by ``bench/deepep_check.py``; on CPU,
tests/test_deepep_dispatcher.py runs everything else against a pure-torch stand-in of the Buffer.
"""

from __future__ import annotations

import importlib
import itertools
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.moe.dispatch.base import DispatchContext, _permute, _unpermute
from lightning_moe.moe.dispatch.groups import GroupLike, _GroupedDispatcher
from lightning_moe.moe.dispatch.layout import _count, _group_slots
from lightning_moe.moe.router import RoutingResult

__all__ = ["DeepEPDispatcher", "DEEPEP_COMMIT", "import_deep_ep", "check_deepep_sizes", "check_deepep_nodes",
           "check_deepep_dtype"]

DEEPEP_COMMIT = "567632dd59810d77b3cc05553df953cc0f779799"
EP_SIZES = (2, 4, 8)  # sizes of Buffer.get_dispatch_config's / get_combine_config's tables up to NUM_MAX_NVL_PEERS
INSTALL_HINT = (
    "Build DeepEP from source on the GPU machine (PyPI's deep-ep 1.0.0 is a stale snapshot: do not use it): "
    f"deepseek-ai/DeepEP at commit {DEEPEP_COMMIT[:7]}, `TORCH_CUDA_ARCH_LIST=9.0 pip wheel --no-build-isolation "
    "--no-deps -w dist .` (setup.py takes NVSHMEM from the nvidia-nvshmem-cu13 wheel; rdma-core's "
    "infiniband/mlx5dv.h must be on the include path), then `pip install dist/deep_ep-*.whl`; docs/deepep.md has "
    "the exact recipe and an NVSHMEM-free variant"
)
_API = ("get_dispatch_layout", "dispatch", "combine", "get_dispatch_config", "get_combine_config", "set_num_sms")


def import_deep_ep() -> Any:
    """The ``deep_ep`` module, imported on first use. RuntimeError naming the build recipe when it is missing, fails
    to load (e.g. its extension was built against another torch), or lacks a method of the V1 ``Buffer`` API used
    here. Every DeepEP release since its first (1.0.0) takes ``dispatch(expert_alignment=...)``; a Buffer that does
    not is refused at its first dispatch (:func:`_stale_buffer`), not by inspecting signatures."""
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as err:  # ImportError, or its compiled extension failing to load
        raise RuntimeError(f"dispatcher='deepep' needs the deep_ep package (DeepEP), which did not import "
                           f"({type(err).__name__}: {err}). {INSTALL_HINT}") from err
    buffer = getattr(deep_ep, "Buffer", None)
    missing = [name for name in _API if not hasattr(buffer, name)]
    if buffer is None or missing:
        raise _stale_buffer(f"the installed deep_ep ({getattr(deep_ep, '__file__', '?')})", missing or ["Buffer"])
    return deep_ep


def _stale_buffer(what: str, missing: list[str]) -> RuntimeError:
    return RuntimeError(f"{what} lacks the V1 Buffer API this backend calls ({', '.join(missing)}). {INSTALL_HINT}")


def check_deepep_sizes(ep: int, etp: int) -> None:
    """ValueError unless DeepEP's intranode kernels can serve this ep / etp (ep = 1 needs no dispatcher)."""
    if etp > 1:
        raise ValueError(f"dispatcher='deepep' does not support expert tensor parallelism (etp={etp}): set etp=1, "
                         "or use dispatcher='alltoall'")
    if ep > 1 and ep not in EP_SIZES:
        raise ValueError(f"dispatcher='deepep' runs intranode with ep in {EP_SIZES} (DeepEP's tuned configs, at most "
                         f"8 NVLink peers), got ep={ep}: choose one of those or dispatcher='alltoall'")


def check_deepep_nodes(ep_groups: list[list[int]], ranks_per_node: int) -> None:
    """ValueError unless every ep group (global ranks, node-major numbering) lies on one node: DeepEP's normal
    intranode kernels reach peers over NVLink only (this backend does not use its RDMA / NVSHMEM kernels)."""
    for group in ep_groups:
        nodes = sorted({r // ranks_per_node for r in group})
        if len(nodes) > 1:
            raise ValueError(f"dispatcher='deepep' needs every ep group on one node, but ranks {group} span nodes "
                             f"{nodes} ({ranks_per_node} GPUs a node): choose ep <= GPUs per node (ep divides it), "
                             "or use dispatcher='alltoall'")


def check_deepep_dtype(dtype: torch.dtype, allowed: tuple[torch.dtype, ...] = (torch.bfloat16,),
                       what: str = "activations") -> None:
    """ValueError unless ``dtype`` is one DeepEP moves: its dispatch takes bf16 (or FP8) rows, its combine bf16."""
    if dtype not in allowed:
        raise ValueError(f"dispatcher='deepep' moves bf16 activations (DeepEP dispatches bf16 or FP8 rows and "
                         f"combines bf16 only), got {what} in {dtype}: train with precision='bf16-true' (or FSDP "
                         "param_dtype='bf16'), or use dispatcher='alltoall'")


# ----------------------------------------------------------------------------------------------------------------
# one Buffer per process group


_BUFFERS: dict[Any, Any] = {}


def _check_one_host(group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` on this host (the Buffer constructor's own all_gather_object, done first)."""
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        raise RuntimeError(f"dispatcher='deepep' needs every ep rank on one node (intranode NVLink kernels), but this "
                           f"ep group spans hosts {sorted(set(hosts))}: choose ep <= GPUs per node")


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Any:
    """The group's ``deep_ep.Buffer``, created on first use and replaced by a larger one when a wider row needs
    more NVLink buffer. Sized from DeepEP's config hints, as ``get_buffer`` in DeepEP's README (docs/legacy.md at
    2.x) and Megatron-Core's ``fused_a2a.get_buffer``; no RDMA bytes (intranode). A collective on first use."""
    Buffer = import_deep_ep().Buffer
    size = dist.get_world_size(group)
    nvl = rdma = 0
    for cfg in (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size)):
        nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, size))
        rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, size))
    buf = _BUFFERS.get(group)
    if buf is None or buf.num_nvl_bytes < nvl or buf.num_rdma_bytes < rdma:
        if buf is None:
            _check_one_host(group)
        buf = _BUFFERS[group] = Buffer(group, nvl, rdma)
    return buf


# ----------------------------------------------------------------------------------------------------------------
# autograd around Buffer.dispatch / Buffer.combine


@dataclass
class _DeepEPState:
    """Per-dispatch state (``DispatchContext.extra``): the buffer, DeepEP's handle and the received per-local-expert
    row counts (host ints, aligned)."""

    buffer: Any
    handle: Any = None
    counts: Optional[list[int]] = None


class _Dispatch(torch.autograd.Function):
    """x_TD, probs_TK, ids_TK (global ids, -1 = not routed) -> received x_ND, local ids_NK, weights w_NK.
    Backward: ``Buffer.combine`` of the row and weight gradients (sums over the ranks each token went to)."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, probs_TK: Tensor, ids_TK: Tensor, num_experts: int, alignment: int,
                st: _DeepEPState) -> tuple[Tensor, Tensor, Tensor]:
        buf = st.buffer
        # deep_ep/buffer.py Buffer.get_dispatch_layout: tokens per rank / per expert, the [T, P] token-in-rank map
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(ids_TK, num_experts)
        # Buffer.dispatch, intranode non-cached branch: received rows, their local top-k ids (-1 elsewhere) and
        # weights (0 elsewhere), per-local-expert counts (a host list, aligned), the handle for combine
        try:
            x_ND, ids_NK, w_NK, counts, handle, _ = buf.dispatch(
                x_TD, topk_idx=ids_TK, topk_weights=probs_TK, num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                expert_alignment=alignment)
        except TypeError as err:
            # a Buffer without the V1 keywords (e.g. PyPI's stale snapshot) fails the call's binding, before any
            # kernel or collective runs, on every rank alike: the capability check is the documented call itself
            if "keyword argument" in str(err):
                raise _stale_buffer(f"the deep_ep Buffer ({type(buf).__module__}.{type(buf).__qualname__})",
                                    [f"dispatch(...): {err}"]) from err
            raise
        st.handle, st.counts = handle, [int(c) for c in counts]
        ctx.st = st
        ctx.mark_non_differentiable(ids_NK)
        return x_ND, ids_NK, w_NK

    @staticmethod
    def backward(ctx, g_ND: Tensor, _g_ids: Tensor, g_w_NK: Tensor):
        st: _DeepEPState = ctx.st
        w = g_w_NK.float().contiguous() if ctx.needs_input_grad[1] else None
        # Buffer.combine (intranode): sums the rows (fp32 accumulation, bf16 out) and the top-k weights over ranks
        g_TD, g_probs_TK, _ = st.buffer.combine(g_ND.contiguous(), st.handle, topk_weights=w)
        return g_TD, g_probs_TK, None, None, None, None


class _Combine(torch.autograd.Function):
    """y_ND (per received row) -> y_TD summed over the ranks each token went to; backward: the cached
    ``Buffer.dispatch`` of the output gradient (the same rows to the same ranks)."""

    @staticmethod
    def forward(ctx, y_ND: Tensor, st: _DeepEPState) -> Tensor:
        ctx.st = st
        y_TD, _, _ = st.buffer.combine(y_ND.contiguous(), st.handle)
        return y_TD

    @staticmethod
    def backward(ctx, g_TD: Tensor):
        st: _DeepEPState = ctx.st
        g_ND = st.buffer.dispatch(g_TD.contiguous(), handle=st.handle)[0]
        return g_ND, None


# ----------------------------------------------------------------------------------------------------------------
# the dispatcher


def received_layout(ids_NK: Tensor, counts_e: list[int]) -> tuple[Tensor, Tensor]:
    """DeepEP's received rows -> the expert-grouped layout: ``ids_NK`` local expert ids (-1: an expert elsewhere),
    ``counts_e`` rows per local expert as DeepEP reports them (>= the true counts when aligned). Returns
    ``pos_NK`` (row of every local assignment, -1 elsewhere) and ``asg_R`` (assignment of every row, flat index
    into [N, k]; -1 for alignment padding). Expert j's rows start at ``sum(counts_e[:j])``; inside an expert the
    assignments keep the receive order. No host sync."""
    e = len(counts_e)
    dev = ids_NK.device
    ids_A = ids_NK.reshape(-1).long()
    ids_A = torch.where(ids_A < 0, torch.full_like(ids_A, e), ids_A)
    order_A = torch.argsort(ids_A, stable=True)
    limit_e = torch.tensor(counts_e, dtype=torch.long, device=dev)
    start_e = torch.tensor([0, *itertools.accumulate(counts_e)][:e], dtype=torch.long, device=dev)
    return _group_slots(ids_A.view(ids_NK.shape), order_A, _count(ids_A, e + 1), start_e, limit_e, sum(counts_e))


class DeepEPDispatcher(_GroupedDispatcher):
    """Expert parallelism over ``ep`` through DeepEP's intranode normal kernels (see the module docstring).

    ``DeepEPDispatcher(ep_group, etp_group=None, num_local_experts=None, *, expert_alignment=1, num_sms=None,
    buffer=None)``; groups are ``ProcessGroup``s or 1-D ``DeviceMesh``es. ``num_sms``: ``Buffer.set_num_sms``
    (process-wide; DeepEP's default 20). ``buffer``: an object with ``deep_ep.Buffer``'s ``get_dispatch_layout`` /
    ``dispatch`` / ``combine`` to use instead of the per-group cached Buffer (tests: a pure-torch stand-in, whose
    ``dtypes`` attribute may widen the accepted activation dtypes). Without ``buffer``: RuntimeError when deep_ep
    is missing or CUDA is unavailable. ValueError for etp > 1 or an ep size DeepEP has no intranode config for.
    """

    def __init__(self, ep_group: GroupLike, etp_group: Optional[GroupLike] = None,
                 num_local_experts: Optional[int] = None, *, expert_alignment: int = 1, num_sms: Optional[int] = None,
                 buffer: Any = None) -> None:
        if buffer is None:
            deep_ep = import_deep_ep()
            if not torch.cuda.is_available():
                raise RuntimeError("dispatcher='deepep' needs CUDA GPUs connected by NVLink (DeepEP's kernels are "
                                   "CUDA only): use dispatcher='alltoall' on this machine")
            if num_sms is not None:
                deep_ep.Buffer.set_num_sms(num_sms)  # asserts an even count
            self._idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        else:
            self._idx_dtype = getattr(buffer, "topk_idx_t", torch.int64)
        super().__init__(ep_group, etp_group, num_local_experts)
        check_deepep_sizes(self.ep_size, self.etp_size)
        if self.ep_size == 1:
            raise ValueError(f"DeepEPDispatcher needs an ep group of {EP_SIZES} ranks, got one rank (without expert "
                             "parallelism the layer keeps its LocalDispatcher)")
        if expert_alignment < 1:
            raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
        self.expert_alignment = int(expert_alignment)
        self._buffer = buffer
        self.dtypes: tuple[torch.dtype, ...] = tuple(getattr(buffer, "dtypes", (torch.bfloat16,)))

    def _dispatch(self, x_TD: Tensor, routing: RoutingResult, num_experts: int,
                  overlap: Optional[Callable[[], Any]]) -> tuple[Tensor, Tensor, DispatchContext]:
        E = num_experts
        self._local_experts(E)
        check_deepep_dtype(x_TD.dtype, self.dtypes)
        D = x_TD.shape[1]
        if (D * x_TD.element_size()) % 16:
            raise ValueError(f"dispatcher='deepep' needs rows of a multiple of 16 bytes (hidden size a multiple of 8 "
                             f"in bf16), got hidden size {D}")
        buf = self._buffer
        if buf is None:
            if not x_TD.is_cuda:
                raise RuntimeError(f"dispatcher='deepep' runs on CUDA tensors, got x on {x_TD.device}")
            buf = get_buffer(self.ep_group, D * max(x_TD.element_size(), 2))
        ids_TK = routing.expert_ids
        if routing.keep_mask is not None:  # dropped assignments go nowhere
            ids_TK = torch.where(routing.keep_mask, ids_TK, torch.full_like(ids_TK, -1))
        st = _DeepEPState(buf)
        x_ND, ids_NK, w_NK = _Dispatch.apply(x_TD.contiguous(), routing.probs.float().contiguous(),
                                             ids_TK.to(self._idx_dtype).contiguous(), E, self.expert_alignment, st)
        pos_NK, asg_R = received_layout(ids_NK, st.counts)
        x_RD, ctx = _permute(x_ND, w_NK, pos_NK, asg_R, True, self.expert_alignment == 1)
        ctx.extra = st
        return x_RD, torch.tensor(st.counts, dtype=torch.long, device=x_TD.device), ctx

    # the inherited _row_weights: ctx holds the received rows' weights, so every expert row has its own

    def _combine(self, y_RD: Tensor, ctx: DispatchContext) -> Tensor:
        return _Combine.apply(_unpermute(y_RD, ctx), ctx.extra)

    def __repr__(self) -> str:
        return f"DeepEPDispatcher(ep={self.ep_size}, expert_alignment={self.expert_alignment})"
