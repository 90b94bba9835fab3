"""Dense FP8 linear for eager training (issue 23): torchao's tensorwise / rowwise numerics with every quantization one
fused kernel, the input quantized once for all the linears that read it (by the RMSNorm that makes it, where it can),
the weight once per optimizer step, and -- in the tensorwise recipe -- the FP8 input saved for the backward.

Why not torchao's ``Float8Linear`` here: in eager mode its casts are several PyTorch ops each (amax, scale, multiply,
clamp, cast), which cost more than the FP8 GEMM saves (0.1-0.3x of bf16 on an H200 at every measured shape,
``bench/results/fp8_crossover_h200.log``); torchao expects ``torch.compile`` to fuse them. Inside a compiled region
the callback keeps torchao's module (inductor fuses its casts into the neighbouring kernels); this one runs eagerly.

Legend: M rows (tokens), K in features, N out features; ``w_NK`` the ``nn.Linear`` weight.

Numerics (those of torchao 0.18's ``Float8LinearConfig.from_recipe_name(...)``, the reference the tests compare
with, ``emulate=True`` on both sides):

* ``rowwise``: every operand e4m3, scales ``448 / amax`` (amax >= 1e-12) rounded down to a power of two. Forward:
  x per row (amax over K), w per output row n (over K). dgrad ``dx = dy @ w``: dy per row (over N), w per input
  column k (over N). wgrad ``dw = dy.T @ x``: dy per column n and x per column k, both over M, quantized from their
  high-precision values -- so the bf16 x is what the backward keeps (a rowwise FP8 x re-quantized per column would
  round twice).
* ``wgrad_hp=True`` (with ``rowwise``; torchao's ``rowwise_with_gw_hp`` idea): the weight gradient ``dw = dy.T @ x``
  is a plain GEMM of the high-precision dy and x (fp32 accumulation): a per-column scale spans every token, so in
  e4m3 the rows far below a column's largest lose their bits; the forward and the dgrad stay FP8 (the dgrad's weight
  per input column k, as above, where torchao's recipe takes one tensorwise scale).
* ``tensorwise``: one fp32 scale ``max / amax`` per tensor (not rounded), x and w e4m3, dy e5m2. The forward's FP8
  x (and its scale) *is* the wgrad's operand, transposed, so the backward keeps it instead of the bf16 x: half the
  bytes of the input saved per linear.

Products accumulate in fp32 (``torch._scaled_mm``; fast accumulation in the forward, as torchao configures it, unless
``fast_accum=False``); the output is in x's dtype. ``emulate=True`` quantize-dequantizes with the same scales and
runs fp32 matmuls (any device).

Kernels (``emulate=False``, CUDA sm89+): ``torch._scaled_mm``, and every cast one of our Triton passes
(:mod:`lightning_moe.lowp.fp8_casts`): rowwise rows in one kernel (``cast_rowwise``: x, w, dy), columns in two
(``cast_colwise``, a column amax split over M and a tiled cast: the wgrad's dy and x, the dgrad's w); a tensorwise cast
is one amax reduction and one pass (``cast_tensorwise``) writing the layouts its GEMMs want from one read: dy once for
both gradients (row-major for the dgrad, column-major for the wgrad), the weight's dgrad operand column-major (cached
once a step). torchao's kernels were slower here: its ``triton_fp8_rowwise_2d_scale_and_cast`` took ~150 us of GPU and
~500 us of CPU (custom-op and autotune dispatch) per call at 16384 x 2048-4096 on an H200; its one-group
``triton_fp8_per_group_colwise_scales_dual`` runs one program per block of columns over all M rows (too few programs
to fill the GPU). Rows are zero-padded to a multiple of 16 where M is not one (the FP8 GEMM's alignment; zero rows
change no amax).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe.lowp.fp8_casts import (E4M3, E5M2, _tensor_scale, cast_colwise, cast_rowwise, cast_tensorwise,
                                          transpose_fp8)
from lightning_moe.lowp.fp8_grouped import fp8_scale, qdq_fp8, quantize_rowwise
from lightning_moe.lowp.fp8_stochastic import stochastic_round_e4m3
from lightning_moe.lowp.high_precision import high_precision_active
from lightning_moe.moe import kernels

__all__ = ["Fp8InputCache", "Fp8Linear", "Fp8QuantRMSNorm", "fp8_linear", "fp8_rms_norm", "fp8_class",
           "LINEAR_RECIPES", "saved_input_bytes"]

LINEAR_RECIPES = ("rowwise", "tensorwise")
ALIGN = 16
Operand = tuple[Tensor, Optional[Tensor]]  # (FP8 data, fp32 dequantization scale(s)) or (dequantized fp32, None)


class Fp8InputCache:
    """The FP8 form of one activation read by ``consumers`` linears (q / k / v; MLA's wq_a and wkv_a; an MLP's w1 and
    w3), or made by the RMSNorm that produced it: the first reader that finds no entry for its input quantizes it and
    stores the result, the others take it. One entry, matched by identity (a weak reference: the cache never keeps an
    activation alive) and ``_version``; it is dropped once every consumer has read it or its activation is freed,
    so no FP8 copy outlives the forward of its block. ``hits`` / ``misses`` count lookups (tests)."""

    def __init__(self, consumers: int) -> None:
        assert consumers >= 1
        self.consumers = consumers
        self._entry: Optional[tuple[Any, int, str, Operand]] = None
        self._reads = 0
        self.hits = self.misses = 0

    def __repr__(self) -> str:
        return f"Fp8InputCache(consumers={self.consumers}, hits={self.hits}, misses={self.misses})"

    def put(self, x: Tensor, recipe: str, value: Operand) -> None:
        """Store the FP8 form of ``x`` (by the norm that made it, or by the first reader)."""
        if x.is_inference():  # no version counter
            return
        # the entry dies with its activation (a norm recomputed in the backward stores one that no linear reads)
        self._entry, self._reads = (weakref.ref(x, self._expire), x._version, recipe, value), 0

    def _expire(self, ref: Any) -> None:
        if self._entry is not None and self._entry[0] is ref:
            self._entry = None

    def read(self, x: Tensor, recipe: str) -> Optional[Operand]:
        """The stored FP8 form of ``x`` (counted as one consumer's read), or None."""
        e = self._entry
        if e is not None and e[0]() is x and e[1] == x._version and e[2] == recipe:
            self.hits += 1
            self._count_read()
            return e[3]
        self.misses += 1
        return None

    def stored_by_reader(self) -> None:
        """The reader that missed stored what it quantized: that is its read."""
        self._count_read()

    def _count_read(self) -> None:
        self._reads += 1
        if self._reads >= self.consumers:
            self._entry = None


# ---- the pieces, emulated or on the kernels ---------------------------------------------------------------------


def _pad_rows(x_MC: Tensor, M_pad: int) -> Tensor:
    if x_MC.shape[0] == M_pad:
        return x_MC
    return torch.cat([x_MC, x_MC.new_zeros(M_pad - x_MC.shape[0], x_MC.shape[1])])


def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
               fast_accum: bool = False) -> Tensor:
    """``torch._scaled_mm`` with its CUDA layout contract checked everywhere (CPU runs the same calls in tests):
    ``a`` row-major, ``b`` column-major, rowwise scales ``[M, 1]`` / ``[1, N]`` or one scalar each."""
    assert a.is_contiguous() and b.t().is_contiguous(), "FP8 GEMM operands: a row-major, b column-major"
    assert scale_a.numel() in (1, a.shape[0]) and scale_b.numel() in (1, b.shape[1])
    return torch._scaled_mm(a, b, scale_a=scale_a.float().contiguous(), scale_b=scale_b.float().contiguous(),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class _Ops:
    """One implementation of the linear's quantized operands and GEMMs; operands are :data:`Operand` pairs."""

    def __init__(self, recipe: str, emulate: bool, wgrad_hp: bool = False, fast_accum: bool = True,
                 dgrad_hp: bool = False, sr_weights: bool = False) -> None:
        assert recipe in LINEAR_RECIPES and not (wgrad_hp and recipe != "rowwise")
        assert not (sr_weights and recipe != "rowwise")
        self.recipe, self.emulate, self.wgrad_hp, self.fast_accum = recipe, emulate, wgrad_hp, fast_accum
        self.dgrad_hp, self.sr_weights = dgrad_hp, sr_weights

    # -- rowwise ---------------------------------------------------------------------------------------------------
    def _rows(self, x_MC: Tensor) -> Operand:
        """Per-row e4m3 (amax over the columns); scales [rows, 1]."""
        if self.emulate:
            return qdq_fp8(x_MC, fp8_scale(x_MC.detach().abs().float().amax(dim=-1, keepdim=True))), None
        if kernels.use_triton(x_MC):
            q, s = cast_rowwise(x_MC)
        else:  # the same values with PyTorch ops (CPU tests of the GEMM calls)
            q, s = quantize_rowwise(x_MC.contiguous())
        return q, s[:, None]

    @staticmethod
    def _cols_dual(dy_MN: Tensor, x_MK: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Both wgrad operands per column (amax over M), column-major e4m3 data and [N] / [K] dequantization
        scales: ``cast_colwise`` with the Triton kernels, PyTorch ops (the same values) elsewhere."""
        if kernels.use_triton(dy_MN):
            return (*cast_colwise(dy_MN), *cast_colwise(x_MK))
        dq, ds = quantize_rowwise(dy_MN.t().contiguous())
        xq, xs = quantize_rowwise(x_MK.t().contiguous())
        return dq.t(), ds, xq.t(), xs

    # -- the operands ----------------------------------------------------------------------------------------------
    def x_fwd(self, x_MK: Tensor) -> Operand:
        with torch.no_grad():
            if self.recipe == "rowwise":
                return self._rows(x_MK)
            if self.emulate:
                return qdq_fp8(x_MK, _tensor_scale(x_MK, E4M3), E4M3), None
            q, _, sinv = cast_tensorwise(x_MK, E4M3)
            return q, sinv

    def w_fwd(self, w_NK: Tensor) -> Operand:
        """The forward's weight (and, tensorwise, the dgrad's too: one scale, any layout)."""
        with torch.no_grad():
            if self.recipe == "rowwise":
                if self.sr_weights:  # onto the grid the cast below uses, so it quantizes exactly
                    w_NK = stochastic_round_e4m3(w_NK, dim=-1)
                return self._rows(w_NK)  # per output row n, amax over K
            if self.emulate:
                return qdq_fp8(w_NK, _tensor_scale(w_NK, E4M3), E4M3), None
            q, _, sinv = cast_tensorwise(w_NK, E4M3)
            return q, sinv

    def w_dgrad(self, w_NK: Tensor) -> Operand:
        """The dgrad's weight as the GEMM's right operand ``[N, K]`` column-major (made once per step with a weight
        cache): rowwise per input column k (amax over N; scales [K]), tensorwise the forward's values."""
        with torch.no_grad():
            if self.recipe == "rowwise":
                if self.sr_weights:  # its own draw, on the per-column grid
                    w_NK = stochastic_round_e4m3(w_NK, dim=0)
                if self.emulate:
                    return qdq_fp8(w_NK, fp8_scale(w_NK.detach().abs().float().amax(dim=0, keepdim=True))), None
                if kernels.use_triton(w_NK):
                    return cast_colwise(w_NK)
                q, s = quantize_rowwise(w_NK.t().contiguous())
                return q.t(), s
            if self.emulate:
                return self.w_fwd(w_NK)
            _, qt, sinv = cast_tensorwise(w_NK, E4M3, rows=False, cols=True)
            return qt, sinv

    def dy_tensorwise(self, dy_MN: Tensor, rows: bool, cols: bool) -> tuple[Optional[Tensor], Optional[Tensor], Any]:
        """Tensorwise dy (e5m2, one scale), cast once for both GEMMs: row-major for the dgrad, column-major for the
        wgrad (emulation: the dequantized fp32 values for both, scale None)."""
        with torch.no_grad():
            if self.emulate:
                d = qdq_fp8(dy_MN, _tensor_scale(dy_MN, E5M2), E5M2)
                return d, d, None
            return cast_tensorwise(dy_MN, E5M2, rows=rows, cols=cols)

    # -- the GEMMs ---------------------------------------------------------------------------------------------------
    def forward(self, x: Operand, w: Operand, out_dtype: torch.dtype) -> Tensor:
        if self.emulate:
            return (x[0] @ w[0].t()).to(out_dtype)
        scale_b = w[1].reshape(1, -1) if self.recipe == "rowwise" else w[1]
        return _scaled_mm(x[0], w[0].t(), x[1], scale_b, out_dtype, fast_accum=self.fast_accum)

    def dgrad(self, dy: Any, w_op: Operand, out_dtype: torch.dtype) -> Tensor:
        """``dx = dy @ w``; ``w_op``: :meth:`w_dgrad`; ``dy``: the bf16 dy (rowwise) or :meth:`dy_tensorwise`."""
        if self.recipe == "rowwise":
            dy = self._rows(dy)
            if self.emulate:
                return (dy[0] @ w_op[0]).to(out_dtype)
            return _scaled_mm(dy[0], w_op[0], dy[1], w_op[1].reshape(1, -1), out_dtype)
        d_row, _, d_sinv = dy
        if self.emulate:
            return (d_row @ w_op[0]).to(out_dtype)
        return _scaled_mm(d_row, w_op[0], d_sinv, w_op[1], out_dtype)  # w_op: [N, K] column-major

    def wgrad(self, dy: Any, x_saved: Any, out_dtype: torch.dtype) -> Tensor:
        """``dw = dy.T @ x`` [N, K]; ``x_saved``: the bf16 x (rowwise) or the forward's FP8 x operand (tensorwise);
        ``dy``: the bf16 dy (rowwise) or :meth:`dy_tensorwise`."""
        if self.recipe == "rowwise":
            dy_MN, x_MK = dy, x_saved
            if self.wgrad_hp:
                if self.emulate:
                    return (dy_MN.float().t() @ x_MK.float()).to(out_dtype)
                return (dy_MN.t() @ x_MK).to(out_dtype)
            if self.emulate:
                cols = lambda t: qdq_fp8(t, fp8_scale(t.detach().abs().float().amax(dim=0, keepdim=True)))
                return (cols(dy_MN).t() @ cols(x_MK)).to(out_dtype)
            dq, ds, xq, xs = self._cols_dual(dy_MN, x_MK)
            return _scaled_mm(dq.t(), xq, ds.reshape(-1, 1), xs.reshape(1, -1), out_dtype)
        _, d_col, d_sinv = dy
        xq, xs = x_saved
        if self.emulate:
            return (d_col.t() @ xq).to(out_dtype)
        # dy.T [N, M] row-major (dy's column-major copy); x [M, K] column-major (a transposed copy of the FP8 x)
        return _scaled_mm(d_col.t(), transpose_fp8(xq).t(), d_sinv, xs, out_dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: Tensor, w_NK: Tensor, x_op: Operand, ops: _Ops, cache: Any) -> Tensor:
        w_op = _weight(cache, "fwd", w_NK, ops.w_fwd)
        y = ops.forward(x_op, w_op, x_MK.dtype)
        # rowwise: the wgrad quantizes x per column from its high-precision values; tensorwise: the FP8 x is its
        # operand already (saved instead of x: half the bytes)
        saved_x = (x_MK,) if ops.recipe == "rowwise" else tuple(t for t in x_op if t is not None)
        ctx.save_for_backward(w_NK, *saved_x)
        ctx.ops, ctx.cache, ctx.x_dtype = ops, cache, x_MK.dtype
        return y

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        w_NK, *saved_x = ctx.saved_tensors
        ops = ctx.ops
        dy = dy_MN.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        if need_dx and ops.dgrad_hp:  # the high-precision dy and w (fp32 products under emulation)
            dx = ((dy.float() @ w_NK.float()) if ops.emulate else dy @ w_NK.to(dy.dtype)).to(ctx.x_dtype)
            need_dx = False
        if ops.recipe == "tensorwise":  # one cast of dy (one scale) for both GEMMs, in the layout each wants
            dy = ops.dy_tensorwise(dy, rows=need_dx, cols=need_dw)
        if need_dx:
            dx = ops.dgrad(dy, _weight(ctx.cache, "dgrad", w_NK, ops.w_dgrad), ctx.x_dtype)
        if need_dw:
            x_saved = saved_x[0] if ops.recipe == "rowwise" else (saved_x[0], saved_x[1] if len(saved_x) > 1 else None)
            dw = ops.wgrad(dy, x_saved, w_NK.dtype)
        return dx, dw, None, None, None


def _weight(cache: Any, layout: str, w: Tensor, make) -> Operand:
    return make(w) if cache is None else cache.get("w", layout, w, make)


def _fp8_linear_2d(x_MK: Tensor, w_NK: Tensor, x_op: Operand, ops: _Ops, cache: Any) -> Tensor:
    M = x_MK.shape[0]
    if ops.emulate or M % ALIGN == 0:
        return _Fp8Linear.apply(x_MK, w_NK, x_op, ops, cache)
    M_pad = -(-M // ALIGN) * ALIGN  # the FP8 GEMM's alignment (the wgrad contracts over M); zero rows
    q = _pad_rows(x_op[0].view(torch.uint8), M_pad).view(x_op[0].dtype)
    x_op = (q, _pad_rows(x_op[1], M_pad) if ops.recipe == "rowwise" else x_op[1])
    return _Fp8Linear.apply(_pad_rows(x_MK, M_pad), w_NK, x_op, ops, cache)[:M]


@torch.compiler.disable  # eager kernels and Python caches: the callback uses this module outside compiled regions
def fp8_linear(x: Tensor, w_NK: Tensor, *, recipe: str, emulate: bool, weight_cache: Any = None,
               input_cache: Optional[Fp8InputCache] = None, wgrad_hp: bool = False, fast_accum: bool = True,
               dgrad_hp: bool = False, sr_weights: bool = False) -> Tensor:
    """``x @ w.T`` ([..., K] -> [..., N], x's dtype) in the FP8 ``recipe`` (``rowwise`` / ``tensorwise``; the module
    docstring), gradients for x and w. ``weight_cache``: an :class:`~lightning_moe.lowp.fp8_fused.Fp8WeightCache`
    (the weight's FP8 copies made once per optimizer step). ``input_cache``: an :class:`Fp8InputCache` shared with
    the other linears (and the norm) reading the same x, so x is quantized once. ``wgrad_hp`` (``rowwise`` only):
    the weight gradient as a high-precision GEMM. ``fast_accum``: the forward GEMM accumulates with Hopper's fast FP8
    accumulation (torchao's default); False promotes its partial sums to fp32, as the backward GEMMs always do.
    ``dgrad_hp``: the input gradient ``dx = dy @ w`` as a high-precision GEMM of the bf16 dy and w (with ``wgrad_hp``
    the backward has no FP8 GEMM: FP8 in the forward only). ``sr_weights`` (``rowwise``): the weight's FP8 operands
    (forward and input gradient, one draw each per optimizer step with a weight cache) stochastically rounded
    (:func:`~lightning_moe.lowp.fp8_stochastic.stochastic_round_e4m3`) instead of rounded to nearest."""
    if recipe not in LINEAR_RECIPES:
        raise ValueError(f"fp8_linear(recipe={recipe!r}): one of {LINEAR_RECIPES}")
    if wgrad_hp and recipe != "rowwise":
        raise ValueError(f"fp8_linear(recipe={recipe!r}, wgrad_hp=True): a high-precision weight gradient goes with "
                         "recipe='rowwise' only (tensorwise saves the FP8 input, not the bf16 one, for its backward)")
    N, K = w_NK.shape
    if K % ALIGN or N % ALIGN:
        raise ValueError(f"fp8_linear: in / out features {K} / {N} must be multiples of {ALIGN} (FP8 GEMM alignment); "
                         "keep this linear in high precision (keep_bf16)")
    w = w_NK.to(x.dtype) if w_NK.dtype != x.dtype else w_NK
    if sr_weights and recipe != "rowwise":
        raise ValueError(f"fp8_linear(recipe={recipe!r}, sr_weights=True): stochastic weight rounding goes with "
                         "recipe='rowwise' only")
    ops = _Ops(recipe, emulate, wgrad_hp, fast_accum, dgrad_hp, sr_weights)
    x_MK = x.reshape(-1, K)
    x_op = input_cache.read(x, recipe) if input_cache is not None else None
    if x_op is None:
        x_op = ops.x_fwd(x_MK)
        if input_cache is not None:
            input_cache.put(x, recipe, x_op)
            input_cache.stored_by_reader()
    return _fp8_linear_2d(x_MK, w, x_op, ops, weight_cache).reshape(*x.shape[:-1], N)


# ---- RMSNorm that quantizes its output (the attention projections' FP8 input) -----------------------------------


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """The model's RMSNorm (:class:`~lightning_moe.models.transformer.RMSNorm`): fp32 math, x's dtype out."""
    F = torch.nn.functional
    if x.dtype == w.dtype:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


class _RMSNormQuant(torch.autograd.Function):
    """y = rms_norm(x, w, eps) whose forward kernel also writes y's rowwise FP8 form (non-differentiable outputs);
    the backward recomputes the norm through ``F.rms_norm``'s own autograd (one memory-bound pass over x)."""

    @staticmethod
    def forward(ctx, x_RD: Tensor, w_D: Tensor, eps: float, emulate: bool):
        q_dtype = torch.float32 if emulate else E4M3
        if kernels.use_triton(x_RD):
            y, q, s = kernels.rms_norm_quant_rowwise(x_RD, w_D, eps, q_dtype)
        else:  # the PyTorch reference: the same values
            y = _rms_norm(x_RD, w_D, eps)
            q, s = quantize_rowwise(y, q_dtype)
        ctx.save_for_backward(x_RD, w_D)
        ctx.eps = eps
        ctx.mark_non_differentiable(q, s)
        return y, q, s

    @staticmethod
    def backward(ctx, dy: Tensor, dq: Any, ds: Any):
        x, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.enable_grad():
            xl, wl = x.detach().requires_grad_(need_x), w.detach().requires_grad_(need_w)
            y = _rms_norm(xl, wl, ctx.eps)
            leaves = [t for t in (xl, wl) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, leaves, dy) if leaves else ())
        return next(grads) if need_x else None, next(grads) if need_w else None, None, None


@torch.compiler.disable
def fp8_rms_norm(x: Tensor, weight: Tensor, eps: float, *, emulate: bool, input_cache: Fp8InputCache) -> Tensor:
    """``F.rms_norm(x, weight, eps)`` (x's dtype) that stores y's rowwise FP8 form (torchao's rowwise numerics: the
    values a rowwise :func:`fp8_linear` would make of y) in ``input_cache``, made by the norm's own kernel (Triton,
    one row per program) so the projections after it quantize nothing. Emulation keeps the dequantized fp32 values."""
    D = x.shape[-1]
    y, q, s = _RMSNormQuant.apply(x.reshape(-1, D), weight, eps, emulate)
    y = y.reshape(x.shape)
    op: Operand = (q * s[:, None], None) if emulate else (q, s[:, None])
    input_cache.put(y, "rowwise", op)
    return y


# ---- the modules the callback swaps in (class swap in place: same parameters and state-dict keys) --------------


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run :func:`fp8_linear` (set by ``LowPrecisionTraining``: ``lowp_recipe``,
    ``lowp_emulate``, ``lowp_weight_cache``, ``lowp_input_cache``, ``lowp_wgrad_hp``, ``lowp_fast_accum``,
    ``lowp_dgrad_hp``, ``lowp_sr_weights``)."""

    lowp_recipe: str = "rowwise"
    lowp_emulate: bool = False
    lowp_wgrad_hp: bool = False
    lowp_fast_accum: bool = True
    lowp_dgrad_hp: bool = False
    lowp_sr_weights: bool = False
    lowp_weight_cache: Any = None
    lowp_input_cache: Optional[Fp8InputCache] = None

    def forward(self, x: Tensor) -> Tensor:
        if high_precision_active():  # the class this one was swapped over: its own high-precision forward
            return super().forward(x)
        y = fp8_linear(x, self.weight, recipe=self.lowp_recipe, emulate=self.lowp_emulate,
                       weight_cache=self.lowp_weight_cache, input_cache=self.lowp_input_cache,
                       wgrad_hp=self.lowp_wgrad_hp, fast_accum=self.lowp_fast_accum, dgrad_hp=self.lowp_dgrad_hp,
                       sr_weights=self.lowp_sr_weights)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        flags = (", wgrad_hp" if self.lowp_wgrad_hp else "") + (", dgrad_hp" if self.lowp_dgrad_hp else "") + (
            ", sr_weights" if self.lowp_sr_weights else "") + (
            "" if self.lowp_fast_accum else ", fast_accum=False")
        return f"{super().extra_repr()}, fp8={self.lowp_recipe}{flags}"


class Fp8QuantRMSNorm(nn.Module):
    """Mixin over the model's RMSNorm: its output's rowwise FP8 form is made by the norm kernel and left in
    ``lowp_input_cache`` for the rowwise :class:`Fp8Linear` projections that read it."""

    lowp_emulate: bool = False
    lowp_input_cache: Optional[Fp8InputCache] = None

    def _forward(self, x: Tensor) -> Tensor:
        if high_precision_active():  # no linear reads an FP8 form then
            return super()._forward(x)
        if isinstance(x, DTensor) or isinstance(self.weight, DTensor):
            # tensor / sequence parallel: the projections read an input redistributed from y (another tensor), so
            # y's FP8 form would never be read; and torch 2.11 refuses to flatten a sequence-sharded x
            return super()._forward(x)
        return fp8_rms_norm(x, self.weight, self.eps, emulate=self.lowp_emulate, input_cache=self.lowp_input_cache)


_CLASSES: dict[tuple[type, type], type] = {}


def fp8_class(mixin: type, cls: type) -> type:
    """``mixin``'s forward on top of ``cls`` (a subclass keeps its own init and attributes)."""
    if issubclass(cls, mixin):
        return cls
    if mixin is Fp8Linear and cls is nn.Linear:
        return Fp8Linear
    if (mixin, cls) not in _CLASSES:
        prefix = "Fp8Quant" if mixin is Fp8QuantRMSNorm else "Fp8"
        _CLASSES[(mixin, cls)] = type(f"{prefix}{cls.__name__.lstrip('_')}", (mixin, cls), {})
    return _CLASSES[(mixin, cls)]


def saved_input_bytes(fn, *args) -> int:
    """Bytes of the tensors autograd saves while running ``fn(*args)`` (tests, benches: the FP8 saved input)."""
    total = [0]

    def pack(t: Tensor) -> Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total[0]
