"""Optimizer state by parameter name, so a checkpoint maps onto the right parameters under any layout.

torch's ``Optimizer.state_dict()`` keys the state by a parameter's position in ``param_groups``, and how
``MoELanguageModel`` splits parameters into groups depends on the layout (fused AdamW cannot mix DTensor and plain
parameters in one group). Checkpoints therefore hold the *by-name* form that
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` also produces::

    {"state": {fqn: {"step": ..., "exp_avg": ..., ...}},
     "param_groups": [{"lr": ..., "weight_decay": ..., ..., "params": [fqn, ...]}, ...]}

Names are the module's parameter names with wrapper prefixes removed (activation checkpointing, FSDP1,
``torch.compile``), the same names as the model's state dict.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_moe.checkpoint.format import clean_param_name

__all__ = ["check_shapes", "param_names", "is_by_name", "optimizer_state_by_name", "optimizer_state_by_index", "regroup",
           "accept_state_by_name"]

def param_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of ``module`` (wrapper prefixes removed)."""
    return {id(p): clean_param_name(n) for n, p in module.named_parameters(remove_duplicate=False)}


def is_by_name(osd: dict[str, Any]) -> bool:
    return all(isinstance(k, str) for k in osd.get("state", {})) and all(
        isinstance(p, str) for g in osd.get("param_groups", []) for p in g.get("params", []))


def optimizer_state_by_name(osd: dict[str, Any], optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """Rekey a torch ``optimizer.state_dict()`` (state by position) by parameter name."""
    if is_by_name(osd):
        return osd
    names = param_names(module)
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {order[i]: s for i, s in osd["state"].items()}
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def regroup(saved_groups: list[dict[str, Any]], optimizer: Optimizer, module: nn.Module) -> list[dict[str, Any]]:
    """The saved (by-name) param groups rearranged into ``optimizer``'s current grouping: each current group takes
    the hyper-parameters of the saved group its parameters came from. ValueError when a parameter is missing or a
    current group mixes parameters whose saved hyper-parameters differ."""
    names = param_names(module)
    owner: dict[str, dict[str, Any]] = {fqn: g for g in saved_groups for fqn in g["params"]}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        fqns = [names[id(p)] for p in group["params"]]
        missing = [f for f in fqns if f not in owner]
        if missing:
            raise ValueError(f"the checkpoint's optimizer state has no parameter group for {missing[:5]} "
                             f"({len(missing)} parameters): it was written for another model")
        hyper = [{k: v for k, v in owner[f].items() if k != "params"} for f in fqns]
        if any(h != hyper[0] for h in hyper[1:]):
            raise ValueError(f"optimizer group {i} mixes parameters that had different hyper-parameters in the "
                             "checkpoint: keep the optimizer's parameter groups as they were when it was saved")
        out.append({**(hyper[0] if hyper else {}), "params": fqns})
    return out


def optimizer_state_by_index(osd: dict[str, Any], optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """A by-name optimizer state arranged for ``optimizer.load_state_dict`` of the current ``optimizer``."""
    if not is_by_name(osd):
        return osd
    names = param_names(module)
    current = {names[id(p)] for g in optimizer.param_groups for p in g["params"]}
    unknown = sorted(set(osd["state"]) - current)
    if unknown:
        raise ValueError(f"the checkpoint's optimizer state names parameters this model does not have: {unknown[:5]}")
    groups = regroup(osd["param_groups"], optimizer, module)
    index: dict[str, int] = {}
    for g in groups:
        for fqn in g["params"]:
            index[fqn] = len(index)
    return {
        "state": {index[fqn]: s for fqn, s in osd["state"].items()},
        "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in groups],
    }


def accept_state_by_name(optimizer: Optimizer, module: nn.Module) -> None:
    """Let ``optimizer.load_state_dict`` take the by-name form too (Lightning's single-device strategy hands it the
    checkpoint's optimizer state as it is); a by-position state dict passes through unchanged."""

    def hook(opt: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return optimizer_state_by_index(state_dict, opt, module)

    optimizer.register_load_state_dict_pre_hook(hook)


def check_shapes(model: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]], where: str,
                 strict: bool = True) -> None:
    """ValueError naming every parameter whose global shape differs between the model and a checkpoint (and, when
    ``strict``, the names only one of them has): a checkpoint of another model must fail before any step."""
    wrong = [f"{k}: checkpoint {list(saved[k])} vs model {list(v)}" for k, v in model.items()
             if k in saved and tuple(saved[k]) != tuple(v)]
    missing = sorted(set(model) - set(saved)) if strict else []
    unexpected = sorted(set(saved) - set(model)) if strict else []
    if wrong or missing or unexpected:
        parts = []
        if wrong:
            parts.append(f"{len(wrong)} shapes differ: " + "; ".join(wrong[:8]))
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:8]}")
        if unexpected:
            parts.append(f"not in the model: {unexpected[:8]}")
        raise ValueError(f"the checkpoint {where} was written for another model ({' | '.join(parts)}): resume "
                         "with the model configuration it was saved with")
