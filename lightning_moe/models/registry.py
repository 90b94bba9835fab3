"""Component registry: which class builds each part of the model, chosen by name from the config.

Kinds and the config field that names the component (defaults in brackets):

==================  ==============================  =========================================================
kind                config field                    built with
==================  ==============================  =========================================================
``attention``       ``ModelConfig.attention``       ``(cfg: ModelConfig)``  ["gqa"; also "mla"]
``mlp``             ``ModelConfig.mlp``             ``(dim, hidden_dim)``  dense layers ["swiglu"]
``router``          ``MoEConfig.router``            ``(moe: MoEConfig, hidden_size, init_std=)``  ["topk"]
``experts``         ``MoEConfig.experts``           ``(num_experts, dim, hidden_dim, init_std=, out_init_std=)``
                                                    ["grouped_mm"; "loop" is the per-expert reference]
``shared_experts``  ``MoEConfig.shared_experts``    ``(dim, hidden_dim, gate=, init_std=, out_init_std=)`` ["swiglu"]
==================  ==============================  =========================================================

Register your own before building the model (``register("experts", "my_fp8", MyExperts)``), then name it in the
config; the model checks the names it builds (:func:`check`, also run by ``MoELanguageModel`` at construction).
Parallelisation (``lightning_moe.parallel.parallelize``) relies on the parameter names of the built-in
classes (``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``, ``weight``): a replacement that keeps them (e.g. a
subclass) works under every layout. Transforms that wrap or swap modules of a built model belong to the build
pipeline instead (:func:`lightning_moe.build.build_model`).

A leaf: it imports no model module. The built-in components register themselves where they are defined
(``models/transformer.py``, ``moe/router.py``, ``moe/experts.py``), which the modules that build them import.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Optional

from torch import nn

__all__ = ["KINDS", "register", "build", "check", "names"]

KINDS = ("attention", "mlp", "router", "experts", "shared_experts")
_REGISTRY: dict[str, dict[str, Callable[..., nn.Module]]] = {kind: {} for kind in KINDS}


def _check_kind(kind: str) -> dict[str, Callable[..., nn.Module]]:
    if kind not in _REGISTRY:
        raise ValueError(f"unknown component kind {kind!r}; known kinds: {', '.join(KINDS)}")
    return _REGISTRY[kind]


def register(kind: str, name: str, factory: Optional[Callable[..., nn.Module]] = None, *, overwrite: bool = False):
    """Register ``factory`` (a class or a function returning a module) as component ``name`` of ``kind``. Usable as
    a decorator: ``@register("experts", "mine")``."""
    table = _check_kind(kind)

    def add(f: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in table and table[name] is not f and not overwrite:
            raise ValueError(f"{kind} {name!r} is already registered; pass overwrite=True to replace it")
        table[name] = f
        return f

    return add if factory is None else add(factory)


def unregister(kind: str, name: str) -> None:
    """Remove component ``name`` of ``kind`` (a KeyError naming it when it is not registered)."""
    table = _check_kind(kind)
    if name not in table:
        raise KeyError(f"{kind} {name!r} is not registered")
    del table[name]


def names(kind: str) -> list[str]:
    return sorted(_check_kind(kind))


def check(kind: str, name: str, field: Optional[str] = None) -> None:
    """ValueError unless ``name`` is a registered ``kind``; ``field``: the config field that named it."""
    table = _check_kind(kind)
    if name not in table:
        close = difflib.get_close_matches(str(name), list(table), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{field or kind}={name!r} is not a registered {kind}{hint}; registered: "
                         f"{', '.join(sorted(table))} (add your own with lightning_moe.models.registry.register)")


def build(kind: str, name: str, *args: Any, **kwargs: Any) -> nn.Module:
    """Instantiate component ``name`` of ``kind``; an unknown name is a ValueError listing the registered ones."""
    check(kind, name)
    return _REGISTRY[kind][name](*args, **kwargs)
