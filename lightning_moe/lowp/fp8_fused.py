"""FP8 rowwise quantization fused into the passes the routed experts already make (issue 23): the SwiGLU kernel
quantizes its output for the down projection, the row gather quantizes the rows for the gate / up projections, and
each weight's FP8 copy is made once per optimizer step rather than once per use.

Legend: T tokens, k top-k, R rows grouped by local expert, P rows of the group-padded layout (every group starts at a
multiple of 16, :func:`~lightning_moe.lowp.fp8_grouped.pad_layout`), D hidden, F expert hidden size, E local experts;
``w_EKN`` a grouped GEMM's weight operand (a transposed view of the [E, N, K] weight).

Numerics: those of the unfused rowwise path, :class:`~lightning_moe.callbacks.LowPrecisionGroupedMM` with
``fp8_rowwise`` (torchao 0.18's ``_to_fp8_rowwise_then_scaled_grouped_mm``; the module docstring of
:mod:`lightning_moe.lowp.fp8_grouped`): e4m3 everywhere, power-of-two scales; forward x rowwise and w per
(expert, n); dgrad dy rowwise and w per (expert, k); wgrad x and dy per (group, column) from their high-precision
values (``wgrad_hp=True``, the ``fp8_rowwise_gw_hp`` recipe: the weight gradients a bf16 grouped GEMM of those
high-precision values, no FP8). The fused quantizers produce bit for bit what the unfused path quantizes, so the two
agree to fp32 rounding
(tests/test_fp8_fused.py, in emulation and with the Triton kernels under the interpreter). Operands: ``emulate=True``
dequantizes and runs fp32 ``torch._grouped_mm`` (any device); else ``torch._scaled_grouped_mm`` on sm90 with
torchao's own quantization kernels for every operand the fused passes do not produce.

What each fused step saves for its backward (decided for exactness):

* SwiGLU + down (:func:`fp8_swiglu_down`): g, u (and the row weights) for the SwiGLU backward, and h in the compute
  dtype (bf16), in the padded layout: the weight gradient quantizes h per (expert, column) from its high-precision
  values, and quantizing the rowwise FP8 copy instead would round twice (not the unfused numbers). The same tensors
  the unfused path keeps (SwiGLU: g, u; torchao's GEMM: padded h).
* gather + gate / up (:func:`fp8_gather_gate_up`): the tokens only; the backward gathers the rows again in high
  precision for the weight gradients (as the bf16 regather path, ``_GatherGateUp``), so no [R, D] copy is kept.

Weights (:class:`Fp8WeightCache`): the FP8 copy of a weight operand (forward layout and dgrad layout) is kept per
projection and reused while the weight is the same tensor at the same version (``_version``) and no optimizer has
stepped since (a process-wide optimizer step pre-hook advances a generation): a recompute (``moe_act`` /
``experts`` activation checkpointing) and later micro-batches of a step reuse it. Memory: up to two FP8 copies (1 byte
per element each) of every cached expert weight, held until replaced.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_moe.lowp.fp8_grouped import _qdq_along, emulated_wgrad, pad_layout, quantize_rowwise
from lightning_moe.lowp.fp8_stochastic import stochastic_round_e4m3
from lightning_moe.moe import kernels

__all__ = ["ALIGN", "Fp8WeightCache", "fp8_gather_gate_up", "fp8_rowwise_grouped_mm", "fp8_swiglu_down"]

ALIGN = 16  # rows per group of the FP8 grouped GEMM (torch._scaled_grouped_mm)
E4M3 = torch.float8_e4m3fn
Operand = tuple[Tensor, Optional[Tensor]]  # (FP8 data, fp32 dequantization scales) or (dequantized fp32, None)

# ---- weight cache -------------------------------------------------------------------------------------------------

_GENERATION = [0]
_HOOK: list = []


def _next_generation(optimizer, args, kwargs) -> None:
    _GENERATION[0] += 1


def _ensure_step_hook() -> None:
    if not _HOOK:  # one process-wide hook: any optimizer step invalidates every cached FP8 weight
        _HOOK.append(register_optimizer_step_pre_hook(_next_generation))


class Fp8WeightCache:
    """FP8 copies of weight operands, one per (slot, layout): valid while the operand is a view of the same base
    tensor (held, so its memory is not reused), with the same geometry, at the same ``_version``, in the same
    optimizer-step generation. ``hits`` / ``misses`` count lookups (tests, benches)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple] = {}
        self.hits = self.misses = 0
        _ensure_step_hook()

    def __repr__(self) -> str:
        return f"Fp8WeightCache(entries={len(self._entries)}, hits={self.hits}, misses={self.misses})"

    def clear(self) -> None:
        self._entries.clear()

    def get(self, slot: str, layout: str, w: Tensor, make: Callable[[Tensor], Operand]) -> Operand:
        if w.is_inference():  # inference tensors have no version counter
            return make(w)
        base = w if w._base is None else w._base
        stamp = (base._version, _GENERATION[0], tuple(w.shape), w.stride(), w.storage_offset(), w.dtype)
        entry = self._entries.get((slot, layout))
        if entry is not None and entry[0] is base and entry[1] == stamp:
            self.hits += 1
            return entry[2]
        self.misses += 1
        value = make(w)
        self._entries[(slot, layout)] = (base, stamp, value)
        return value


