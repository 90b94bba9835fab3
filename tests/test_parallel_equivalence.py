"""Every supported layout trains exactly like one process on the same global batch (DESIGN invariants 2-6).

fp32, plain SGD, 3 steps: every step's train_loss, logged train/aux_loss and train/z_loss, and every final parameter
within 1e-5 relative to its norm.
The config uses sigmoid routing with the aux-loss-free expert bias, the per-sequence aux loss, z-loss and shared
experts, so the loss normalisation, the routers' reduction groups and the bias update are all exercised; the
expert bias must be bitwise identical on every rank. Some cases use the global aux loss (counts over every rank),
which is layout-invariant too. The micro-batch "aux" loss is per data-parallel rank by definition and is not
compared; under gradient accumulation "global" sees one micro-batch at a time, so that case keeps "seq".
DeepSeek-V3-shaped cases (MLA, group-limited routing, a shared expert) cover MLA under tensor parallelism; padded
cases (leading and trailing padding, no accumulation: the per-micro-batch z-loss normaliser is not accumulation-
invariant once micro-batches hold different numbers of real tokens) cover the masks under tp and cp; with data ranks
holding different numbers of real tokens they cover the z-loss's normaliser over the whole global micro-batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from parallel_harness import (DEEPSEEK_V3_MOE, DEEPSEEK_V3_TINY, GLOBAL_BATCH, attention_masks, compare,
                              train)

DSV3 = dict(model=DEEPSEEK_V3_TINY, moe=DEEPSEEK_V3_MOE)
DSV3_NO_Q_LORA = dict(model={**DEEPSEEK_V3_TINY, "q_lora_rank": None}, moe=DEEPSEEK_V3_MOE)

W2_LAYOUTS = {
    "dp_shard=2": dict(layout=dict(dp_shard=2)),
    "ep=2 folded over dp": dict(layout=dict(ep=2)),
    "tp=2 ep=2 (EP across TP)": dict(layout=dict(tp=2, ep=2, dp_shard=1)),
    "cp=2 ep=2": dict(layout=dict(cp=2, ep=2, dp_shard=1)),
    "allgather dispatcher ep=2": dict(layout=dict(ep=2, dispatcher="allgather")),
    "gradient accumulation 2, ep=2": dict(layout=dict(ep=2), accumulate=2),
    "clipping active, tp=2 ep=2": dict(layout=dict(tp=2, ep=2, dp_shard=1), clip=0.05),
    "activation checkpointing, ep=2": dict(layout=dict(ep=2, activation_checkpointing="full")),
    "global aux loss, ep=2": dict(layout=dict(ep=2), moe=dict(aux_loss_type="global")),
    # the chunked loss takes the output weight's gradient in the forward: FSDP2 must still reduce it
    "chunked linear cross-entropy, ep=2 (FSDP dp_shard=2)": dict(layout=dict(ep=2), loss_impl="chunked"),
    # 3 experts do not split over 2 FSDP ranks: the expert weights are sharded on their hidden dim D instead
    "experts FSDP-sharded on D, E=3 over edp=2": dict(layout=dict(dp_shard=2), moe=dict(num_experts=3)),
    # DeepSeek-V3 shape: MLA heads split after the latent projections, group-limited routing, a shared expert
    "MLA tp=2": dict(layout=dict(tp=2, dp_shard=1), **DSV3),
    "MLA tp=2 ep=2": dict(layout=dict(tp=2, ep=2, dp_shard=1), **DSV3),
    "MLA without q compression, tp=2 ep=2": dict(layout=dict(tp=2, ep=2, dp_shard=1), **DSV3_NO_Q_LORA),
    "MLA tp=2 ep=2, recompute full + mla_up_proj + attn_core": dict(
        layout=dict(tp=2, ep=2, dp_shard=1, activation_checkpointing=["full", "mla_up_proj", "attn_core"]), **DSV3),
    # padded batches (leading and trailing padding; see parallel_harness.PAD_PATTERNS)
    "padded, tp=2": dict(layout=dict(tp=2, dp_shard=1), padded=True),
    "padded, tp=2 ep=2": dict(layout=dict(tp=2, ep=2, dp_shard=1), padded=True),
    "padded, cp=2": dict(layout=dict(cp=2, dp_shard=1), padded=True),
    "padded MLA, cp=2 ep=2": dict(layout=dict(cp=2, ep=2, dp_shard=1), padded=True, **DSV3),
}
W4_LAYOUTS = {
    "dp_shard=4 ep=2": dict(layout=dict(dp_shard=4, ep=2)),
    "global aux loss, tp=2 x dp_shard=2 ep=2": dict(layout=dict(tp=2, dp_shard=2, ep=2),
                                                   moe=dict(aux_loss_type="global")),
    "HSDP dp_replicate=2 x dp_shard=2 ep=2": dict(layout=dict(dp_replicate=2, dp_shard=2, ep=2)),
    "tp=2 x dp_shard=2 ep=2 etp=2": dict(layout=dict(tp=2, dp_shard=2, ep=2, etp=2)),
    "padded MLA, tp=2 x cp=2 ep=2": dict(layout=dict(tp=2, cp=2, dp_shard=1, ep=2), padded=True, **DSV3),
    # the two data ranks hold different numbers of real tokens: the LM loss's and the z-loss's global normalisers
    # must count them ("seq" is a mean over sequences, and every rank holds as many sequences)
    "padded, cp=2 x dp_shard=2 ep=2": dict(layout=dict(cp=2, dp_shard=2, ep=2), padded=True),
}

# Data-parallel ranks with DIFFERENT numbers of real tokens (PAD_PATTERNS: with 2 data ranks rank 0 reads samples
# 0, 2, 4, 6 of each step, patterns (0, 0) and (2, 0): 60 real tokens; rank 1 patterns (0, 3) and (1, 2): 52), a
# large z-loss coefficient, and aux losses that are exact under any split ("none", "global"): the z-loss is
# normalised by the real tokens of the whole global micro-batch, so gradients, parameters and the logged
# train/z_loss equal one process on the same global batch (Megatron's mean over data ranks of per-rank means
# would not).
ZLOSS = dict(z_loss_coeff=0.1)
W2_PADDED_DP_LAYOUTS = {
    "padded z-loss, dp_shard=2, no aux loss": dict(layout=dict(dp_shard=2), padded=True,
                                                   moe=dict(ZLOSS, aux_loss_type="none")),
    "padded z-loss, ep=2 folded over dp, global aux loss": dict(layout=dict(ep=2), padded=True,
                                                                moe=dict(ZLOSS, aux_loss_type="global")),
}
W4_PADDED_DP_LAYOUTS = {
    "padded z-loss, tp=2 x dp_shard=2 ep=2, no aux loss": dict(layout=dict(tp=2, dp_shard=2, ep=2), padded=True,
                                                               moe=dict(ZLOSS, aux_loss_type="none")),
    "padded z-loss, cp=2 x dp_shard=2 ep=2, global aux loss": dict(layout=dict(cp=2, dp_shard=2, ep=2), padded=True,
                                                                   moe=dict(ZLOSS, aux_loss_type="global")),
}


def _run_layouts(rank: int, world_size: int, cases: dict) -> dict:
    out = {}
    for name, case in cases.items():
        try:
            res = train(case["layout"], world_size, case.get("accumulate", 1), case.get("clip"), case.get("moe"),
                        case.get("loss_impl", "auto"), case.get("model"), case.get("padded", False))
            # the expert bias must agree bitwise on every rank
            for b in res["biases"]:
                gathered = [torch.empty_like(b) for _ in range(world_size)]
                dist.all_gather(gathered, b)
                if not all(torch.equal(g, gathered[0]) for g in gathered):
                    raise AssertionError("expert_bias differs between ranks")
            out[name] = res
        except Exception as e:  # keep going: report every failing layout at once
            import traceback

            out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
        dist.barrier()
    return out


_REFS: dict = {}


def _reference(clip=None, moe=None, model=None, padded=False) -> dict:
    key = (clip, repr(sorted((moe or {}).items())), repr(sorted((model or {}).items())), padded)
    if key not in _REFS:
        _REFS[key] = train(None, 1, 1, clip, moe, model=model, padded=padded)
    return _REFS[key]


def _check(results: dict, cases: dict) -> None:
    failures = []
    for name, case in cases.items():
        res = results[name]
        if "error" in res:
            failures.append(f"[{name}] {res['error']}")
            continue
        ref = _reference(clip=case.get("clip"), moe=case.get("moe"), model=case.get("model"),
                         padded=case.get("padded", False))
        assert ref["losses"][0] > ref["losses"][-1], "the reference run should learn"
        problems = compare(res, ref)
        if problems:
            failures.append(f"[{name}] " + "; ".join(problems[:8]))
        # the bias moved (the aux-loss-free update ran) and matches one process exactly in value
        for b, rb in zip(res["biases"], ref["biases"]):
            assert rb.abs().sum() > 0
            if not torch.allclose(b, rb, atol=0, rtol=0):
                failures.append(f"[{name}] expert_bias differs from one process: {b} vs {rb}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world, layouts", [(2, W2_LAYOUTS), (4, W4_LAYOUTS), (2, W2_PADDED_DP_LAYOUTS),
                                            (4, W4_PADDED_DP_LAYOUTS)],
                         ids=["two_rank", "four_rank", "two_rank_padded_dp_z_loss", "four_rank_padded_dp_z_loss"])
def test_layouts_match_one_process(world, layouts):
    """Every layout of ``layouts`` on ``world`` gloo ranks matches one process (the padded-dp cases: data ranks with
    different real-token counts, z-loss on)."""
    _check(run_distributed(_run_layouts, world, layouts, timeout=600), layouts)


def test_padding_leaves_data_ranks_with_different_token_counts():
    """The premise of the padded data-parallel cases: the two data ranks of a step hold different numbers of real
    tokens (rank r reads samples r, r + 2, ... of the step's global batch)."""
    masks = attention_masks(GLOBAL_BATCH)
    assert masks[0::2].sum() != masks[1::2].sum()




def test_clipping_reference_is_active():
    """The clipped reference must differ from the unclipped one, or the clipping case tests nothing."""
    a, b = _reference(), _reference(clip=0.05)
    assert abs(a["losses"][-1] - b["losses"][-1]) > 1e-4


def test_expert_fsdp_shard_dim():
    from torch.distributed.tensor import Shard

    from lightning_moe.moe.experts import GroupedExperts
    from lightning_moe.parallel.parallelize import _expert_shard_placement

    experts = GroupedExperts(3, 16, 8)
    place = _expert_shard_placement(experts, edp=2)
    assert place(experts.w1) == Shard(2) and place(experts.w3) == Shard(2) and place(experts.w2) == Shard(1)
    even = _expert_shard_placement(GroupedExperts(4, 16, 8), edp=2)
    assert all(even(p) == Shard(0) for p in (experts.w1, experts.w2))
