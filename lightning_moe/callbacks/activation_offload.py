"""ActivationOffload: activations saved for the backward by chosen modules live in pinned host memory in between.

How (public torch APIs only):

* **scope**: ``transform_model`` (a model transform of the build pipeline, DESIGN invariant 11: it runs on the meta
  model before parallelisation) sets the offload policy of every chosen module's activation plan
  (:mod:`lightning_moe.activation_plan`); the module's forward then runs under
  ``torch.autograd.graph.saved_tensors_hooks``. A plan is an attribute: state-dict keys are unchanged, and the
  hooks of FSDP2 / tensor parallelism (on module calls) stay outside.
* **forward**: each saved tensor of at least ``min_bytes`` (plain tensors only: weights, their views and casts, and
  DTensors stay) is copied into a pinned host buffer on a side CUDA stream that first waits for the compute
  stream; ``record_stream`` keeps the allocator from reusing the device memory before the copy is done, and the
  device tensor is released as soon as the forward drops it. A tensor saved twice (e.g. the routed rows feeding
  both gate and up GEMMs) is copied once.
* **backward**: when the gradient reaches a wrapped module's output (its backward starts), its tensors and those of
  the module that ran before it in the forward (the next backward) are copied back on the side stream; unpacking
  waits on that copy's event (or copies synchronously if nothing was prefetched). Buffers are held only by
  autograd's saved-tensor slots, so each is freed once its node has run.
* Recomputation (activation checkpointing) regions nest inside and keep their own hooks: what they drop is
  recomputed, not offloaded; their inputs are saved through the offload hooks. Inside blocks that ``full``
  checkpointing recomputes, the offload hooks are innermost: what they offload is not recomputed (offload wins).
  Forwards re-run inside backward are not offloaded. (The order is the activation plan's: ``ActivationPlan.forward``
  and ``ActivationPlan.block``.)

Without CUDA the copies are synchronous (a host copy at the forward, a copy of that at the prefetch or use): the
same steps run, so CPU tests check exactness and the prefetch order.

YAML (``lightning-moe fit``)::

    trainer:
      callbacks:
        - class_path: lightning_moe.callbacks.ActivationOffload
          init_args: {modules: [experts], min_bytes: 1048576}
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import lightning as L
import torch
from torch import Tensor, nn

from lightning_moe.activation_plan import plan_activations
from lightning_moe.autograd import in_recomputation
from lightning_moe.flags import check_flags

__all__ = ["ActivationOffload", "OFFLOAD_MODULES"]

# module kind -> what it offloads
OFFLOAD_MODULES = {
    "experts": "the routed rows after dispatch and the grouped experts' intermediates",
    "moe": "the whole MoE layer: routing, the dispatched rows, expert intermediates and the combine inputs",
    "shared_experts": "the shared experts' inputs and intermediates",
    "attention": "the attention inputs, q/k/v and the attention output",
    "mlp": "the dense MLPs' inputs and intermediates",
    "block": "everything a transformer block saves",
}


def _module_types(kind: str) -> tuple[type, ...]:
    from lightning_moe.models.transformer import Attention, FeedForward, MLAttention, TransformerBlock
    from lightning_moe.moe.experts import GroupedExperts, SharedExperts
    from lightning_moe.moe.layer import MoELayer

    return {"experts": (GroupedExperts,), "moe": (MoELayer,), "shared_experts": (SharedExperts,),
            "attention": (Attention, MLAttention), "mlp": (FeedForward,), "block": (TransformerBlock,)}[kind]


def _is_weight(t: Tensor, depth: int = 4) -> bool:
    """A parameter, or a view / cast / local shard of one: a chain of single-input autograd nodes ending at a
    leaf that accumulates a gradient. Such tensors are alive anyway (or FSDP re-gathers them): never copied."""
    if t.grad_fn is None:
        return t.requires_grad
    fn = t.grad_fn
    for _ in range(depth):
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
        if getattr(fn, "variable", None) is not None:  # AccumulateGrad
            return True
    return False


def _keep(t: Any) -> Any:
    return t


def _owner(t: Tensor) -> Tensor:
    """The tensor whose memory ``t`` shows: its base for a view (a linear's flattened input and the RoPE tables'
    slices are views made anew at each use), else ``t``."""
    return t if t._base is None else t._base


class _Offloaded:
    """One saved tensor's host copy (and its device copy once brought back)."""

    __slots__ = ("host", "device", "copied", "dev", "ready", "src", "version", "__weakref__")

    def __init__(self, t: Tensor, stream: Optional["torch.cuda.Stream"]) -> None:
        self.device, self.src, self.version = t.device, weakref.ref(_owner(t)), t._version
        self.dev: Optional[Tensor] = None
        self.copied = self.ready = None
        if stream is None:
            self.host = t.detach().clone()  # no side stream (CPU): synchronous copies, through the same steps
            return
        self.host = torch.empty_like(t, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete on the compute stream
        with torch.cuda.stream(stream):
            self.host.copy_(t, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(stream)
        t.record_stream(stream)  # its memory is not reused before the copy has read it

    def is_copy_of(self, t: Tensor) -> bool:
        """``t`` (same address, shape, strides and dtype: the caller's key) shows the data copied: the tensor that
        owns it is the one still alive (so the address was not reused) and unchanged since."""
        return self.src() is _owner(t) and t._version == self.version

    def load(self, stream: Optional["torch.cuda.Stream"]) -> None:
        """Start the host-to-device copy on ``stream`` (None: copy now; no-op when already started)."""
        if self.dev is not None:
            return
        if self.copied is None:
            self.dev = self.host.clone()  # a storage of its own, like the device copy
            return
        with torch.cuda.stream(stream):
            stream.wait_event(self.copied)
            self.dev = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def get(self) -> Tensor:
        if self.dev is None:  # not prefetched: copy on the compute stream, in order with its use
            self.load(torch.cuda.current_stream(self.device) if self.copied is not None else None)
        elif self.ready is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(self.ready)
            self.dev.record_stream(cur)  # allocated on the side stream, used (and freed) on this one
        return self.dev


class _Group:
    """The tensors one module call saved; ``prev`` is the call before it in the forward (next in the backward)."""

    def __init__(self, offloader: "_Offloader", prev: Optional["_Group"]) -> None:
        self.offloader = offloader
        self.prev = weakref.ref(prev) if prev is not None else None
        # weak: autograd's saved-tensor slots own the copies, so each is freed once its node has run. ``saved`` finds
        # a tensor saved again; ``copies`` keeps every copy for the prefetch, also one whose key a later tensor took
        # (an address reused after a free, or a view of the same data made anew)
        self.saved: "weakref.WeakValueDictionary[tuple, _Offloaded]" = weakref.WeakValueDictionary()
        self.copies: "weakref.WeakSet[_Offloaded]" = weakref.WeakSet()

    def pack(self, t: Tensor) -> Any:
        o = self.offloader
        if type(t) is not Tensor or t.numel() * t.element_size() < o.min_bytes or _is_weight(t):
            return t
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        h = self.saved.get(key)
        if h is None or not h.is_copy_of(t):
            h = self.saved[key] = _Offloaded(t, o.stream(t.device))
            self.copies.add(h)
        return h

    @staticmethod
    def unpack(h: Any) -> Tensor:
        return h.get() if isinstance(h, _Offloaded) else h

    def prefetch(self, _grad: Optional[Tensor] = None) -> None:
        """This module's backward starts: bring back its tensors and the next module's, on the side stream."""
        prev = self.prev() if self.prev is not None else None
        self.prev = None
        for group in (self, prev):
            if group is None:
                continue
            for h in list(group.copies):
                h.load(self.offloader.stream(h.device))


class _Offloader:
    """The offload scope (:class:`~lightning_moe.activation_plan.OffloadScope`) every chosen module's plan holds."""

    def __init__(self, min_bytes: int, prefetch: bool) -> None:
        self.min_bytes, self.prefetch = min_bytes, prefetch
        self.last: Optional[_Group] = None
        self._streams: dict[torch.device, Any] = {}

    def __deepcopy__(self, memo: dict) -> "_Offloader":
        return self  # a copied model (EMA, reference) shares the streams

    def stream(self, device: torch.device) -> Optional["torch.cuda.Stream"]:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if in_recomputation():
            # a forward re-run by full activation checkpointing: the hooks still claim the saved tensors (pack lets
            # them stay), so the checkpoint sees the same saved tensors as in the original forward
            with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                return fn(*args, **kwargs)
        group = _Group(self, self.last)
        with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
            out = fn(*args, **kwargs)
        self.last = group
        first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                      if isinstance(t, Tensor) and t.requires_grad), None)
        if self.prefetch and first is not None:
            first.register_hook(group.prefetch)
        return out


