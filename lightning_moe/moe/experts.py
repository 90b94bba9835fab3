"""Routed experts (one grouped GEMM per projection) and shared experts (a dense SwiGLU MLP).

Legend: R routed rows on this process (grouped by local expert), D hidden, F expert hidden size,
E global experts, e local experts (E / ep), K / N the contraction / output dims of one grouped GEMM.

Expert weights are global tensors (a checkpoint contract): gate ``w1`` [E, F, D], up ``w3`` [E, F, D],
down ``w2`` [E, D, F]. Under expert parallelism they are DTensors (``Shard(0)`` over ``ep``, possibly
sharded on F for expert-TP); ``forward`` works on their local shards, so the number of local experts is the
local first dimension.

``torch._grouped_mm`` facts this module handles (torch 2.11+; CPU kernel and CUDA CUTLASS kernel):
  * not autocast-aware and both operands must share one dtype: we cast to the autocast dtype (when autocast
    is on for the input's device) or to the weight dtype;
  * every operand needs a unit stride in one of its last two dims and the other stride a multiple of 16 bytes
    (and, on CUDA, a 16-byte-aligned data pointer). ``w.transpose(-2, -1)`` of a contiguous [E, N, K] weight is
    a valid "column-major" operand (the same K-major layout ``nn.Linear`` uses), so no copy is made; D and F
    must be multiples of 16 bytes / element size (8 for bf16, 4 for fp32), else we fall back to the loop;
  * on CPU its backward fails on an expanded stride-0 incoming gradient (``y.sum().backward()``): grads
    reaching the kernel are made contiguous by :func:`~lightning_moe.autograd.contiguous_grad_` (a no-op for contiguous grads);
  * empty groups (repeated offsets) are valid; zero rows are valid in forward but the CUDA backward rejects the
    empty operand, so zero rows take plain matmuls (same empty output, zero weight gradients);
  * the CUDA kernel takes fewer than 1024 groups (local experts).
Shapes the kernel cannot take fall back to :meth:`forward_loop` with a one-time warning (when the grouped-GEMM
implementation allows it: :mod:`lightning_moe.moe.grouped_mm`).
On CUDA, bf16 x bf16 on sm90/sm100 takes the CUTLASS fast path without a host sync; other dtypes (fp32) use
an ATen fallback (a loop of mm with one device-to-host copy of the offsets). Checked on an H200 with torch
2.11+cu130: grouped == loop bitwise in bf16 and fp32 (uneven, empty and single-expert groups); the transposed
view and a contiguous [E, K, N] copy of the weight run at the same speed.
"""

from __future__ import annotations

import warnings
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe.activation_plan import ActivationPlan
from lightning_moe.autograd import contiguous_grad_
from lightning_moe.models import registry
from lightning_moe.moe import kernels
from lightning_moe.moe.grouped_mm import GroupedMM, TorchGroupedMM
from lightning_moe.moe.kernels import swiglu
from lightning_moe.moe.kernels import swiglu_reference as _swiglu_ref

__all__ = ["GroupedExperts", "SharedExperts"]


