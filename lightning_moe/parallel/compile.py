"""Regional ``torch.compile``: the shape-static parts of every block, compiled module by module (as torchtitan does).

The routed experts and the token dispatch stay eager: their row counts change every step (data-dependent shapes),
which would recompile or graph-break. What compiles is where the launches and memory passes are: RMSNorm, the
attention block (projections, qk-norm, RoPE, the SDPA call), the router's score / top-k / loss arithmetic, the
dense MLP and shared-expert SwiGLU. Each region is compiled in place with ``nn.Module.compile`` (state-dict keys are
unchanged; identical blocks share one compiled graph). Applied by :func:`~lightning_moe.parallel.parallelize.parallelize`
after tensor/expert parallelism and activation checkpointing, before FSDP.
"""

from __future__ import annotations

from typing import Iterable, Union

from torch import nn

from lightning_moe.models.transformer import MoETransformer, RMSNorm

__all__ = ["COMPILE_REGIONS", "apply_compile", "resolve_compile"]

COMPILE_REGIONS = ("norm", "attention", "router", "mlp")


def resolve_compile(spec: Union[bool, str, Iterable[str], None]) -> tuple[str, ...]:
    """``True`` -> every region, ``False``/None/"none" -> none, a list (or comma-separated string) -> those."""
    if spec is None or spec is False or spec == "none":
        return ()
    if spec is True or spec == "all":
        return COMPILE_REGIONS
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    bad = [n for n in names if n not in COMPILE_REGIONS]
    if bad:
        raise ValueError(f"compile regions must be True, False or a list of {COMPILE_REGIONS}; unknown: {bad}")
    return tuple(dict.fromkeys(names))


def _regions(model: MoETransformer, names: tuple[str, ...]) -> list[nn.Module]:
    out: list[nn.Module] = []
    if "norm" in names:
        out += [m for m in model.modules() if isinstance(m, RMSNorm)]
    for block in model.layers.values():
        if "attention" in names:
            out.append(block.attention)
        if block.is_moe:
            if "router" in names:
                out.append(block.moe.router)
            if "mlp" in names and block.moe.shared_experts is not None:
                out.append(block.moe.shared_experts)
        elif "mlp" in names:
            out.append(block.feed_forward)
    return out


def apply_compile(model: MoETransformer, regions: Union[bool, str, Iterable[str], None] = True, **compile_kwargs) -> int:
    """Compile the chosen regions of ``model`` in place; returns how many modules were compiled.
    ``compile_kwargs`` go to ``torch.compile`` (e.g. ``backend="eager"`` in CPU tests)."""
    mods = _regions(model, resolve_compile(regions))
    seen: set[int] = set()
    for m in mods:
        if id(m) not in seen:  # a norm may be reached twice (e.g. inside attention's qk-norm)
            seen.add(id(m))
            m.compile(**compile_kwargs)
    return len(seen)