class ActivationOffload(L.Callback):
    """Keep the activations that chosen modules save for the backward in pinned host memory between forward and
    backward, copied on a side CUDA stream, overlapped with compute (see the module docstring).

    Args:
        modules: module kinds whose saved tensors are offloaded: ``experts`` (default: the dispatched rows and
            the grouped experts' intermediates), ``moe``, ``shared_experts``, ``attention``, ``mlp``, ``block``.
        min_bytes: smaller tensors stay on the device (default 1 MiB).
        prefetch: bring a module's tensors back when the backward of the module after it starts (False: on use).

    A model transform (``transform_model``, applied by ``MoELanguageModel.configure_model`` before the strategy
    parallelises), so it works under every layout of :class:`~lightning_moe.MoEParallelStrategy`.
    """

    def __init__(self, modules: Sequence[str] = ("experts",), min_bytes: int = 2**20, prefetch: bool = True) -> None:
        if isinstance(modules, str):
            modules = [m.strip() for m in modules.strip("[]").split(",") if m.strip()]
        bad = [m for m in modules if m not in OFFLOAD_MODULES]
        if bad or not modules:
            raise ValueError(f"ActivationOffload(modules=...): unknown {bad or modules!r}; valid: {list(OFFLOAD_MODULES)}")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"ActivationOffload(min_bytes=...) must be a non-negative int, got {min_bytes!r}")
        self.modules = tuple(dict.fromkeys(modules))
        check_flags("ActivationOffload", prefetch=prefetch)
        self.offloader = _Offloader(min_bytes, prefetch)

    def transform_model(self, model: nn.Module) -> None:
        """Plan every module of the chosen kinds to run its forward in this callback's offload scope (in place;
        idempotent)."""
        types = tuple(t for kind in self.modules for t in _module_types(kind))
        for m in model.modules():
            if isinstance(m, types):
                plan_activations(m, offload=self.offloader)

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.offloader.last = None  # prefetch chains never cross steps
