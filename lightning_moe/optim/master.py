"""AdamW on fp32 master state for low-precision parameters (bf16 compute, fp32 optimizer: Megatron's scheme).

Under ``precision="bf16-true"`` the model holds bf16 parameters and computes with them (no cast in forward or
backward, bf16 gradients). An AdamW step on bf16 weights rounds away every update smaller than about 1/256 of a
weight, which late in a cosine schedule is most of them. :class:`MasterAdamW` keeps, for every parameter in a
lower-precision dtype, an fp32 master copy (state ``"master"``) and fp32 moments; it updates the master and writes the
parameter back rounded to nearest even. An fp32 parameter (the router) is its own master: its state is torch's AdamW
state. Every state tensor is made like its parameter -- a DTensor on the parameter's mesh with its placements under
FSDP2 / EP / TP, a plain tensor on one device -- so the master state is sharded exactly where the parameter is, and
torch.distributed.checkpoint saves it by parameter name and global shape and reshards it to any layout.

The step works on local tensors, one update per (parameter group, dtype group): either the Triton kernel
(:mod:`lightning_moe.optim._triton_adamw`; two launches per group -- full blocks, then partial ones -- 28 bytes
moved per bf16 element) or the reference,
torch's foreach ops in the order of ``torch.optim.AdamW`` (equal to it bit for bit). ``fused=None`` picks the kernel
when the parameters are on CUDA and triton imports; ``fused=True`` requires it (CPU tensors only under Triton's
interpreter); ``fused=False`` is the reference.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["MasterAdamW", "kernel_available"]

_MASTER = torch.float32
_STATE = ("master", "exp_avg", "exp_avg_sq")  # the fp32 state of a low-precision parameter
_REFERENCE_CHUNK = 2**26  # elements per reference update (bounds its fp32 temporaries)


@functools.lru_cache(maxsize=None)
def _import_kernel() -> tuple[Optional[ModuleType], Optional[str]]:
    try:
        from lightning_moe.optim import _triton_adamw
    except ImportError as e:  # triton missing (or broken)
        return None, f"{type(e).__name__}: {e}"
    return _triton_adamw, None


def kernel_available() -> bool:
    """Whether triton imports (the fused step's kernel can be compiled)."""
    return _import_kernel()[0] is not None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _is_low_precision(p: Tensor) -> bool:
    return p.is_floating_point() and p.element_size() < _MASTER.itemsize


class _Keep:
    """A state tensor carried through ``Optimizer.load_state_dict``, which would cast it to its parameter's dtype
    (rounding an fp32 master to bf16); unwrapped by the load post-hook."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class MasterAdamW(Optimizer):
    """AdamW (decoupled weight decay, torch's formula) whose weights and moments are fp32: a master copy for every
    bf16 / fp16 parameter, rewritten into the parameter after each step.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        fused: the Triton kernel (True), torch's foreach ops (False), or None: the kernel when every parameter is on
            CUDA and triton imports, else torch's ops.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, fused: Optional[bool] = None) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        params_all = [p for g in self.param_groups for p in g["params"]]
        if any(p.is_sparse for p in params_all):
            raise ValueError("MasterAdamW does not support sparse parameters")
        self.fused = self._resolve_fused(fused, params_all)
        self.register_load_state_dict_pre_hook(_keep_state_dtypes)
        self.register_load_state_dict_post_hook(_restore_state_dtypes)

    @staticmethod
    def _resolve_fused(fused: Optional[bool], params: list[Tensor]) -> bool:
        """Decided once, here: the kernel or torch's ops (DESIGN invariant 13)."""
        on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
        if fused is None:
            return on_cuda and kernel_available()
        if not fused:
            return False
        mod, err = _import_kernel()
        if mod is None:
            raise RuntimeError(f"MasterAdamW(fused=True) needs triton ({err}); install triton or pass fused=False")
        if not on_cuda and not mod.INTERPRET:
            raise RuntimeError("MasterAdamW(fused=True): the Triton kernel takes CUDA tensors (CPU tensors only under "
                               "Triton's interpreter, TRITON_INTERPRET=1 set before triton is imported); pass "
                               "fused=False on this device")
        return True

    # ---- state ---------------------------------------------------------------------------------------------------
    def _init_state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)  # on the host: bias corrections need no sync
        weight = p.detach()
        if _is_low_precision(p):
            weight = weight.to(_MASTER)  # a DTensor stays a DTensor: the master lives where the parameter's shard is
            state["master"] = weight
        state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        return state

    def master_params(self) -> dict[Tensor, Tensor]:
        """``parameter -> fp32 master`` for every parameter with a master copy (low-precision ones that stepped)."""
        return {p: s["master"] for p, s in self.state.items() if "master" in s}

    # ---- step ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            stepping = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in stepping):
                raise RuntimeError("MasterAdamW does not support sparse gradients")
            states = [self.state[p] if self.state.get(p) else self._init_state(p) for p in stepping]
            if states:
                torch._foreach_add_([s["step"] for s in states], 1.0)  # one call for the group's host counters
            buckets: dict[tuple, list[tuple[Tensor, ...]]] = {}
            for p, state in zip(stepping, states):
                grad = p.grad
                if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                master = state.get("master")
                entry = (_local(grad), _local(master if master is not None else p), _local(state["exp_avg"]),
                         _local(state["exp_avg_sq"]), _local(p) if master is not None else None)
                key = (entry[0].device, entry[0].dtype, p.dtype, master is not None, float(state["step"]))
                buckets.setdefault(key, []).append(entry)
            for (_, _, _, _, step), entries in buckets.items():
                self._update(entries, group, step)
        return loss

    def _update(self, entries: list[tuple[Tensor, ...]], group: dict[str, Any], step: float) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if isinstance(lr, Tensor):
            lr = float(lr)
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, step=step)
        kernel = [e for e in entries if self.fused and all(t is None or t.is_contiguous() for t in e)
                  and e[1].dtype == _MASTER]
        if kernel:
            _fused_update(kernel, **hyper)
        if len(kernel) < len(entries):
            done = {id(e) for e in kernel}
            _reference_update([e for e in entries if id(e) not in done], **hyper)


