"""Fused kernels of the MoE layer's memory-bound steps (Triton), behind one switch; the PyTorch paths stay the reference.

Legend: T tokens, k top-k, D hidden, R rows grouped by expert, F expert hidden size.

Switch (DESIGN invariant 7): the environment variable ``LIGHTNING_MOE_KERNELS``, read at every forward (a
backward follows its forward's choice):

* ``auto`` (default): the Triton kernels for CUDA tensors when ``triton`` imports, the PyTorch reference for
  everything else (CPU always runs the reference);
* ``torch``: always the reference;
* ``triton``: always the kernels; a clear error when ``triton`` does not import, and for CPU tensors unless
  Triton's interpreter was on (``TRITON_INTERPRET=1`` set before the first kernel call: the tests run that way).

What the kernels do (all math in fp32, results in the tensors' dtype; triton is imported on first use only):

* :func:`k_sum` ``out[t] = sum_k w[t, k] * rows[pos[t, k]]`` over ``pos >= 0``: the combine (unpermute with the
  router's fp32 weights: the k-sum in fp32, as torchtitan and Megatron do) and the permute backward (a token's
  row gradients summed, ``w`` None). The reference gathers a [T, k, D] copy and sums it with bf16 weights.
* :func:`gather_rows` ``rows[r] = x[asg[r] // k]`` (``asg < 0``: a zero row): the permute forward.
* :func:`unpermute_backward` one pass over the rows: ``grad_y[r] = w(asg[r]) * g[token of r]`` and
  ``grad_w(asg[r]) = <y[r], g[token of r]>`` (padding rows: zero gradient; assignments without a row: zero).
* :func:`swiglu` ``silu(g) * u`` whose backward recomputes silu from the saved ``g`` and ``u`` (the reference
  autograd graph keeps ``silu(g)`` as a third [R, F] tensor and runs five elementwise passes); with row weights
  ``silu(g) * u * p`` (the combine weights applied before the down projection) and their gradient, a row sum.
* :func:`swiglu_quant_rowwise` the same forward and, in the same kernel, h's FP8 e4m3 rowwise quantization (the down
  projection's input in torchao's rowwise recipe): one read of g and u per pass instead of a separate pass over h.
* :func:`gather_quant_rowwise` the permute forward quantized as it gathers (the gate / up projections' FP8 input).
  Both write into a group-padded layout when asked (the FP8 grouped GEMM's 16-row groups) and feed
  :mod:`lightning_moe.lowp.fp8_fused`.

The dispatchers (``_PermuteRows``, ``_UnpermuteRows``) and ``GroupedExperts`` call these through
:func:`use_triton`; tests/test_moe_kernels.py checks every kernel against the reference (interpreter on CPU),
bench/kernels_check.py on a GPU.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor

__all__ = ["ENV_VAR", "backend", "use_triton", "k_sum", "gather_rows", "unpermute_backward", "swiglu",
           "swiglu_reference", "swiglu_backward", "swiglu_quant_rowwise", "gather_quant_rowwise",
           "rms_norm_quant_rowwise"]

ENV_VAR = "LIGHTNING_MOE_KERNELS"
_CHOICES = ("auto", "torch", "triton")


def backend() -> str:
    """The requested backend: ``auto`` (unset), ``torch`` or ``triton``."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice


@functools.lru_cache(maxsize=None)
def _import_triton() -> tuple[Optional[ModuleType], Optional[str]]:
    try:
        from lightning_moe.moe import _triton_kernels
    except ImportError as e:  # triton missing (or broken)
        return None, f"{type(e).__name__}: {e}"
    return _triton_kernels, None


def triton_available() -> bool:
    return _import_triton()[0] is not None


def _kernels() -> ModuleType:
    mod, err = _import_triton()
    if mod is None:
        raise RuntimeError(f"{ENV_VAR}=triton but triton does not import ({err}); install triton or set "
                           f"{ENV_VAR}=torch")
    return mod


def use_triton(t: Tensor) -> bool:
    """Whether the ops on ``t`` (and tensors on its device) run the Triton kernels."""
    choice = backend()
    if choice == "torch":
        return False
    if choice == "auto":
        return t.is_cuda and triton_available()
    mod = _kernels()
    if not t.is_cuda and not (t.device.type == "cpu" and mod.INTERPRET):
        raise RuntimeError(
            f"{ENV_VAR}=triton: the Triton kernels take CUDA tensors (or CPU tensors under Triton's interpreter, "
            f"TRITON_INTERPRET=1 set before the first kernel call), got a {t.device.type} tensor; set {ENV_VAR}=torch"
        )
    return True


# ---- launch configuration (H200: memory-bound kernels, 16-byte vectors per thread) -------------------------------


