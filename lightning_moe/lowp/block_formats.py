"""Block-scaled low-precision formats in emulation: OCP MXFP8, NVIDIA NVFP4, the random Hadamard transform, and
autograd functions for emulated block-scaled GEMMs (the MXFP8 / NVFP4 training recipes' semantics in one place).

Everything here is plain PyTorch (CPU and CUDA, no kernels, no external libraries): a quantizer *fake-quantizes*
(quantize, then dequantize, returning the input's dtype) so that the values a real sm100 block-scaled GEMM would
multiply are reproduced bit for bit, and the GEMMs run in fp32 on those values. This is the reference path
(DESIGN.md invariant 7) for the ``mxfp8`` / ``nvfp4`` recipes of
:class:`~lightning_moe.callbacks.LowPrecisionTraining` (``emulate=True``). Clarity first, but fast enough for CPU
convergence runs (bench/low_precision.py): roundings are done in arithmetic on power-of-two spacings (bit for bit
the E4M3 cast and the E2M1 table rounding, which the tests check against the formats' definitions), blocks along a
leading dim are reduced in place rather than transposed, and full-size ``torch.where`` selects are avoided.

Legend: N tokens (rows), D input features, K output features of a linear (``y_NK = x_ND @ w_KD.T``);
for the grouped GEMM (the signature of ``torch._grouped_mm``) M rows, K contraction, N output, E groups.

Formats
  * **MXFP8** (OCP Microscaling Formats spec v1.0, E4M3 elements): blocks of 32 consecutive elements along the
    contraction dim share one E8M0 scale ``X = 2^(floor(log2(amax)) - 8)`` (8 = emax of E4M3), the exponent
    clamped to E8M0's [-127, 127]; elements ``x / X`` are cast to E4M3 with round-to-nearest-even, saturating at
    +-448 (``amax / X`` lies in [256, 512), so the block's largest values may saturate: that is the spec's scale
    rule, as in torchao's default "floor" mode).
  * **NVFP4** (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025; Transformer Engine's NVFP4 recipe):
    blocks of 16 elements, a per-tensor FP32 scale ``s_global = global_amax / (448 * 6)``, a per-block scale
    ``block_amax / 6 / s_global`` stored in E4M3 (RNE), decoded scale ``e4m3(block scale) * s_global``, and
    elements ``x / decoded_scale`` rounded to E2M1 {0, 0.5, 1, 1.5, 2, 3, 4, 6} (RNE, or stochastic rounding),
    saturating at 6. Weights use 16x16 two-dimensional tiles (:func:`quantize_nvfp4_2d`), so the forward and the
    data-gradient GEMM multiply the very same quantized weight (the paper's fix for the chain rule seeing two
    different weights).

Recipes (``block_scaled_linear`` / ``block_scaled_grouped_mm``)
  ============  =============================  =============================  ===================================
  GEMM          mxfp8                          nvfp4 operand 1                nvfp4 operand 2
  ============  =============================  =============================  ===================================
  fprop  x w^T  x, w along D (RNE)             x along D (RNE)                w: 16x16 tiles (RNE)
  dgrad dy w    dy along K, w along K (RNE)    dy along K (stochastic)        w: the same 16x16 tiles (RNE)
  wgrad dy^T x  dy, x along N (RNE)            RHT(dy) along N (stochastic)   RHT(x) along N (RNE)
  ============  =============================  =============================  ===================================
  Each nvfp4 operand has its own per-tensor scale (amax of the tensor as quantized: after the RHT for the wgrad
  operands). Which layers stay in bf16 is the callback's business, not this module's.

Limits of the emulation (documented, not hidden): inputs are quantized from their fp32 value (a float64 input is
rounded to fp32 first); a block containing inf / NaN gives NaN (never a silently finite value); the quantizers
are not meant to be differentiated through (the autograd functions define the recipe's backward); gradients use
the device's default generator unless ``generator`` is given (a generator on the tensors' device; one uniform draw
per element of the zero-padded tensor, in its memory order, blocks laid along ``dim``); operands are
plain tensors (handing local shards or gathered weights to these functions is the caller's business).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "RECIPES",
    "MX_BLOCK",
    "NVFP4_BLOCK",
    "E4M3_MAX",
    "E2M1_MAX",
    "E2M1_GRID",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_nvfp4_2d",
    "random_hadamard_transform",
    "block_scaled_linear",
    "block_scaled_grouped_mm",
]

RECIPES = ("mxfp8", "nvfp4")
MX_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E4M3_EMAX = 8  # exponent of E4M3's largest normal (448 = 1.75 * 2^8)
E8M0_EXP_MIN, E8M0_EXP_MAX = -127, 127  # E8M0 encodes 2^-127 .. 2^127 (0xFF is NaN)
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # non-negative E2M1 values; code = index (ties go to even codes)

Float = Union[float, Tensor]


# ---- blocking ------------------------------------------------------------------------------------------------
def _to_blocks(x: Tensor, dim: int, block: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``x`` viewed as ``[A, n_blocks, block, C]``: blocks of ``block`` consecutive elements along ``dim`` (zero
    padded to a multiple of ``block``), A / C the flattened dims before / after ``dim``; and the function mapping a
    tensor of that shape back to ``x``'s shape (padding dropped). The block axis is dim 2. No copy when ``x`` is
    contiguous and ``x.shape[dim]`` a multiple of ``block``: blocking along a leading dim (the wgrad's token dim)
    reduces over a middle axis, which is far faster on CPU than transposing first."""
    shape = x.shape
    dim = dim % x.dim()
    n = shape[dim]
    a, c = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    n_blocks = -(-n // block)
    x3 = x.reshape(a, n, c)
    if n_blocks * block != n:
        x3 = F.pad(x3, (0, 0, 0, n_blocks * block - n))

    def back(yb: Tensor) -> Tensor:
        return yb.reshape(a, n_blocks * block, c)[:, :n].reshape(shape)

    return x3.reshape(a, n_blocks, block, c), back


def _block_amax(xb: Tensor) -> Tensor:
    """amax of |x| over the block axis (dim 2) of ``_to_blocks``' layout, keepdim."""
    if xb.shape[-1] == 1:  # blocks along the last dim: a reduction over a small contiguous run, slow on CPU as is
        a = xb.abs().flatten(-2)
        while a.shape[-1] > 1 and a.shape[-1] % 2 == 0:  # pairwise maxima on halves (exact; the block is 2^k)
            h = a.shape[-1] // 2
            a = torch.maximum(a[..., :h], a[..., h:])
        return a.amax(-1, keepdim=True).unsqueeze(-1)
    return xb.abs().amax(2, keepdim=True)


def _to_tiles(x: Tensor, tile: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``[..., R, C]`` -> ``[..., R/t, C/t, t*t]`` (zero padded) and the inverse (padding dropped)."""
    r, c = x.shape[-2:]
    rb, cb = -(-r // tile), -(-c // tile)
    x = F.pad(x, (0, cb * tile - c, 0, rb * tile - r))
    lead = x.shape[:-2]
    xt = x.reshape(*lead, rb, tile, cb, tile).transpose(-3, -2).reshape(*lead, rb, cb, tile * tile)

    def back(yt: Tensor) -> Tensor:
        y = yt.reshape(*lead, rb, cb, tile, tile).transpose(-3, -2).reshape(*lead, rb * tile, cb * tile)
        return y[..., :r, :c]

    return xt, back


def _pow2(e: Tensor) -> Tensor:
    """``2.0 ** e`` exactly in fp32 for integer ``e`` in [-127, 127] (built from the bits: no libm rounding)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    return torch.where(e >= -126, normal, torch.full_like(normal, 2.0**-127))


def _exp2_floor(a: Tensor) -> Tensor:
    """``2^floor(log2(a))`` for normal positive fp32 ``a`` (its exponent bits; 0 for 0 and fp32 subnormals)."""
    return (a.view(torch.int32) & 0x7F800000).view(torch.float32)


def _round_e4m3(y: Tensor) -> Tensor:
    """``y`` (fp32, |y| <= 448) rounded to float8 E4M3 (RNE, subnormals included), as fp32: bit for bit
    ``y.to(torch.float8_e4m3fn).float()``, in arithmetic (the cast round trip is several times slower on CPU). The
    E4M3 spacing at ``y`` is ``2^(floor(log2|y|) - 3)`` (3 mantissa bits), at least ``2^-9`` (the subnormal step); a
    division by it is exact and ``torch.round`` rounds half to even (= the even code)."""
    spacing = (_exp2_floor(y.abs()) * 0.125).clamp_(min=2.0**-9)
    return torch.round(y / spacing).mul_(spacing)


def _nan_where_nonfinite(q: Tensor, amax: Tensor) -> Tensor:
    """``q``, NaN in the blocks whose amax is not finite (a multiply by 1 / NaN per block: keeps signed zeros)."""
    return q * torch.where(torch.isfinite(amax), 1.0, float("nan"))


# ---- MXFP8 -------------------------------------------------------------------------------------------------------
def quantize_mxfp8(x: Tensor, dim: int = -1) -> Tensor:
    """OCP MXFP8 (E4M3) fake-quantization of ``x`` along ``dim``; returns a tensor of ``x``'s shape and dtype.

    Blocks of 32 consecutive elements along ``dim`` (zero padded internally when ``x.shape[dim]`` is not a multiple
    of 32) share the E8M0 scale ``X = 2^clamp(floor(log2(amax)) - 8, -127, 127)``; each element is
    ``float8_e4m3fn(clamp(x / X, -448, 448)) * X`` (round-to-nearest-even). An all-zero block gives zeros; a block
    holding inf or NaN gives NaN."""
    xb, back = _to_blocks(x.float(), dim, MX_BLOCK)
    amax = _block_amax(xb)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2(amax)) = exp - 1, exact
    scale = _pow2((exp - 1 - E4M3_EMAX).clamp(E8M0_EXP_MIN, E8M0_EXP_MAX))  # zero block: any scale gives 0
    elems = _round_e4m3((xb * (1.0 / scale)).clamp_(-E4M3_MAX, E4M3_MAX))  # * 2^-k is exact; RNE
    q = _nan_where_nonfinite(elems.mul_(scale), amax)
    return back(q).to(x.dtype)


# ---- NVFP4 -------------------------------------------------------------------------------------------------------
def _round_e2m1(v: Tensor, stochastic: bool, generator: Optional[torch.Generator]) -> Tensor:
    """Round fp32 ``v`` to the signed E2M1 grid, saturating at +-6: nearest with ties to the even code, or
    stochastically between the two neighbouring grid points (P(up) = distance from the lower one / gap).

    Arithmetic instead of a table: the grid's spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so with
    ``k = |v| / spacing`` (exact: a power of two) the neighbours are ``floor(k)`` and ``floor(k) + 1`` spacings, the
    code of ``k * spacing`` has the parity of ``k`` (ties to even = ``torch.round``), and P(up) = ``k - floor(k)``
    (exact). NaN stays NaN."""
    a = v.abs().clamp_(max=E2M1_MAX)
    spacing = (_exp2_floor(a) * 0.5).clamp_(min=0.5)  # 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
    k = a / spacing
    if stochastic:
        u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
        lo = torch.floor(k)
        k = lo.add_((u < k - lo).to(torch.float32))
    else:
        k = torch.round(k)
    return torch.copysign(k.mul_(spacing), v)


def _global_scale(xf: Tensor, global_amax: Optional[Float]) -> Tensor:
    g = xf.abs().amax() if global_amax is None else torch.as_tensor(global_amax, dtype=torch.float32,
                                                                     device=xf.device)
    # a zero tensor (global amax 0) has only zero blocks: any positive scale gives zeros, never 0/0
    return torch.where(g > 0, g / (E4M3_MAX * E2M1_MAX), torch.ones_like(g))


def _nvfp4_blocks(xb: Tensor, block_amax: Tensor, s_global: Tensor, stochastic: bool,
                  generator: Optional[torch.Generator]) -> Tensor:
    """NVFP4 on fp32 blocks ``xb`` whose amaxes ``block_amax`` (keepdim, broadcasting against ``xb``) are given."""
    # E4M3 block scale (RNE); clamp: a user-given global_amax below the true amax saturates the scale at 448
    s_block = (block_amax / E2M1_MAX / s_global).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    decoded = s_block * s_global
    # a block scale that underflows E4M3 (block tiny against the tensor) decodes to 0: the block becomes 0
    ok = decoded > 0
    v = (xb / torch.where(ok, decoded, 1.0)).mul_(ok)  # per-block where, broadcast: no full-size select
    q = _round_e2m1(v, stochastic, generator).mul_(decoded)
    return _nan_where_nonfinite(q, block_amax)


def quantize_nvfp4(x: Tensor, dim: int = -1, *, global_amax: Optional[Float] = None, stochastic: bool = False,
                   generator: Optional[torch.Generator] = None) -> Tensor:
    """NVIDIA NVFP4 fake-quantization of ``x`` along ``dim``; returns a tensor of ``x``'s shape and dtype.

    ``s_global = global_amax / (448 * 6)`` (fp32; ``global_amax`` defaults to ``x.abs().amax()``); blocks of 16
    consecutive elements along ``dim`` (zero padded internally) get the scale ``block_amax / 6 / s_global`` rounded
    to E4M3 (RNE), decoded ``e4m3(block scale) * s_global``; elements ``x / decoded`` are rounded to the E2M1 grid
    {0, 0.5, 1, 1.5, 2, 3, 4, 6} (signed; RNE, or unbiased stochastic rounding with ``stochastic=True``, drawing
    from ``generator`` or the device's default one), saturating at 6, and multiplied back by ``decoded``.
    Zero blocks / zero tensors give zeros; a block holding inf or NaN gives NaN."""
    if x.numel() == 0:
        return x.clone()
    xf = x.float()
    xb, back = _to_blocks(xf, dim, NVFP4_BLOCK)
    q = _nvfp4_blocks(xb, _block_amax(xb), _global_scale(xf, global_amax), stochastic, generator)
    return back(q).to(x.dtype)


def quantize_nvfp4_2d(w: Tensor, *, global_amax: Optional[Float] = None) -> Tensor:
    """NVFP4 fake-quantization with 16x16 two-dimensional blocks over the last two dims (the recipe's weight
    format): one E4M3 scale per tile, per-tensor scale and RNE as in :func:`quantize_nvfp4`. The result is the same
    whichever of the two dims a GEMM contracts, so the forward and the dgrad GEMM see one quantized weight.
    ``quantize_nvfp4_2d(w).transpose(-2, -1) == quantize_nvfp4_2d(w.transpose(-2, -1))``."""
    if w.dim() < 2:
        raise ValueError(f"quantize_nvfp4_2d needs at least 2 dims, got shape {tuple(w.shape)}")
    if w.numel() == 0:
        return w.clone()
    wf = w.float()
    wt, back = _to_tiles(wf, NVFP4_BLOCK)
    q = _nvfp4_blocks(wt, wt.abs().amax(-1, keepdim=True), _global_scale(wf, global_amax), False, None)
    return back(q).to(w.dtype)


# ---- random Hadamard transform -------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _rht_matrix_cpu(block: int, seed: int) -> Tensor:
    """``H_block @ diag(signs) / sqrt(block)``: Sylvester Hadamard matrix times seeded random +-1 signs."""
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (block,), generator=gen).float() * 2 - 1
    return h * signs / math.sqrt(block)