# ---- the FP8 operations (emulated / torchao + torch._scaled_grouped_mm) ---------------------------------------------


class _Ops:
    """One implementation of the FP8 rowwise grouped GEMM's pieces; operands are :data:`Operand` pairs.
    ``wgrad_hp``: weight gradients as high-precision grouped GEMMs (no FP8); ``bwd_fast_accum``: Hopper's fast FP8
    accumulation in the backward GEMMs too (torchao's grouped default; its dense default keeps it to the forward);
    ``fwd_fast_accum``: in the forward GEMMs (torchao's default; False promotes the partial sums to fp32);
    ``sr_weights``: the weight operands stochastically rounded onto their casts' grids
    (:func:`~lightning_moe.lowp.fp8_stochastic.stochastic_round_e4m3`; the casts then round nothing)."""

    def __init__(self, emulate: bool, wgrad_hp: bool = False, bwd_fast_accum: bool = True,
                 fwd_fast_accum: bool = True, sr_weights: bool = False) -> None:
        self.emulate, self.wgrad_hp, self.sr_weights = emulate, wgrad_hp, sr_weights
        self.bwd_fast_accum, self.fwd_fast_accum = bwd_fast_accum, fwd_fast_accum
        # e4m3 values in fp32 under emulation (Triton's interpreter cannot store fp8; fp32 holds them exactly)
        self.q_dtype = torch.float32 if emulate else E4M3

    def given(self, q: Tensor, s: Tensor) -> Operand:
        return (q.float() * s[:, None], None) if self.emulate else (q, s)

    def rows(self, x_MK: Tensor) -> Operand:
        """x rowwise (the left operand of the forward and the dgrad)."""
        if self.emulate:
            return _qdq_along(x_MK, -1), None
        from torchao.prototype.moe_training.kernels import triton_fp8_rowwise_2d_scale_and_cast

        q, scale = triton_fp8_rowwise_2d_scale_and_cast(x_MK, output_dtype=E4M3, round_scales_to_power_of_2=True)
        return q, scale.squeeze(-1).reciprocal()

    def w_fwd(self, w_EKN: Tensor) -> Operand:
        """The forward's weight: per (expert, n), amax over K."""
        with torch.no_grad():
            if self.sr_weights:
                w_EKN = stochastic_round_e4m3(w_EKN, dim=-2)
            if self.emulate:
                return _qdq_along(w_EKN, -2), None
            from torchao.prototype.moe_training.kernels import triton_fp8_colwise_3d_scale_and_cast

            q, scale = triton_fp8_colwise_3d_scale_and_cast(w_EKN, output_dtype=E4M3, round_scales_to_power_of_2=True)
            return q, scale.squeeze(1).reciprocal()

    def w_dgrad(self, w_EKN: Tensor) -> Operand:
        """The dgrad's weight ``w[g].T`` [E, N, K]: per (expert, k), amax over N."""
        with torch.no_grad():
            if self.sr_weights:
                w_EKN = stochastic_round_e4m3(w_EKN, dim=-1)
            if self.emulate:
                return _qdq_along(w_EKN, -1).transpose(-2, -1), None
            from torchao.prototype.moe_training.kernels import triton_fp8_rowwise_3d_transpose_rhs

            q, scale = triton_fp8_rowwise_3d_transpose_rhs(w_EKN, output_dtype=E4M3, round_scales_to_power_of_2=True)
            return q, scale.squeeze(1).reciprocal()

    def mm(self, a: Operand, b: Operand, offs: Tensor, out_dtype: torch.dtype,
           fast_accum: Optional[bool] = None) -> Tensor:
        """A forward GEMM (``fast_accum`` None: ``fwd_fast_accum``), or the dgrad's."""
        if self.emulate:
            return torch._grouped_mm(a[0], b[0], offs=offs).to(out_dtype)
        fast = self.fwd_fast_accum if fast_accum is None else fast_accum
        return torch._scaled_grouped_mm(a[0], b[0], a[1], b[1], offs, out_dtype=out_dtype, use_fast_accum=fast)

    def dgrad(self, dy_PN: Tensor, w_op: Operand, offs: Tensor, out_dtype: torch.dtype) -> Tensor:
        """``dx = dy @ w[g].T``, ``w_op`` from :meth:`w_dgrad`."""
        return self.mm(self.rows(dy_PN), w_op, offs, out_dtype, fast_accum=self.bwd_fast_accum)

    def wgrad(self, x_PK: Tensor, dy_PN: Tensor, offs: Tensor, out_dtype: torch.dtype) -> Tensor:
        """``dw[g] = x[g].T @ dy[g]`` as [E, K, N] (the ``w_EKN`` operand's gradient)."""
        if self.wgrad_hp:
            if self.emulate:
                return torch._grouped_mm(x_PK.float().t(), dy_PN.float(), offs=offs).to(out_dtype)
            return torch._grouped_mm(x_PK.t(), dy_PN.to(x_PK.dtype), offs=offs).to(out_dtype)
        if self.emulate:
            return emulated_wgrad(x_PK, dy_PN, offs, offs.numel()).to(out_dtype)
        from torchao.prototype.moe_training.kernels import triton_fp8_per_group_colwise_scales_dual

        dq, ds, xq, xs = triton_fp8_per_group_colwise_scales_dual(dy_PN, x_PK, offs, E4M3,
                                                                  round_scales_to_power_of_2=True)
        dw_ENK = torch._scaled_grouped_mm(dq.t(), xq, ds.t().reciprocal(), xs.reciprocal(), offs,
                                          out_dtype=out_dtype, use_fast_accum=self.bwd_fast_accum)
        return dw_ENK.transpose(-2, -1)