# ---- the two update paths (local tensors; entries are (grad, weight, exp_avg, exp_avg_sq, param or None)) -------------
def _reference_update(entries: list[tuple[Tensor, ...]], *, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, step: float) -> None:
    """torch.optim.AdamW's foreach arithmetic on the weights (masters or fp32 parameters), then the parameters
    rewritten from their masters. In chunks, so the fp32 temporaries stay bounded."""
    bias1 = 1 - beta1**step
    bias2_sqrt = (1 - beta2**step) ** 0.5
    chunk: list[tuple[Tensor, ...]] = []
    size = 0
    for i, e in enumerate(entries):
        chunk.append(e)
        size += e[1].numel()
        if size < _REFERENCE_CHUNK and i + 1 < len(entries):
            continue
        grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w, *_ in chunk]
        weights, exp_avgs, exp_avg_sqs = ([e[j] for e in chunk] for j in (1, 2, 3))
        if weight_decay != 0:
            torch._foreach_mul_(weights, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        del grads
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(weights, exp_avgs, denom, -lr / bias1)
        del denom
        rewrite = [(e[4], e[1]) for e in chunk if e[4] is not None]
        if rewrite:
            torch._foreach_copy_([p for p, _ in rewrite], [w for _, w in rewrite])  # rounds to nearest even
        chunk, size = [], 0


_TABLES: dict[tuple, tuple[Tensor, tuple[Tensor, Tensor], tuple[Tensor, Tensor]]] = {}


def _block_tables(numels: tuple[int, ...], device: torch.device, block: int
                  ) -> tuple[Tensor, tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The static part of a launch, kept per (device, tensor sizes): each tensor's numel, and for the full blocks
    and for the partial last blocks the tensor each block belongs to and its first element."""
    key = (device, numels, block)
    if key not in _TABLES:
        n = torch.tensor(numels, dtype=torch.int64)
        full, tail = n // block, (n % block > 0).long()
        tables = []
        for counts, first in ((full, torch.zeros_like(n)), (tail, full)):
            tensor_of_block = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
            before = torch.cumsum(counts, 0) - counts  # blocks of the tensors before each one
            index = torch.arange(int(counts.sum()), dtype=torch.int64) - before[tensor_of_block.long()]
            start = (first[tensor_of_block.long()] + index) * block
            tables.append((tensor_of_block.to(device), start.to(device)))
        _TABLES[key] = (n.to(device), tables[0], tables[1])
    return _TABLES[key]


def _fused_update(entries: list[tuple[Tensor, ...]], *, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, step: float) -> None:
    """One kernel launch over ``entries`` (one dtype group: equal grad and parameter dtypes, fp32 weights)."""
    mod = _import_kernel()[0]
    assert mod is not None
    import triton.language as tl

    entries = [e for e in entries if e[1].numel() > 0]
    if not entries:
        return
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
    g0, p0 = entries[0][0], entries[0][4]
    device = g0.device
    sizes = tuple(e[1].numel() for e in entries)
    rows = [[t.data_ptr() if t is not None else 0 for t in e] for e in entries]
    ptrs = _pointer_table(rows, sizes, device)
    numels, full, tail = _block_tables(sizes, device, mod.BLOCK)
    bias1 = 1 - beta1**step
    scalars = [float(x) for x in (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / bias1,
                                  (1 - beta2**step) ** 0.5, eps)]  # fp32 arguments, whatever Python types came in
    aligned = all(ptr % 16 == 0 for row in rows for ptr in row)
    for (tensor_of_block, start), masked in ((full, False), (tail, True)):
        if tensor_of_block.numel():
            mod.adamw_kernel[(tensor_of_block.numel(),)](
                ptrs, numels, tensor_of_block, start, *scalars, G_DTYPE=tl_dtype[g0.dtype],
                P_DTYPE=tl_dtype[(p0 if p0 is not None else g0).dtype], HAS_MASTER=p0 is not None,
                LERP_LOW=(1 - beta1) < 0.5, MASKED=masked, ALIGNED=aligned, BLOCK=mod.BLOCK, num_warps=mod.NUM_WARPS,
            )


_POINTERS: dict[tuple, tuple[list[list[int]], Tensor]] = {}  # (device, numels) -> the last pointer rows, on device


def _pointer_table(rows: list[list[int]], sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """The [N, 5] int64 pointer table on ``device``: the last one again when no tensor moved (the caching allocator
    usually hands the step's gradients the same blocks), else a copy from pinned memory that does not wait for the
    stream (a pageable one would)."""
    key = (device, sizes)
    last = _POINTERS.get(key)
    if last is not None and last[0] == rows:
        return last[1]
    host = torch.tensor(rows, dtype=torch.int64)
    table = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    _POINTERS[key] = (rows, table)
    return table


# ---- load_state_dict: keep the fp32 state fp32 --------------------------------------------------------------------
def _keep_state_dtypes(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Wrap the floating state tensors so ``Optimizer.load_state_dict`` does not cast them to the parameters'
    dtypes (a copy of the dict: the caller's stays as it was)."""
    state = {k: {n: _Keep(v) if isinstance(v, Tensor) and v.is_floating_point() and n != "step" else v
                 for n, v in s.items()} if isinstance(s, dict) else s
             for k, s in state_dict.get("state", {}).items()}
    return {**state_dict, "state": state}


def _restore_state_dtypes(optimizer: Optimizer) -> None:
    """After a load: the state in the dtypes this optimizer keeps, on the parameters' devices; a low-precision
    parameter without a master (a checkpoint of bf16 AdamW) gets one made from its current value; the step
    count back on the host."""
    for p, state in optimizer.state.items():
        for name, v in list(state.items()):
            if isinstance(v, _Keep):
                dtype = _MASTER if _is_low_precision(p) else p.dtype
                state[name] = v.tensor.to(device=p.device, dtype=dtype)
        if "step" in state:
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().clone()
        if _is_low_precision(p) and "exp_avg" in state and "master" not in state:
            state["master"] = p.detach().to(_MASTER)

