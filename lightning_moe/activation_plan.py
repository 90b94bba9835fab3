"""Each module's activation plan: which of its seams re-run their forward in the backward (recompute) and whether
what its forward saves for the backward goes to the host (offload). Decided when the model is built and
parallelised (DESIGN invariant 13): the offload callback's model transform and ``apply_ac`` set it through
:func:`plan_activations`; the module reads it at its seams and never has a method replaced.

A class with seams names them (``activation_seams``) and calls its plan there explicitly:

* a module's whole forward (``"forward"``): ``self.activation_plan.forward(self._forward, *args)``: the offload
  scope outside, the recomputation inside it, so a recomputed forward's inputs are still offloaded and what it drops
  is recomputed, not offloaded;
* a transformer block (``full`` recomputation): ``self.activation_plan.block(self._forward, *args)``: the
  recomputation outside the offload scope: inside a recomputed block, what the scope offloads stays offloaded (not
  recomputed) and the re-run is not offloaded again (the scope sees :func:`~lightning_moe.autograd.in_recomputation`);
* a part of a forward (``act_down``, ``up_proj``, the context-parallel ``kernel``):
  ``self.activation_plan.recompute.run("act_down", self.act_down, *inputs, captured=(w, offs))``.

Every recomputation is ``torch.utils.checkpoint`` (non-reentrant) with
:func:`~lightning_moe.autograd.recompute_context` as its ``context_fn``; regions hold no collective (the seams are
chosen so) and no dropout (the RNG state is not saved). A plan is an attribute, not a submodule: state-dict keys are
unchanged, and the hooks of FSDP2 / tensor parallelism (on module calls) stay outside every region.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

from lightning_moe.autograd import recompute_context

__all__ = ["ActivationPlan", "OffloadPolicy", "OffloadScope", "RecomputePolicy", "plan_activations"]

T = TypeVar("T")


class OffloadScope(Protocol):
    """What runs a forward with its saved tensors offloaded (``ActivationOffload``'s offloader)."""

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...


@dataclass(frozen=True)
class RecomputePolicy:
    """The seams whose forward is re-run in the backward instead of keeping what it saves (empty: none)."""

    seams: frozenset[str] = frozenset()

    def run(self, seam: str, fn: Callable[..., T], *inputs: Any, captured: tuple = (), **kwargs: Any) -> T:
        """``fn(*inputs, *captured, **kwargs)``, recomputed when ``seam`` is planned so. Only ``inputs`` are region
        inputs (saved through the saved-tensor hooks, so an offload scope can move them); ``captured`` (weights,
        offsets) and ``kwargs`` are held as they are, so an offload hook never copies a weight."""
        if seam not in self.seams or not torch.is_grad_enabled():
            return fn(*inputs, *captured, **kwargs)
        return checkpoint(lambda *a: fn(*a, *captured, **kwargs), *inputs, use_reentrant=False,
                          preserve_rng_state=False, context_fn=recompute_context)


@dataclass(frozen=True)
class OffloadPolicy:
    """The scope the module's forward runs in (None: nothing offloaded)."""

    scope: Optional[OffloadScope] = None

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.scope is None:
            return fn(*args, **kwargs)
        return self.scope.run(fn, *args, **kwargs)


@dataclass(frozen=True)
class ActivationPlan:
    """One module's recompute and offload policy (the default: neither)."""

    recompute: RecomputePolicy = RecomputePolicy()
    offload: OffloadPolicy = OffloadPolicy()

    def forward(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A module's forward seam: offload scope outside, recomputation inside (see the module docstring)."""
        if self.offload.scope is None:
            return self.recompute.run("forward", fn, *args, **kwargs)
        return self.offload.run(functools.partial(self.recompute.run, "forward", fn), *args, **kwargs)

    def block(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A transformer block's forward: recomputation (``full``) outside the offload scope (see the module
        docstring)."""
        if self.offload.scope is None:
            return self.recompute.run("forward", fn, *args, **kwargs)
        return self.recompute.run("forward", functools.partial(self.offload.run, fn), *args, **kwargs)


def plan_activations(module: Any, *, recompute: Iterable[str] = (), offload: Optional[OffloadScope] = None) -> None:
    """Add ``recompute`` seams and / or an ``offload`` scope to ``module``'s plan (a build step, idempotent). The
    seams must be among those its class declares (``activation_seams``); a second, different offload scope is a
    ValueError (one ``ActivationOffload`` callback lists every module kind)."""
    declared = tuple(getattr(type(module), "activation_seams", ()))
    recompute = frozenset(recompute)
    missing = sorted(recompute - set(declared)) + ([] if offload is None or "forward" in declared else ["forward"])
    if missing:
        raise ValueError(f"{type(module).__name__} has no activation seam {missing} (it declares {list(declared)}): "
                         "recompute / offload applies to the model's own classes, or to a class declaring "
                         "activation_seams and calling its activation_plan there")
    plan: ActivationPlan = module.activation_plan
    if offload is not None and plan.offload.scope not in (None, offload):
        raise ValueError(f"{type(module).__name__} is already offloaded by another ActivationOffload: use one "
                         "ActivationOffload callback listing every module kind")
    module.activation_plan = dataclasses.replace(
        plan,
        recompute=RecomputePolicy(plan.recompute.seams | recompute),
        offload=OffloadPolicy(offload if offload is not None else plan.offload.scope),
    )