def _pad_rows(x_RC: Tensor, dest: Tensor, P: int) -> Tensor:
    """Row r of x to row dest[r] of P zero rows (float8 moved as bytes: index_copy has no fp8 kernels)."""
    x = x_RC.contiguous()
    if x.dtype.itemsize == 1 and x.dtype.is_floating_point:
        return _pad_rows(x.view(torch.uint8), dest, P).view(x.dtype)
    return x.new_zeros(P, x.shape[1]).index_copy(0, dest, x)


def _cached(cache: Optional[Fp8WeightCache], slot: str, layout: str, w: Tensor, make) -> Operand:
    return make(w) if cache is None else cache.get(slot, layout, w, make)


# ---- SwiGLU + quantize -> down projection ---------------------------------------------------------------------------


def _swiglu_quant_padded(g: Tensor, u: Tensor, p: Optional[Tensor], dest: Tensor, P: int,
                         q_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """h, its rowwise FP8 values and scales, in the padded layout: the fused kernel, or its PyTorch reference."""
    if kernels.use_triton(g):
        return kernels.swiglu_quant_rowwise(g, u, p, q_dtype, dest_R=dest, rows=P)
    h = kernels.swiglu_reference(g, u, p)
    q, s = quantize_rowwise(h, q_dtype)
    return _pad_rows(h, dest, P), _pad_rows(q, dest, P), s.new_zeros(P).index_copy(0, dest, s)


class _Fp8SwiGLUDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g_RF: Tensor, u_RF: Tensor, p_R: Optional[Tensor], w_EFD: Tensor, offs_E: Tensor, ops: _Ops,
                cache: Optional[Fp8WeightCache]) -> Tensor:
        dtype = torch.promote_types(g_RF.dtype, u_RF.dtype)
        g, u = g_RF.contiguous().to(dtype), u_RF.contiguous().to(dtype)
        p = p_R.contiguous().float() if p_R is not None else None
        P, pad_offs, dest = pad_layout(offs_E, g.shape[0], ALIGN)
        h_P, q_P, s_P = _swiglu_quant_padded(g, u, p, dest, P, ops.q_dtype)
        w_op = _cached(cache, "w2", "fwd", w_EFD, ops.w_fwd)
        y = ops.mm(ops.given(q_P, s_P), w_op, pad_offs, dtype).index_select(0, dest)
        ctx.save_for_backward(g, u, p, h_P, w_EFD, pad_offs, dest)
        ctx.ops, ctx.cache, ctx.p_dtype = ops, cache, p_R.dtype if p_R is not None else None
        return y

    @staticmethod
    def backward(ctx, dy_RD: Tensor):
        g, u, p, h_P, w_EFD, pad_offs, dest = ctx.saved_tensors
        ops = ctx.ops
        dy_P = _pad_rows(dy_RD, dest, h_P.shape[0])
        dg = du = dp = dw = None
        if any(ctx.needs_input_grad[:3]):
            w_op = _cached(ctx.cache, "w2", "dgrad", w_EFD, ops.w_dgrad)
            dh = ops.dgrad(dy_P, w_op, pad_offs, g.dtype).index_select(0, dest)
            dg, du, dp = _swiglu_backward(g, u, p, dh, need_dp=ctx.needs_input_grad[2])
            dp = dp.to(ctx.p_dtype) if dp is not None else None
        if ctx.needs_input_grad[3]:
            dw = ops.wgrad(h_P, dy_P, pad_offs, w_EFD.dtype)
        return dg, du, dp, dw, None, None, None


