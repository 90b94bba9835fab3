"""The tp gradient sum is decided by parameter placement, not module class (issue 21 item 9): a registered custom
attention whose own module (a class parallelize does not know) holds a per-head parameter trains under tp=2 exactly
like one process (SGD, 3 steps, every parameter), and the modules whose gradients are summed are exactly the
tp-replicated ones fed distinct tokens or heads."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from _dist import run_distributed
from lightning_moe.models import registry
from lightning_moe.models.transformer import Attention, CoreAttention
from parallel_harness import DEEPSEEK_V3_MOE, DEEPSEEK_V3_TINY, compare, small_config, train


class HeadGate(nn.Module):
    """The attention kernel, then a learned scale per head-dim channel: applied to this rank's heads only, so its
    gradient is partial on each tp rank."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.kernel = CoreAttention()
        self.weight = nn.Parameter(torch.empty(head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.weight, 0.5, 1.5)

    def forward(self, q: Tensor, *args: Tensor) -> Tensor:
        return self.kernel(q, *args) * self.weight


class GatedAttention(Attention):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.core_attention = HeadGate(self.head_dim)


GATED = dict(attention="head_gate_test")


@contextlib.contextmanager
def _gated_registered():
    """The test attention, registered only while it is used: registered at import it would be listed in every other
    test's 'registered: ...' messages for the rest of the session."""
    registry.register("attention", "head_gate_test", GatedAttention, overwrite=True)
    try:
        yield
    finally:
        registry.unregister("attention", "head_gate_test")


def _worker(rank: int, world_size: int) -> dict:
    from lightning_moe.build import build_model
    from lightning_moe.parallel import ParallelDims, parallelize

    registry.register("attention", "head_gate_test", GatedAttention, overwrite=True)  # the rank's own registry
    dims = ParallelDims(world_size=world_size, tp=2).build_meshes("cpu")
    synced = {}
    for label, model in (("gated", GATED), ("mla", DEEPSEEK_V3_TINY)):
        holder = {}

        def par(m, holder=holder):
            holder["sync"] = parallelize(m, dims)
            holder["model"] = m
            return m

        build_model(small_config(model, **(DEEPSEEK_V3_MOE if label == "mla" else {})), parallelize=par)
        names = {id(m): n for n, m in holder["model"].named_modules()}
        synced[label] = sorted(names[id(m)] for m in holder["sync"])
    return {"synced": synced, "trained": train(dict(tp=2, dp_shard=1), world_size, model=GATED)}


def test_a_custom_attention_parameter_is_summed_over_tp():
    out = run_distributed(_worker, 2, timeout=600)
    with _gated_registered():
        ref = train(None, 1, model=GATED)
    assert compare(out["trained"], ref) == []
    per_block = lambda names, i: sorted(n.split(".", 2)[2] for n in names if n.startswith(f"layers.{i}."))  # noqa: E731
    shared = ["moe.router", "moe.shared_experts.w1", "moe.shared_experts.w2",
              "moe.shared_experts.w3"]
    gated = out["synced"]["gated"]
    # the head gate (a class the plan does not know), the per-head qk norms, the router and the shared experts;
    # not the routed experts, nothing the plan split (DTensors), nothing outside the blocks
    assert per_block(gated, 1) == sorted(["attention.core_attention", "attention.k_norm", "attention.q_norm", *shared])
    assert per_block(gated, 0) == ["attention.core_attention", "attention.k_norm", "attention.q_norm"]  # dense block
    assert all(n.startswith("layers.") for n in gated)
    # MLA: its latent projections and norms run whole on every tp rank (full gradients there): not summed
    assert per_block(out["synced"]["mla"], 1) == shared and per_block(out["synced"]["mla"], 0) == []
