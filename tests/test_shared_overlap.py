"""Shared experts overlapped with the dispatch (``MoELayer.overlap_shared_experts``): under W=2 ep=2 with the
all-to-all and the all-gather dispatchers, the shared experts' forward runs inside ``dispatch`` (after the rows'
collective is issued, before it is read), and losses and every gradient are bit-identical to running them after the
combine, also with the shared experts recomputed."""

from __future__ import annotations

import torch

from _dist import run_distributed
from _memory import assert_same, gqa_config, reference_model, step, tokens


def _order(model, ids) -> list[str]:
    """Event order of one forward of the first MoE layer: dispatch start / end and the shared experts' forward."""
    layer = model.moe_layers()[0]
    events: list[str] = []
    inner = layer.dispatcher.dispatch

    def dispatch(*a, **k):
        events.append("dispatch")
        out = inner(*a, **k)
        events.append("dispatched")
        return out

    layer.dispatcher.dispatch = dispatch
    handle = layer.shared_experts.register_forward_pre_hook(lambda *_: events.append("shared"))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
        del layer.dispatcher.dispatch
    return events


def _worker(rank: int, world_size: int) -> str:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lightning_moe.build import build_model
    from lightning_moe.parallel import ParallelDims, parallelize

    torch.manual_seed(0)
    dims = ParallelDims(world_size=world_size, ep=2).build_meshes("cpu")
    cfg = gqa_config()
    assert cfg.moe.shared_expert_hidden_size > 0
    weights = reference_model(cfg).state_dict()
    ids = tokens(cfg, seed=100 + rank)

    def build(dispatcher, overlap, kinds="none"):
        def load(model):
            set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True))
            model.reset_buffers()

        model = build_model(cfg, initialize=load, parallelize=lambda m: (
            parallelize(m, dims, dispatcher=dispatcher, activation_checkpointing=kinds), m)[1])
        for layer in model.moe_layers():
            layer.replan(overlap_shared_experts=overlap)
        return model

    problems = []
    for dispatcher in ("alltoall", "allgather"):
        order = {ov: _order(build(dispatcher, ov), ids) for ov in (True, False)}
        if order[True] != ["dispatch", "shared", "dispatched"] or order[False] != ["dispatch", "dispatched", "shared"]:
            problems.append(f"{dispatcher}: event order {order}")
        base = step(build(dispatcher, False), ids)
        for kinds in ("none", ["shared_experts"]):
            try:
                assert_same(step(build(dispatcher, True, kinds), ids), base)
            except AssertionError as err:
                problems.append(f"{dispatcher} {kinds}: {err}")
    return "; ".join(problems) or "ok"


def test_shared_experts_overlap_the_dispatch_with_identical_numbers():
    assert run_distributed(_worker, 2) == "ok"
