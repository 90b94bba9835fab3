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
Shapes the kernel cannot take fall back to :meth:`forward_loop` with a one-time warning.
On CUDA, bf16 x bf16 on sm90/sm100 takes the CUTLASS fast path without a host sync; other dtypes (fp32) use
an ATen fallback (a loop of mm with one device-to-host copy of the offsets). Checked on an H200 with torch
2.11+cu130: grouped == loop bitwise in bf16 and fp32 (uneven, empty and single-expert groups); the transposed
view and a contiguous [E, K, N] copy of the weight run at the same speed.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe.autograd import contiguous_grad_
from lightning_moe.moe.kernels import swiglu

__all__ = ["GroupedExperts", "SharedExperts"]


def _local(w: Tensor) -> Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _compute_dtype(x: Tensor, w: Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return w.dtype


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

    ``forward(x_RD, counts_e)`` takes rows grouped by local expert (expert 0's rows first) and int64 counts per
    local expert ([e]); it returns [R, D] in the compute dtype (autocast dtype, else the weight dtype).
    Subclasses (FP8 backends) override :meth:`_grouped_mm` only.
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        *,
        use_grouped_mm: bool = True,
        init_std: float = 0.02,
        out_init_std: Optional[float] = None,
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
            f"use_grouped_mm={self.use_grouped_mm}"
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # works on meta tensors (no-op), plain tensors and DTensors
        nn.init.normal_(self.w1, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w3, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w2, mean=0.0, std=self.out_init_std)

    # ---- the seam -------------------------------------------------------------------------------
    def _grouped_mm(self, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
        """``y[rows of group g] = x[rows of group g] @ w_EKN[g]``; ``offs_E`` int32 cumulative group ends.

        Inputs share one dtype; ``w_EKN`` is usually a transposed view of a contiguous [E, N, K] weight.
        Override this (and only this) for FP8 / emulated backends."""
        return torch._grouped_mm(x_MK, w_EKN, offs=offs_E)

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

    def forward(self, x_RD: Tensor, counts_e: Tensor) -> Tensor:
        if not self.use_grouped_mm:
            return self.forward_loop(x_RD, counts_e)
        w1, w2, w3, dtype = self._local_weights(x_RD)
        self._check(x_RD, counts_e, w1.shape[0])
        problem = self._grouped_mm_problem(x_RD, dtype, w1.shape[0], w1.shape[1])
        if problem is not None:
            if not self._warned_fallback:
                warnings.warn(f"GroupedExperts: {problem}; using the per-expert loop (slow)", stacklevel=2)
                self._warned_fallback = True
            return self.forward_loop(x_RD, counts_e)
        x = x_RD.to(dtype).contiguous()
        if x.shape[0] == 0:
            # no rows on this process (e.g. an EP rank that got no tokens): the CUDA grouped-GEMM backward
            # rejects empty operands; plain matmuls give the same empty output and zero weight gradients
            h_0F = F.silu(x @ w1[0].transpose(0, 1)) * (x @ w3[0].transpose(0, 1))
            return h_0F @ w2[0].transpose(0, 1)
        offs_e = torch.cumsum(counts_e, dim=0, dtype=torch.int32)
        gmm = self._grouped_mm
        # w[E, N, K].transpose(-2, -1) is the column-major [E, K, N] operand: x @ w[e].T, no copy
        g_RF = contiguous_grad_(gmm(x, w1.transpose(-2, -1), offs_e))
        u_RF = contiguous_grad_(gmm(x, w3.transpose(-2, -1), offs_e))
        return contiguous_grad_(self.act_down(g_RF, u_RF, w2.transpose(-2, -1), offs_e))

    def act_down(self, g_RF: Tensor, u_RF: Tensor, w2_EFD: Tensor, offs_e: Tensor) -> Tensor:
        """SwiGLU and the down projection: the seam ``activation_checkpointing=[moe_act]`` recomputes (then neither
        silu(g) nor h is kept for the backward; see :mod:`lightning_moe.parallel.recompute`)."""
        # SwiGLU: a fused Triton kernel on CUDA (lightning_moe.moe.kernels), the torch reference elsewhere
        return self._grouped_mm(swiglu(g_RF, u_RF), w2_EFD, offs_e)

    def forward_loop(self, x_RD: Tensor, counts_e: Tensor) -> Tensor:
        """Reference: a Python loop over local experts with plain matmuls (one host sync for the counts)."""
        w1, w2, w3, dtype = self._local_weights(x_RD)
        self._check(x_RD, counts_e, w1.shape[0])
        x = x_RD.to(dtype)
        sizes = counts_e.tolist()
        n = sum(sizes)
        if n > x.shape[0]:
            raise ValueError(f"expert counts sum to {n} but only {x.shape[0]} rows were given")
        outs = []
        for e, x_e in enumerate(torch.split(x[:n], sizes, dim=0)):
            h = F.silu(x_e @ w1[e].transpose(0, 1)) * (x_e @ w3[e].transpose(0, 1))
            outs.append(h @ w2[e].transpose(0, 1))
        if n < x.shape[0]:  # rows past the last group (never produced by our dispatchers) give zeros
            outs.append(x.new_zeros(x.shape[0] - n, self.dim))
        return torch.cat(outs, dim=0)


class _Linear(nn.Linear):
    """``nn.Linear`` (so tensor-parallel styles apply) whose reset_parameters is a normal init of a settable std."""

    init_std: float = 0.02

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class SharedExperts(nn.Module):
    """Dense SwiGLU MLP seen by every token: ``w2(silu(w1 x) * w3 x)``, times ``sigmoid(gate(x))`` when gated
    (Qwen2-MoE). Weights: ``w1.weight`` [F, D], ``w3.weight`` [F, D], ``w2.weight`` [D, F], ``gate.weight`` [1, D]."""

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
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.gate is not None:
            out = torch.sigmoid(self.gate(x)) * out
        return out