def _local(w: Tensor) -> Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _compute_dtype(x: Tensor, w: Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return w.dtype


@registry.register("experts", "grouped_mm")
class GroupedExperts(nn.Module):
    """E SwiGLU experts: ``y = w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))`` for the rows of local expert e.

    Args:
        num_experts: E (global).
        dim: D.
        hidden_dim: F.
        use_grouped_mm: one ``torch._grouped_mm`` per projection; False runs :meth:`forward_loop` (a per-expert
            Python loop with one host sync), for platforms without the kernel.
        init_std: std of the normal init of ``w1`` and ``w3``.
        out_init_std: std of the normal init of ``w2`` (callers often scale it by depth); defaults to init_std.
        grouped_mm: the grouped-GEMM implementation (:mod:`lightning_moe.moe.grouped_mm`; default
            ``torch._grouped_mm``); FP8 / emulated backends are implementations, not subclasses.

    ``forward(x_RD, counts_e, probs_R=None)`` takes rows grouped by local expert (expert 0's rows first), int64
    counts per local expert ([e]) and optionally each row's combine weight ([R], fp32), which then scales the
    SwiGLU activation before the down projection; it returns [R, D] in the compute dtype (autocast dtype, else the
    weight dtype).

    What the MoE layer's plan may ask of the experts is declared per class: ``applies_row_weights`` (``forward``
    takes ``probs_R`` and applies it: the layer's plan may then say ``weights_applied_by="experts"``) and
    ``gathers_rows_from_tokens`` (``forward`` takes ``rows_from``, see :meth:`gathers_rows`). A subclass that
    overrides ``forward`` declares neither unless it says so in its own body (its signature may be the bare
    ``forward(x_RD, counts_e)``). ``fuses_fp8_quant``: ``forward`` takes ``fp8_fused=True`` (the plan's
    ``fp8_fused``) and then runs its grouped GEMM's fused FP8 steps (``GroupedMM.swiglu_down``, and
    ``gather_gate_up`` with ``rows_from``: :mod:`lightning_moe.lowp.fp8_fused`).
    """

    applies_row_weights: ClassVar[bool] = True
    gathers_rows_from_tokens: ClassVar[bool] = True
    fuses_fp8_quant: ClassVar[bool] = True
    # recompute "experts" (forward), "moe_act" (act_down); offload "experts" (forward)
    activation_seams: ClassVar[tuple[str, ...]] = ("forward", "act_down")
    activation_plan: ActivationPlan = ActivationPlan()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:  # a new forward takes what it declares, nothing inherited
            for flag in ("applies_row_weights", "gathers_rows_from_tokens", "fuses_fp8_quant"):
                if flag not in cls.__dict__:
                    setattr(cls, flag, False)

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        *,
        use_grouped_mm: bool = True,
        init_std: float = 0.02,
        out_init_std: Optional[float] = None,
        grouped_mm: Optional[GroupedMM] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if num_experts <= 0 or dim <= 0 or hidden_dim <= 0:
            raise ValueError(
                f"GroupedExperts needs positive sizes, got num_experts={num_experts}, dim={dim}, hidden_dim={hidden_dim}"
            )
        self.num_experts = num_experts
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.use_grouped_mm = use_grouped_mm
        self.grouped_mm: GroupedMM = TorchGroupedMM() if grouped_mm is None else grouped_mm
        self.init_std = init_std
        self.out_init_std = init_std if out_init_std is None else out_init_std
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))  # gate [E, F, D]
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))  # up   [E, F, D]
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))  # down [E, D, F]
        self._warned_fallback = False
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}, "
            f"use_grouped_mm={self.use_grouped_mm}, grouped_mm={self.grouped_mm!r}"
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # works on meta tensors (no-op), plain tensors and DTensors
        nn.init.normal_(self.w1, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w3, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w2, mean=0.0, std=self.out_init_std)

    # ---- the seam -------------------------------------------------------------------------------
    def set_grouped_mm(self, impl: GroupedMM) -> None:
        """Give the experts another grouped-GEMM implementation: a build-time step (a model transform, before the
        model is parallelised); in an MoE layer, through :meth:`~lightning_moe.moe.layer.MoELayer.replan`, whose
        plan depends on it."""
        if not isinstance(impl, GroupedMM):
            raise TypeError(f"grouped_mm must be a lightning_moe.moe.grouped_mm.GroupedMM, got {type(impl).__name__}")
        if not self.use_grouped_mm and not impl.loop_fallback:
            raise ValueError(f"{impl!r} needs the grouped GEMM, but these experts have use_grouped_mm=False (the "
                             f"per-expert loop would skip it): {impl.fallback_hint}")
        self.grouped_mm = impl

    # ---- forward paths ----------------------------------------------------------------------------
    def _local_weights(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, torch.dtype]:
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        dtype = _compute_dtype(x, w1)
        return w1.to(dtype), w2.to(dtype), w3.to(dtype), dtype

    def _check(self, x_RD: Tensor, counts_e: Tensor, num_local: int) -> None:
        if x_RD.dim() != 2 or x_RD.shape[1] != self.dim:
            raise ValueError(f"GroupedExperts expects x of shape [R, {self.dim}], got {tuple(x_RD.shape)}")
        if counts_e.dim() != 1 or counts_e.shape[0] != num_local:
            raise ValueError(
                f"GroupedExperts expects counts for its {num_local} local experts, got shape {tuple(counts_e.shape)}"
            )

    def _grouped_mm_problem(self, x: Tensor, dtype: torch.dtype, num_local: int, local_F: int) -> Optional[str]:
        """Why ``torch._grouped_mm`` cannot take these operands (None when it can)."""
        elt = dtype.itemsize
        if (self.dim * elt) % 16 or (local_F * elt) % 16:
            return (f"dim={self.dim} / local hidden_dim={local_F} are not multiples of 16 bytes in {dtype}, which "
                    f"torch._grouped_mm requires")
        if x.is_cuda and num_local >= 1024:
            return f"{num_local} local experts: the CUDA grouped GEMM takes fewer than 1024 groups (use expert parallelism)"
        return None

    def _check_probs(self, x_RD: Tensor, probs_R: Optional[Tensor]) -> None:  # x_RD: anything with R rows
        if probs_R is not None and tuple(probs_R.shape) != (x_RD.shape[0],):
            raise ValueError(f"GroupedExperts expects one weight per row, probs_R of shape [{x_RD.shape[0]}], got "
                             f"{tuple(probs_R.shape)}")

    def gathers_rows(self, x_TD: Tensor) -> bool:
        """Whether :meth:`forward` can take ``rows_from`` and gather the rows itself without keeping them: the fused
        CUDA kernels are on, the grouped GEMM is this class's (an FP8 seam has its own autograd), and the shapes
        suit the grouped GEMM."""
        w1 = _local(self.w1)
        dtype = _compute_dtype(x_TD, w1)
        return (self.use_grouped_mm and (self.grouped_mm.exact_torch or self.grouped_mm.fused_fp8)
                and x_TD.dtype == dtype and kernels.use_triton(x_TD)
                and self._grouped_mm_problem(x_TD, dtype, w1.shape[0], w1.shape[1]) is None)

    def forward(self, x_RD: Optional[Tensor], counts_e: Tensor, probs_R: Optional[Tensor] = None, *,
                rows_from: Optional[tuple[Tensor, Tensor, Tensor]] = None, fp8_fused: bool = False) -> Tensor:
        return self.activation_plan.forward(self._forward, x_RD, counts_e, probs_R, rows_from=rows_from,
                                            fp8_fused=fp8_fused)

    def _forward(self, x_RD: Optional[Tensor], counts_e: Tensor, probs_R: Optional[Tensor] = None, *,
                 rows_from: Optional[tuple[Tensor, Tensor, Tensor]] = None, fp8_fused: bool = False) -> Tensor:
        if rows_from is not None:
            # (x_TD, asg_R, pos_TK): the rows are x_TD[asg_R // k] (zero rows where asg_R < 0), gathered here and
            # again in the backward instead of kept for the gate / up weight gradients (R x D: k times x_TD)
            assert x_RD is None and self.gathers_rows(rows_from[0])
            x_TD, asg_R, pos_TK = rows_from
            self._check_probs(asg_R, probs_R)
            w1, w2, w3, _ = self._local_weights(x_TD)
            self._check(x_TD, counts_e, w1.shape[0])
            if asg_R.shape[0] == 0:  # no rows: the general path's empty-operand handling
                return self._forward(kernels.gather_rows(x_TD, asg_R, pos_TK.shape[1]), counts_e, probs_R)
            offs_e = torch.cumsum(counts_e, dim=0, dtype=torch.int32)
            if fp8_fused:  # the gather quantizes the rows for both projections
                g_RF, u_RF = self.grouped_mm.gather_gate_up(x_TD.contiguous(), asg_R, pos_TK, w1.transpose(-2, -1),
                                                            w3.transpose(-2, -1), offs_e)
            else:
                g_RF, u_RF = _GatherGateUp.apply(x_TD.contiguous(), asg_R, pos_TK, w1, w3, offs_e)
            return contiguous_grad_(self._act_down(g_RF, u_RF, probs_R, w2.transpose(-2, -1), offs_e, fp8_fused))
        self._check_probs(x_RD, probs_R)
        if not self.use_grouped_mm:
            return self._loop(x_RD, counts_e, probs_R, "use_grouped_mm=False")
        w1, w2, w3, dtype = self._local_weights(x_RD)
        self._check(x_RD, counts_e, w1.shape[0])
        problem = self._grouped_mm_problem(x_RD, dtype, w1.shape[0], w1.shape[1])
        if problem is not None:
            if self.grouped_mm.loop_fallback and not self._warned_fallback:
                warnings.warn(f"GroupedExperts: {problem}; using the per-expert loop (slow)", stacklevel=2)
                self._warned_fallback = True
            return self._loop(x_RD, counts_e, probs_R, problem)
        x = x_RD.to(dtype).contiguous()
        if x.shape[0] == 0:
            # no rows on this process (e.g. an EP rank that got no tokens): the CUDA grouped-GEMM backward
            # rejects empty operands; plain matmuls give the same empty output and zero weight gradients
            h_0F = _swiglu_ref(x @ w1[0].transpose(0, 1), x @ w3[0].transpose(0, 1), probs_R)
            return h_0F @ w2[0].transpose(0, 1)
        offs_e = torch.cumsum(counts_e, dim=0, dtype=torch.int32)
        gmm = self.grouped_mm
        # w[E, N, K].transpose(-2, -1) is the column-major [E, K, N] operand: x @ w[e].T, no copy
        g_RF = contiguous_grad_(gmm(x, w1.transpose(-2, -1), offs_e))
        u_RF = contiguous_grad_(gmm(x, w3.transpose(-2, -1), offs_e))
        return contiguous_grad_(self._act_down(g_RF, u_RF, probs_R, w2.transpose(-2, -1), offs_e, fp8_fused))

    def _act_down(self, g_RF: Tensor, u_RF: Tensor, probs_R: Optional[Tensor], w2_EFD: Tensor,
                  offs_e: Tensor, fp8_fused: bool = False) -> Tensor:
        # region inputs gate, up and the row weights; the weight and the offsets are held as they are (an offload
        # scope never copies a weight)
        return self.activation_plan.recompute.run("act_down", self.act_down, g_RF, u_RF, probs_R,
                                                  captured=(w2_EFD, offs_e), fp8_fused=fp8_fused)

    def act_down(self, g_RF: Tensor, u_RF: Tensor, probs_R: Optional[Tensor], w2_EFD: Tensor,
                 offs_e: Tensor, *, fp8_fused: bool = False) -> Tensor:
        """SwiGLU (times the rows' weights when given) and the down projection: the seam
        ``activation_checkpointing=[moe_act]`` recomputes (then h is not kept for the backward; see
        :mod:`lightning_moe.activation_plan`). ``fp8_fused``: the SwiGLU quantizes h for the FP8 down GEMM."""
        if fp8_fused:
            return self.grouped_mm.swiglu_down(g_RF, u_RF, probs_R, w2_EFD, offs_e)
        # SwiGLU: a fused Triton kernel on CUDA (lightning_moe.moe.kernels), the torch reference elsewhere
        return self.grouped_mm(swiglu(g_RF, u_RF, probs_R), w2_EFD, offs_e)

    def _loop(self, x_RD: Tensor, counts_e: Tensor, probs_R: Optional[Tensor], why: str) -> Tensor:
        if not self.grouped_mm.loop_fallback:
            raise ValueError(f"GroupedExperts: {why}, and its grouped GEMM {self.grouped_mm!r} has no per-expert "
                             f"loop fallback (the loop would skip it): {self.grouped_mm.fallback_hint}")
        return self.forward_loop(x_RD, counts_e, probs_R)

    def forward_loop(self, x_RD: Tensor, counts_e: Tensor, probs_R: Optional[Tensor] = None) -> Tensor:
        """Reference: a Python loop over local experts with plain matmuls (one host sync for the counts)."""
        w1, w2, w3, dtype = self._local_weights(x_RD)
        self._check(x_RD, counts_e, w1.shape[0])
        self._check_probs(x_RD, probs_R)
        x = x_RD.to(dtype)
        sizes = counts_e.tolist()
        n = sum(sizes)
        if n > x.shape[0]:
            raise ValueError(f"expert counts sum to {n} but only {x.shape[0]} rows were given")
        p_parts = torch.split(probs_R[:n], sizes) if probs_R is not None else [None] * len(sizes)
        outs = []
        for e, (x_e, p_e) in enumerate(zip(torch.split(x[:n], sizes, dim=0), p_parts)):
            h = _swiglu_ref(x_e @ w1[e].transpose(0, 1), x_e @ w3[e].transpose(0, 1), p_e)
            outs.append(h @ w2[e].transpose(0, 1))
        if n < x.shape[0]:  # rows past the last group (never produced by our dispatchers) give zeros
            outs.append(x.new_zeros(x.shape[0] - n, self.dim))
        return torch.cat(outs, dim=0)