def _swiglu_backward(g: Tensor, u: Tensor, p: Optional[Tensor], dh: Tensor,
                     need_dp: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The backward of the forward's SwiGLU: the kernels' (``kernels.swiglu_backward``) or the reference
    expression's own autograd (recomputed)."""
    if kernels.use_triton(g):
        return kernels.swiglu_backward(g, u, p, dh, need_dp=need_dp)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (g, u)] + ([p.detach().requires_grad_()] if need_dp else [])
        h = kernels.swiglu_reference(leaves[0], leaves[1], leaves[2] if need_dp else p)
        grads = torch.autograd.grad(h, leaves, dh)
    return grads[0], grads[1], grads[2] if need_dp else None


def fp8_swiglu_down(g_RF: Tensor, u_RF: Tensor, p_R: Optional[Tensor], w_EFD: Tensor, offs_E: Tensor, *,
                    emulate: bool, cache: Optional[Fp8WeightCache] = None, wgrad_hp: bool = False,
                    bwd_fast_accum: bool = True, fwd_fast_accum: bool = True, sr_weights: bool = False) -> Tensor:
    """``grouped_mm(swiglu(g, u, p), w_EFD, offs)`` in the FP8 rowwise recipe with SwiGLU's output quantized by the
    SwiGLU kernel itself (the down GEMM takes its FP8 data and row scales: no second pass over h). [R, D] in the
    compute dtype; the numbers of the unfused path (module docstring). ``wgrad_hp``, ``*_fast_accum``: ``_Ops``."""
    ops = _Ops(emulate, wgrad_hp, bwd_fast_accum, fwd_fast_accum, sr_weights)
    return _Fp8SwiGLUDown.apply(g_RF, u_RF, p_R, w_EFD, offs_E, ops, cache)


# ---- gather + quantize -> gate / up projections --------------------------------------------------------------------