def random_hadamard_transform(x: Tensor, dim: int, *, block: int = 16, seed: int = 0) -> Tensor:
    """Random Hadamard transform of ``x`` along ``dim``, as NVIDIA's NVFP4 recipe applies it to the inputs of the
    weight-gradient GEMM: every block of ``block`` consecutive elements ``v`` along ``dim`` becomes ``M @ v`` with
    ``M = H_block @ diag(s) / sqrt(block)`` (Sylvester Hadamard matrix, ``s`` random signs fixed by ``seed``;
    ``block`` a power of two). ``M`` is orthogonal, so for two operands transformed with the same ``block`` and
    ``seed`` along their **contraction** dim, ``RHT(a)^T RHT(b) = a^T b`` in exact arithmetic: apply it along the
    contraction dim (the token dim of the wgrad GEMM ``dW = dy^T x``) of **both** operands, never to only one.
    It spreads outliers over the block before quantization, which is its purpose.

    ``x.shape[dim]`` is zero padded to a multiple of ``block`` and the output keeps the padded length (the padded
    positions are generally non-zero after the transform; contract over them). Computed in fp32, returned in
    ``x``'s dtype."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"random_hadamard_transform: block must be a power of two, got {block}")
    m = _rht_matrix_cpu(block, int(seed)).to(x.device)
    xb, _ = _to_blocks(x.float(), dim, block)  # [A, n_blocks, block, C]
    # each block v (along the block axis) -> M v
    y = xb.squeeze(-1) @ m.T if xb.shape[-1] == 1 else torch.matmul(m, xb)
    shape = list(x.shape)
    shape[dim] = xb.shape[1] * block
    return y.reshape(shape).to(x.dtype)


# ---- recipe GEMMs (fp32 operands in, fp32 out) -------------------------------------------------------------------------
def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"unknown block-scaled recipe {recipe!r}; expected one of {RECIPES}")


def _gemm_fprop(x_ND: Tensor, w_KD: Tensor, recipe: str) -> Tensor:
    """``y_NK = Q(x) @ Q(w)^T``, both quantized along D."""
    if recipe == "mxfp8":
        return quantize_mxfp8(x_ND, -1) @ quantize_mxfp8(w_KD, -1).T
    return quantize_nvfp4(x_ND, -1) @ quantize_nvfp4_2d(w_KD).T


def _gemm_dgrad(dy_NK: Tensor, w_KD: Tensor, recipe: str, generator: Optional[torch.Generator]) -> Tensor:
    """``dx_ND = Q(dy) @ Q(w)``, both quantized along K (nvfp4: dy stochastic, w the forward's 16x16 tiles)."""
    if recipe == "mxfp8":
        return quantize_mxfp8(dy_NK, -1) @ quantize_mxfp8(w_KD, 0)
    return quantize_nvfp4(dy_NK, -1, stochastic=True, generator=generator) @ quantize_nvfp4_2d(w_KD)


def _gemm_wgrad(dy_NK: Tensor, x_ND: Tensor, recipe: str, generator: Optional[torch.Generator],
                rht_seed: int) -> Tensor:
    """``dw_KD = Q(dy)^T @ Q(x)``, both quantized along the token dim N (nvfp4: both RHT'd along N, dy
    stochastic). An empty N gives zeros."""
    if recipe == "mxfp8":
        return quantize_mxfp8(dy_NK, 0).T @ quantize_mxfp8(x_ND, 0)
    dy_h = random_hadamard_transform(dy_NK, 0, block=NVFP4_BLOCK, seed=rht_seed)
    x_h = random_hadamard_transform(x_ND, 0, block=NVFP4_BLOCK, seed=rht_seed)
    return quantize_nvfp4(dy_h, 0, stochastic=True, generator=generator).T @ quantize_nvfp4(x_h, 0)


# ---- autograd functions ----------------------------------------------------------------------------------------------------
class _BlockScaledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, recipe: str, generator: Optional[torch.Generator],
                rht_seed: int) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.generator, ctx.rht_seed = recipe, generator, rht_seed
        with torch.autocast(x.device.type, enabled=False):
            y = _gemm_fprop(x.reshape(-1, x.shape[-1]).float(), w.float(), recipe)
        return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dx = dw = None
        with torch.autocast(x.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1]).float()
            if ctx.needs_input_grad[0]:
                dx = _gemm_dgrad(dy2, w.float(), ctx.recipe, ctx.generator).reshape(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                x2 = x.reshape(-1, x.shape[-1]).float()
                dw = _gemm_wgrad(dy2, x2, ctx.recipe, ctx.generator, ctx.rht_seed).to(w.dtype)
        return dx, dw, None, None, None


def block_scaled_linear(x_ND: Tensor, w_KD: Tensor, recipe: str, *, generator: Optional[torch.Generator] = None,
                        rht_seed: int = 0) -> Tensor:
    """``y = x @ w.T`` (no bias) through an emulated block-scaled GEMM of ``recipe`` (``"mxfp8"`` or ``"nvfp4"``),
    forward and backward as in the module's recipe table.

    ``x_ND``: [..., D] (leading dims are the token dim N of the wgrad); ``w_KD``: [K, D]. Every GEMM runs in fp32 on
    the dequantized operands (autocast disabled inside); ``y`` and ``dx`` come back in ``x``'s dtype, ``dw`` in
    ``w``'s. ``generator`` drives nvfp4's stochastic rounding of the gradients (per backward: dgrad draws, then
    wgrad draws); ``rht_seed`` fixes the RHT signs. A bias, if any, is added by the caller in high precision."""
    _check_recipe(recipe)
    if w_KD.dim() != 2 or x_ND.dim() < 1 or x_ND.shape[-1] != w_KD.shape[1]:
        raise ValueError(f"block_scaled_linear: x [..., D] and w [K, D] expected, got {tuple(x_ND.shape)} and "
                         f"{tuple(w_KD.shape)}")
    return _BlockScaledLinear.apply(x_ND, w_KD, recipe, generator, rht_seed)


def _group_bounds(offs_E: Tensor, num_groups: int, num_rows: int) -> list[tuple[int, int]]:
    if offs_E.dim() != 1 or offs_E.shape[0] != num_groups or offs_E.is_floating_point():
        raise ValueError(f"block_scaled_grouped_mm: offs must be a 1-D integer tensor of {num_groups} cumulative "
                         f"group ends, got dtype {offs_E.dtype} shape {tuple(offs_E.shape)}")
    ends: Sequence[int] = offs_E.tolist()  # one host sync: emulation
    starts = [0, *ends[:-1]]
    if any(e < s for s, e in zip(starts, ends)) or (ends and (ends[0] < 0 or ends[-1] > num_rows)):
        raise ValueError(f"block_scaled_grouped_mm: offs {list(ends)} must be non-decreasing within [0, {num_rows}]")
    return list(zip(starts, ends))


class _BlockScaledGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor, recipe: str, generator: Optional[torch.Generator],
                rht_seed: int) -> Tensor:
        bounds = _group_bounds(offs, w.shape[0], x.shape[0])
        ctx.save_for_backward(x, w)
        ctx.bounds, ctx.recipe, ctx.generator, ctx.rht_seed = bounds, recipe, generator, rht_seed
        y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float32, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            for g, (s, e) in enumerate(bounds):
                if e > s:  # group g as a linear: x_g [m, K], weight w[g]^T [N, K]
                    y[s:e] = _gemm_fprop(x[s:e].float(), w[g].float().T, recipe)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_dx else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_dw else None
        with torch.autocast(x.device.type, enabled=False):
            for g, (s, e) in enumerate(ctx.bounds):
                if e == s:
                    continue
                dy_g = dy[s:e].float()
                if need_dx:
                    dx[s:e] = _gemm_dgrad(dy_g, w[g].float().T, ctx.recipe, ctx.generator)
                if need_dw:
                    dw[g] = _gemm_wgrad(dy_g, x[s:e].float(), ctx.recipe, ctx.generator, ctx.rht_seed).T
        return (dx.to(x.dtype) if need_dx else None, dw.to(w.dtype) if need_dw else None, None, None, None, None)