def _row_block(D: int, cap: int = 1024) -> tuple[int, int]:
    """BLOCK_D (a power of two, at most ``cap``) and num_warps for row kernels: ~8 bf16 elements per thread."""
    block = min(cap, max(16, 1 << (D - 1).bit_length()))
    return block, max(1, min(8, block // 256))


_EW_BLOCK, _EW_WARPS = 2048, 8  # elementwise kernels


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _c(t: Tensor) -> Tensor:
    """A contiguous plain tensor for a kernel argument: functional collectives return AsyncCollectiveTensor
    wrappers (no data pointer of their own) until waited on."""
    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    return t.contiguous()


# ---- row movement -------------------------------------------------------------------------------------------------


def k_sum(rows_RD: Tensor, pos_TK: Tensor, w_TK: Optional[Tensor] = None, rows2_RD: Optional[Tensor] = None) -> Tensor:
    """``out[t] = sum_k w[t, k] * (rows[pos[t, k]] + rows2[pos[t, k]])`` over ``pos >= 0`` (``w`` None: 1; ``rows2``
    None: no second term; it saves materialising ``rows + rows2``), fp32 accumulation, [T, D] in rows' dtype."""
    T, k = pos_TK.shape
    D = rows_RD.shape[1]
    out = rows_RD.new_empty(T, D)
    if T == 0 or D == 0:
        return out
    if rows_RD.shape[0] == 0:  # no rows: every pos is -1
        return out.zero_()
    assert rows2_RD is None or rows2_RD.shape == rows_RD.shape
    block, warps = _row_block(D)
    rows = _c(rows_RD)
    w = _c(w_TK) if w_TK is not None else pos_TK  # placeholder pointers, unread without HAS_W / HAS_ROWS2
    rows2 = _c(rows2_RD).to(rows.dtype) if rows2_RD is not None else rows
    _kernels().k_sum_kernel[(T, _cdiv(D, block))](
        rows, rows2, _c(pos_TK), w, out, D, K=k, HAS_W=w_TK is not None, HAS_ROWS2=rows2_RD is not None,
        BLOCK_D=block, num_warps=warps)
    return out


def gather_rows(x_TD: Tensor, asg_R: Tensor, k: int) -> Tensor:
    """``rows[r] = x[asg[r] // k]``, a zero row where ``asg[r] < 0``: [R, D] in x's dtype."""
    R, D = asg_R.shape[0], x_TD.shape[1]
    out = x_TD.new_empty(R, D)
    if R == 0 or D == 0:
        return out
    if x_TD.shape[0] == 0:  # no tokens: every row is padding
        return out.zero_()
    block, warps = _row_block(D)
    _kernels().gather_rows_kernel[(R, _cdiv(D, block))](
        _c(x_TD), _c(asg_R), out, D, K=k, BLOCK_D=block, num_warps=warps)
    return out


def unpermute_backward(g_TD: Tensor, y_RD: Tensor, w_TK: Tensor, asg_R: Tensor, need_grad_y: bool = True,
                       need_grad_w: bool = True) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients of ``out[t] = sum_k w[t, k] * y[pos[t, k]]`` from the row side, in one pass over the rows:
    ``grad_y[r] = w(asg[r]) * g[asg[r] // k]`` ([R, D], y's dtype; zero for padding rows, asg -1) and
    ``grad_w(asg[r]) = <y[r], g[asg[r] // k]>`` ([T, k], w's dtype, fp32 dot; zero for assignments without a row)."""
    T, k = w_TK.shape
    R, D = y_RD.shape
    grad_y = y_RD.new_empty(R, D) if need_grad_y else None
    grad_w = torch.zeros(T, k, dtype=torch.float32, device=y_RD.device) if need_grad_w else None
    if R and D and (need_grad_y or need_grad_w):
        if T == 0:  # every row is padding
            if grad_y is not None:
                grad_y.zero_()
        else:
            block, warps = _row_block(D)
            dummy = asg_R  # placeholder pointer for an output not asked for
            _kernels().unpermute_bwd_kernel[(R,)](
                _c(g_TD), _c(y_RD), _c(w_TK), _c(asg_R),
                grad_y if grad_y is not None else dummy, grad_w if grad_w is not None else dummy, D, K=k,
                NEED_GY=need_grad_y, NEED_GW=need_grad_w, BLOCK_D=block, num_warps=warps)
    elif grad_y is not None:
        grad_y.zero_()
    return grad_y, (grad_w.to(w_TK.dtype) if grad_w is not None else None)


# ---- SwiGLU ---------------------------------------------------------------------------------------------------------


class _SwiGLU(torch.autograd.Function):
    """h = silu(g) * u with fp32 math; saves g and u, the backward recomputes silu (one pass, two outputs)."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor) -> Tensor:
        dtype = torch.promote_types(g.dtype, u.dtype)
        g, u = _c(g).to(dtype), _c(u).to(dtype)
        ctx.save_for_backward(g, u)
        h = torch.empty_like(g)
        _elementwise(_kernels().swiglu_fwd_kernel, g, u, h)
        return h

    @staticmethod
    def backward(ctx, dh: Tensor):
        g, u = ctx.saved_tensors
        return swiglu_backward(g, u, None, dh)[:2]


def _elementwise(kernel, *tensors: Tensor) -> None:
    n = tensors[0].numel()
    if n:
        kernel[(_cdiv(n, _EW_BLOCK),)](*tensors, n, BLOCK=_EW_BLOCK, num_warps=_EW_WARPS)


class _SwiGLUProbs(torch.autograd.Function):
    """h = silu(g) * u * p[:, None] with fp32 math; saves g, u and p, the backward recomputes silu and reduces
    dp over each row (one program per row: no atomics, a fixed summation order)."""

    @staticmethod
    def forward(ctx, g_RF: Tensor, u_RF: Tensor, p_R: Tensor) -> Tensor:
        dtype = torch.promote_types(g_RF.dtype, u_RF.dtype)
        g, u, p = _c(g_RF).to(dtype), _c(u_RF).to(dtype), _c(p_R).float()
        ctx.save_for_backward(g, u, p)
        ctx.p_dtype = p_R.dtype
        h = torch.empty_like(g)
        R, F_ = g.shape
        if h.numel():
            block, warps = _row_block(F_)
            _kernels().swiglu_probs_fwd_kernel[(R, _cdiv(F_, block))](g, u, p, h, F_, BLOCK_F=block, num_warps=warps)
        return h

    @staticmethod
    def backward(ctx, dh: Tensor):
        g, u, p = ctx.saved_tensors
        dg, du, dp = swiglu_backward(g, u, p, dh, need_dp=ctx.needs_input_grad[2])
        return dg, du, (dp.to(ctx.p_dtype) if dp is not None else None)


def swiglu_backward(g: Tensor, u: Tensor, p: Optional[Tensor], dh: Tensor,
                    need_dp: bool = True) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The kernels' backward of :func:`swiglu` from its saved (contiguous) ``g``, ``u`` and fp32 row weights ``p``
    (None: no weights): ``(dg, du, dp)`` in g's dtype (dp fp32; None without weights or ``need_dp``)."""
    dg, du = torch.empty_like(g), torch.empty_like(u)
    if p is None:
        _elementwise(_kernels().swiglu_bwd_kernel, g, u, _c(dh).to(g.dtype), dg, du)
        return dg, du, None
    dp = torch.zeros_like(p) if need_dp else None
    R, F_ = g.shape
    if g.numel():
        block, warps = _row_block(F_)
        _kernels().swiglu_probs_bwd_kernel[(R,)](g, u, p, _c(dh).to(g.dtype), dg, du, dp if need_dp else p, F_,
                                                 NEED_DP=need_dp, BLOCK_F=block, num_warps=warps)
    return dg, du, dp


def swiglu(g: Tensor, u: Tensor, p_R: Optional[Tensor] = None) -> Tensor:
    """``silu(g) * u`` (same shapes), times ``p_R[:, None]`` when row weights are given (the combine weights applied
    inside the experts, in fp32): the fused kernel when :func:`use_triton`, else the PyTorch expression."""
    if use_triton(g):
        return _SwiGLU.apply(g, u) if p_R is None else _SwiGLUProbs.apply(g, u, p_R)
    return swiglu_reference(g, u, p_R)


def swiglu_reference(g: Tensor, u: Tensor, p_R: Optional[Tensor] = None) -> Tensor:
    """The PyTorch expression of :func:`swiglu`: ``silu(g) * u``, times the row weights when given (cast to h's
    dtype, so autograd keeps h and the [R] weights, no fp32 copy of h; the fused kernel multiplies in fp32)."""
    h = F.silu(g) * u
    return h if p_R is None else h * p_R.to(h.dtype).unsqueeze(1)


def swiglu_quant_rowwise(g: Tensor, u: Tensor, p_R: Optional[Tensor] = None,
                         q_dtype: torch.dtype = torch.float8_e4m3fn, *, dest_R: Optional[Tensor] = None,
                         rows: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Forward only: ``h = silu(g) * u`` (times ``p_R[:, None]``; fp32 math as :func:`swiglu`'s kernel), its FP8
    e4m3 rowwise quantization ``q`` (scale 448 / amax of the row, rounded down to a power of two, as torchao's rowwise
    recipe and :func:`lightning_moe.lowp.fp8_grouped.qdq_fp8` define it) and the rows' dequantization scales
    ``s_R`` (``q * s`` is h quantized), in one Triton kernel. ``dest_R`` / ``rows``: row r of the results goes to row
    ``dest_R[r]`` of zero-initialised outputs of ``rows`` rows (a group-padded layout,
    :func:`lightning_moe.lowp.fp8_grouped.pad_layout`). ``q_dtype`` float32 gives the e4m3 values in fp32 (the CPU
    tests: Triton's interpreter cannot store fp8). Needs :func:`use_triton`."""
    _need_triton(g, "swiglu_quant_rowwise")
    dtype = torch.promote_types(g.dtype, u.dtype)
    g, u = _c(g).to(dtype), _c(u).to(dtype)
    R, F_ = g.shape
    if dest_R is None:
        h, q = torch.empty_like(g), torch.empty_like(g, dtype=q_dtype)
        s = torch.empty(R, device=g.device, dtype=torch.float32)
    else:
        h, q = g.new_zeros(rows, F_), _zeros(rows, F_, q_dtype, g.device)
        s = torch.zeros(rows, device=g.device, dtype=torch.float32)
    if g.numel():
        p = _c(p_R).float() if p_R is not None else s  # s: an unused pointer when HAS_P is False
        dest = _c(dest_R) if dest_R is not None else s
        block, warps = _row_block(F_)
        _kernels().swiglu_probs_quant_fwd_kernel[(R,)](g, u, p, dest, h, q, s, F_, HAS_P=p_R is not None,
                                                      HAS_DEST=dest_R is not None, BLOCK_F=block, num_warps=warps)
    return h, q, s


def gather_quant_rowwise(x_TD: Tensor, asg_R: Tensor, k: int, dest_R: Tensor, rows: int,
                         q_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """:func:`gather_rows` quantized as it gathers: ``x[asg[r] // k]`` (a zero row where ``asg[r] < 0``) in FP8 e4m3
    with one power-of-two scale per row (the numerics of :func:`swiglu_quant_rowwise`), written to row ``dest_R[r]``
    of zero-initialised ``q`` [rows, D] (``q_dtype``) and ``s`` [rows] (dequantization scales). One Triton kernel;
    no high-precision copy of the rows. Needs :func:`use_triton`."""
    _need_triton(x_TD, "gather_quant_rowwise")
    R, D = asg_R.shape[0], x_TD.shape[1]
    q = _zeros(rows, D, q_dtype, x_TD.device)
    s = torch.zeros(rows, device=x_TD.device, dtype=torch.float32)
    if R and D:
        x = _c(x_TD) if x_TD.shape[0] else x_TD.new_zeros(1, D)  # no tokens: every row is padding (asg < 0)
        block, warps = _row_block(D)
        _kernels().gather_quant_rows_kernel[(R,)](x, _c(asg_R), _c(dest_R), q, s, D, K=k, BLOCK_D=block,
                                                  num_warps=warps)
    return q, s


def rms_norm_quant_rowwise(x_RD: Tensor, w_D: Tensor, eps: float,
                           q_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor, Tensor]:
    """Forward only: ``y = rms_norm(x, w, eps)`` (fp32 math, y in x's dtype), its FP8 e4m3 rowwise quantization
    ``q`` (the numerics of :func:`swiglu_quant_rowwise`, of the stored y) and the rows' dequantization scales ``s_R``,
    in one Triton kernel (the attention projections' FP8 input, made by the norm that reads x anyway). ``q_dtype``
    float32 under the interpreter. Needs :func:`use_triton`."""
    _need_triton(x_RD, "rms_norm_quant_rowwise")
    x = _c(x_RD)
    R, D = x.shape
    y, q = torch.empty_like(x), torch.empty_like(x, dtype=q_dtype)
    s = torch.empty(R, device=x.device, dtype=torch.float32)
    if x.numel():
        block, warps = _row_block(D)
        _kernels().rms_norm_quant_fwd_kernel[(R,)](x, _c(w_D), y, q, s, D, float(eps), BLOCK_D=block,
                                                   num_warps=warps)
    return y, q, s


def _zeros(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros of ``dtype``; float8 through a uint8 view (zero bytes are fp8 zeros; no fill kernel for fp8 needed)."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        return torch.zeros(rows, cols, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(rows, cols, dtype=dtype, device=device)


def _need_triton(t: Tensor, what: str) -> None:
    if not use_triton(t):
        raise RuntimeError(f"{what} is a Triton kernel: CUDA tensors (or the interpreter), got "
                           f"{t.device.type} with {ENV_VAR}={backend()}")