class _Fp8GatherGateUp(torch.autograd.Function):
    """Rows ``x_TD[asg_R // k]`` gathered straight into FP8 (one pass, padded layout), both projections from that one
    quantization; the backward gathers the rows again in high precision for the weight gradients and sums both input
    gradients into the tokens (one k-sum), as ``_GatherGateUp`` does in bf16."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, asg_R: Tensor, pos_TK: Tensor, w1_EDF: Tensor, w3_EDF: Tensor, offs_E: Tensor,
                ops: _Ops, cache: Optional[Fp8WeightCache]) -> tuple[Tensor, Tensor]:
        k = pos_TK.shape[1]
        P, pad_offs, dest = pad_layout(offs_E, asg_R.shape[0], ALIGN)
        x_op = ops.given(*kernels.gather_quant_rowwise(x_TD, asg_R, k, dest, P, ops.q_dtype))
        g = ops.mm(x_op, _cached(cache, "w1", "fwd", w1_EDF, ops.w_fwd), pad_offs, x_TD.dtype)
        u = ops.mm(x_op, _cached(cache, "w3", "fwd", w3_EDF, ops.w_fwd), pad_offs, x_TD.dtype)
        ctx.save_for_backward(x_TD, asg_R, pos_TK, w1_EDF, w3_EDF, pad_offs, dest)
        ctx.ops, ctx.cache, ctx.P = ops, cache, P
        return g.index_select(0, dest), u.index_select(0, dest)

    @staticmethod
    def backward(ctx, dg_RF: Tensor, du_RF: Tensor):
        x_TD, asg_R, pos_TK, w1, w3, pad_offs, dest = ctx.saved_tensors
        ops, cache, P = ctx.ops, ctx.cache, ctx.P
        dg_P, du_P = _pad_rows(dg_RF, dest, P), _pad_rows(du_RF, dest, P)
        grad_x = grad_w1 = grad_w3 = None
        if ctx.needs_input_grad[0]:
            dx_g = ops.dgrad(dg_P, _cached(cache, "w1", "dgrad", w1, ops.w_dgrad), pad_offs, x_TD.dtype)
            dx_u = ops.dgrad(du_P, _cached(cache, "w3", "dgrad", w3, ops.w_dgrad), pad_offs, x_TD.dtype)
            grad_x = kernels.k_sum(dx_g.index_select(0, dest), pos_TK, rows2_RD=dx_u.index_select(0, dest))
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            x_P = _pad_rows(kernels.gather_rows(x_TD, asg_R, pos_TK.shape[1]), dest, P)
            if ctx.needs_input_grad[3]:
                grad_w1 = ops.wgrad(x_P, dg_P, pad_offs, w1.dtype)
            if ctx.needs_input_grad[4]:
                grad_w3 = ops.wgrad(x_P, du_P, pad_offs, w3.dtype)
        return grad_x, None, None, grad_w1, grad_w3, None, None, None


def fp8_gather_gate_up(x_TD: Tensor, asg_R: Tensor, pos_TK: Tensor, w1_EDF: Tensor, w3_EDF: Tensor, offs_E: Tensor,
                       *, emulate: bool, cache: Optional[Fp8WeightCache] = None, wgrad_hp: bool = False,
                       bwd_fast_accum: bool = True, fwd_fast_accum: bool = True,
                       sr_weights: bool = False) -> tuple[Tensor, Tensor]:
    """The gate and up grouped GEMMs of the rows ``x_TD[asg_R // k]`` (``pos_TK`` the rows of each token's
    assignments, -1 none) in the FP8 rowwise recipe, the rows quantized as they are gathered
    (:func:`lightning_moe.moe.kernels.gather_quant_rowwise`, once for both GEMMs). Triton kernels only (CUDA or the
    interpreter): the experts take this path only where they gather their own rows. ``wgrad_hp``, ``*_fast_accum``:
    ``_Ops``."""
    ops = _Ops(emulate, wgrad_hp, bwd_fast_accum, fwd_fast_accum, sr_weights)
    return _Fp8GatherGateUp.apply(x_TD, asg_R, pos_TK, w1_EDF, w3_EDF, offs_E, ops, cache)


# ---- the unfused GEMM with the same pieces (the reference path of the recipes torchao's function lacks) ---------------


class _Fp8RowwiseGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_PK: Tensor, w_EKN: Tensor, offs_E: Tensor, ops: _Ops) -> Tensor:
        ctx.save_for_backward(x_PK, w_EKN, offs_E)
        ctx.ops = ops
        return ops.mm(ops.rows(x_PK), ops.w_fwd(w_EKN), offs_E, x_PK.dtype)

    @staticmethod
    def backward(ctx, dy_PN: Tensor):
        x_PK, w_EKN, offs_E = ctx.saved_tensors
        ops, dy_PN = ctx.ops, dy_PN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = ops.dgrad(dy_PN, ops.w_dgrad(w_EKN), offs_E, x_PK.dtype)
        if ctx.needs_input_grad[1]:
            dw = ops.wgrad(x_PK, dy_PN, offs_E, w_EKN.dtype)
        return dx, dw, None, None


def fp8_rowwise_grouped_mm(x_PK: Tensor, w_EKN: Tensor, offs_E: Tensor, *, emulate: bool, wgrad_hp: bool = False,
                           bwd_fast_accum: bool = True, fwd_fast_accum: bool = True,
                           sr_weights: bool = False) -> Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` in the FP8 rowwise recipe, each operand quantized here (groups already
    16-aligned: :func:`~lightning_moe.lowp.fp8_grouped.pad_groups`); with the defaults, the numbers of torchao's
    ``_to_fp8_rowwise_then_scaled_grouped_mm``. ``wgrad_hp``, ``*_fast_accum``: ``_Ops``."""
    return _Fp8RowwiseGroupedMM.apply(x_PK, w_EKN, offs_E,
                                      _Ops(emulate, wgrad_hp, bwd_fast_accum, fwd_fast_accum, sr_weights))