def block_scaled_grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, recipe: str, *,
                            generator: Optional[torch.Generator] = None, rht_seed: int = 0) -> Tensor:
    """Emulated block-scaled ``torch._grouped_mm(x_MK, w_EKN, offs=offs_E)``: rows ``[offs[g-1], offs[g])`` of
    ``x`` times ``w_EKN[g]`` (``offs_E`` int32 cumulative group ends; empty groups allowed; ``w_EKN`` may be a
    transposed view). Rows past ``offs[-1]`` get zeros (and zero gradient).

    Group g is computed exactly as ``block_scaled_linear(x[rows of g], w_EKN[g].T, recipe)``: quantization blocks
    run along K in the forward / along N in the dgrad (nvfp4 weights: 16x16 tiles) and along the group's own rows in
    the wgrad, zero padded inside the group, so no block ever mixes rows of two groups; each nvfp4 operand has a
    per-group per-tensor scale (as Transformer Engine's grouped linear quantizes each GEMM's operands). Stochastic
    draws come group by group in order (dgrad, then wgrad). A loop over groups in fp32: emulation, not speed."""
    _check_recipe(recipe)
    if x_MK.dim() != 2 or w_EKN.dim() != 3 or x_MK.shape[1] != w_EKN.shape[1]:
        raise ValueError(f"block_scaled_grouped_mm: x [M, K] and w [E, K, N] expected, got {tuple(x_MK.shape)} and "
                         f"{tuple(w_EKN.shape)}")
    return _BlockScaledGroupedMM.apply(x_MK, w_EKN, offs_E, recipe, generator, rht_seed)