@registry.register("experts", "loop")
def loop_experts(*args, **kwargs) -> GroupedExperts:
    """The per-expert loop reference of :class:`GroupedExperts` (no grouped GEMM)."""
    return GroupedExperts(*args, use_grouped_mm=False, **kwargs)


class _GatherGateUp(torch.autograd.Function):
    """``x_RD = x_TD[asg_R // k]``, then the gate and up grouped GEMMs; the backward gathers x_RD again (one gather of
    R rows, instead of keeping R x D from the forward) for the weight gradients, and sums both GEMMs' input gradients
    straight into the tokens (one k-sum over two row tensors: no [R, D] sum of dx_gate + dx_up). The GEMMs are
    those ``torch._grouped_mm``'s own autograd runs; the row kernels are :mod:`lightning_moe.moe.kernels`'."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, asg_R: Tensor, pos_TK: Tensor, w1_EFD: Tensor, w3_EFD: Tensor,
                offs_e: Tensor) -> tuple[Tensor, Tensor]:
        x_RD = kernels.gather_rows(x_TD, asg_R, pos_TK.shape[1])
        ctx.save_for_backward(x_TD, asg_R, pos_TK, w1_EFD, w3_EFD, offs_e)
        return (torch._grouped_mm(x_RD, w1_EFD.transpose(-2, -1), offs=offs_e),
                torch._grouped_mm(x_RD, w3_EFD.transpose(-2, -1), offs=offs_e))

    @staticmethod
    def backward(ctx, dg_RF: Tensor, du_RF: Tensor):
        x_TD, asg_R, pos_TK, w1, w3, offs_e = ctx.saved_tensors
        dg, du = dg_RF.contiguous(), du_RF.contiguous()
        grad_x = grad_w1 = grad_w3 = None
        if ctx.needs_input_grad[0]:
            grad_x = kernels.k_sum(torch._grouped_mm(dg, w1, offs=offs_e), pos_TK,
                                   rows2_RD=torch._grouped_mm(du, w3, offs=offs_e))
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            x_RD = kernels.gather_rows(x_TD, asg_R, pos_TK.shape[1])
            # [E, F, D] = d[g].T @ x[g]: contiguous like the weights (as torch's own grouped-GEMM backward gives
            # them); a transposed [E, D, F] result would make AccumulateGrad copy it with a strided transpose
            if ctx.needs_input_grad[3]:
                grad_w1 = torch._grouped_mm(dg.t(), x_RD, offs=offs_e)
            if ctx.needs_input_grad[4]:
                grad_w3 = torch._grouped_mm(du.t(), x_RD, offs=offs_e)
        return grad_x, None, None, grad_w1, grad_w3, None


class _Linear(nn.Linear):
    """``nn.Linear`` (so tensor-parallel styles apply) whose reset_parameters is a normal init of a settable std."""

    init_std: float = 0.02

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


@registry.register("shared_experts", "swiglu")
class SharedExperts(nn.Module):
    """Dense SwiGLU MLP seen by every token: ``w2(silu(w1 x) * w3 x)``, times ``sigmoid(gate(x))`` when gated
    (Qwen2-MoE). Weights: ``w1.weight`` [F, D], ``w3.weight`` [F, D], ``w2.weight`` [D, F], ``gate.weight`` [1, D]."""

    activation_seams: ClassVar[tuple[str, ...]] = ("forward",)  # recompute and offload "shared_experts"
    activation_plan: ActivationPlan = ActivationPlan()

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        gate: bool = False,
        *,
        init_std: float = 0.02,
        out_init_std: Optional[float] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if dim <= 0 or hidden_dim <= 0:
            raise ValueError(f"SharedExperts needs positive sizes, got dim={dim}, hidden_dim={hidden_dim}")
        self.init_std = init_std
        self.out_init_std = init_std if out_init_std is None else out_init_std
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.w1 = _Linear(dim, hidden_dim, **kw)
        self.w3 = _Linear(dim, hidden_dim, **kw)
        self.w2 = _Linear(hidden_dim, dim, **kw)
        self.gate = _Linear(dim, 1, **kw) if gate else None
        self._set_stds()
        self.reset_parameters()

    def _set_stds(self) -> None:
        for m in (self.w1, self.w3, self.gate):
            if m is not None:
                m.init_std = self.init_std
        self.w2.init_std = self.out_init_std

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self._set_stds()
        for m in (self.w1, self.w3, self.w2, self.gate):
            if m is not None:
                m.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.activation_plan.forward(self._forward, x)

    def _forward(self, x: Tensor) -> Tensor:
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.gate is not None:
            out = torch.sigmoid(self.gate(x)) * out
        return out
