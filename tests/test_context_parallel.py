"""Context parallelism (all-gather KV): load-balanced sharding, batch slicing, and equivalence with one process.

Every rank builds the full inputs from fixed seeds, computes the single-process reference itself, then runs its
load-balanced shard through AllGatherKVAttention (or the whole model with core_attention replaced). Outputs must
match at the rank's positions; gradients, each rank's placed at its positions and summed over ranks, must match the
reference gradients (the all-gather's backward is a reduce-scatter, so K/V grads get every rank's queries).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from lightning_moe.config import ModelConfig
from lightning_moe.models.transformer import CoreAttention, MoETransformer, expand_kv
from lightning_moe.parallel.context_parallel import AllGatherKVAttention, cp_shard_indices, shard_batch_for_cp

RTOL = 1e-5


def _assert_rel(actual, expected, rtol=RTOL, what=""):
    err = (actual - expected).abs().max().item()
    ref = expected.abs().max().item()
    assert err <= rtol * max(ref, 1e-12), f"{what}: max abs err {err:.3e} vs max |ref| {ref:.3e}"


# ---------------------------------------------------------------------------------------------- single process


def test_shard_indices_cp2():
    assert cp_shard_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_shard_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_shard_indices(8, 2, 0).dtype == torch.long


def test_shard_indices_cp4_partition():
    got = [cp_shard_indices(16, 4, r).tolist() for r in range(4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # every rank holds the same number of tokens and the same causal work (sum of positions + 1)
    cat = torch.tensor(sum(got, []))
    assert sorted(cat.tolist()) == list(range(16))
    work = [sum(p + 1 for p in r) for r in got]
    assert len(set(work)) == 1
    assert cp_shard_indices(7, 1, 0).tolist() == list(range(7))


def test_shard_indices_bad_seq_len():
    with pytest.raises(ValueError, match="divisible by 8"):
        cp_shard_indices(12, 4, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_shard_indices(8, 2, 2)


def test_shard_batch():
    B, S = 2, 8
    ids = torch.arange(B * S).view(B, S)
    labels = ids + 100
    am = torch.ones(B, S, dtype=torch.long)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": am, "sample_id": torch.tensor([3, 4]), "n": 5}
    parts = [shard_batch_for_cp(batch, 2, r) for r in range(2)]
    assert parts[0]["input_ids"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert parts[1]["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert parts[1]["global_positions"].tolist() == [2, 3, 4, 5]
    assert parts[0]["attention_mask"].shape == (B, 4)
    assert parts[0]["sample_id"].tolist() == [3, 4] and parts[0]["n"] == 5
    assert batch["input_ids"].shape == (B, S) and "global_positions" not in batch  # input untouched
    # the shards put back at their positions give the batch
    full = torch.empty_like(ids)
    for p in parts:
        full[:, p["global_positions"]] = p["input_ids"]
    assert torch.equal(full, ids)
    # cp == 1: unchanged, positions added, labels optional
    one = shard_batch_for_cp({"input_ids": ids}, 1, 0)
    assert one["input_ids"] is ids and one["global_positions"].tolist() == list(range(S))
    # packed documents' position_ids are sliced like the tokens; the global positions stay the causal order
    docs = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    packed = [shard_batch_for_cp({**batch, "position_ids": docs}, 2, r) for r in range(2)]
    assert packed[0]["position_ids"].tolist() == [[0, 1, 3, 4], [0, 1, 0, 1]]
    assert packed[0]["global_positions"].tolist() == [0, 1, 6, 7]


def test_shard_batch_errors():
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="labels"):
        shard_batch_for_cp({"input_ids": ids}, 2, 0)
    with pytest.raises(ValueError, match="position_ids.*shape of input_ids"):
        shard_batch_for_cp({"input_ids": ids, "labels": ids, "position_ids": torch.arange(8)}, 2, 0)
    with pytest.raises(ValueError, match="divisible by 4"):
        shard_batch_for_cp({"input_ids": ids[:, :6], "labels": ids[:, :6]}, 2, 0)


# ------------------------------------------------------------------------------------------------- multi-rank


def _attention_case(rank, world, B, H, S, Kqk, Kv, scale, seed, idx=None, G=None, P=0, padded=False, valid=None):
    """Random q [B, H, S, Kqk], k [B, G, S, Kqk - P], v [B, G, S, Kv] and, with P > 0, a shared key part
    [B, 1, S, P] (MLA's RoPE key); with ``padded`` a key padding mask with zeros on every rank's tokens, or the
    given ``valid`` [B, S]. A rank whose tokens are all real passes no mask, as the model does."""
    G = G or H
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, Kqk, generator=g, requires_grad=True)
    k = torch.randn(B, G, S, Kqk - P, generator=g, requires_grad=True)
    v = torch.randn(B, G, S, Kv, generator=g, requires_grad=True)
    ks = torch.randn(B, 1, S, P, generator=g, requires_grad=True) if P else None
    go = torch.randn(B, H, S, Kv, generator=g)  # upstream gradient
    if padded:
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[0, :3] = False  # leading padding
        valid[-1, S - 5:] = False  # trailing padding
        valid[-1, S // 2] = False  # a hole in the middle
    full = (q, k, v) + ((ks,) if P else ())
    ref = CoreAttention()(q, k, v, valid, scale, torch.arange(S), ks)
    (ref * go).sum().backward()

    if idx is None:
        idx = cp_shard_indices(S, world, rank)
    local = [t.detach()[:, :, idx].clone().requires_grad_(True) for t in full]
    attn = AllGatherKVAttention(dist.group.WORLD)
    gathered = []
    gather = attn._gather_seq
    attn._gather_seq = lambda x: gathered.append(tuple(x.shape)) or gather(x)
    lvalid = None if valid is None or bool(valid[:, idx].all()) else valid[:, idx]
    out = attn(*local[:3], lvalid, scale, idx, *local[3:])
    # K/V travel compact: G kv heads, and the shared key part once (expand_kv runs after the gather)
    assert gathered == [(B, G, len(idx), Kqk - P), (B, G, len(idx), Kv)] + ([(B, 1, len(idx), P)] if P else [])
    _assert_rel(out, ref.detach()[:, :, idx], what="output")
    (out * go[:, :, idx]).sum().backward()
    for name, t, lt in zip("qkvs", full, local):
        placed = torch.zeros_like(t)
        placed[:, :, idx] = lt.grad
        dist.all_reduce(placed)
        _assert_rel(placed, t.grad, what=f"grad {name}")
    return out.detach(), [t.detach() for t in local], lvalid, idx


def _gather_before_repeat_is_exact(rank, world):
    """Gathering G kv heads and one shared key part, then expanding, gives bitwise the output of gathering the
    expanded tensors (what context parallel did before)."""
    out, (q, k, v, ks), valid, idx = _attention_case(rank, world, B=2, H=4, S=16, Kqk=12, Kv=8, scale=0.3, seed=3,
                                                      G=2, P=4, padded=True)
    k_full, v_full = expand_kv(4, k, v, ks)
    old = AllGatherKVAttention(dist.group.WORLD)(q, k_full, v_full, valid, 0.3, idx)
    assert torch.equal(out, old)


def _padded_ids(cfg, B, S, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :5] = 0  # leading padding: on both ranks' chunks of a 32-token sequence (cp=2: 8-token chunks)
    mask[1, S - 11:] = 0  # trailing padding
    return ids, mask, g


def _packed_positions(B, S):
    """Per-document positions of B rows: documents of a few lengths, crossing the cp chunk boundaries."""
    lengths = ([5, 11, 3, 13], [20, 7, 5])
    rows = [torch.cat([torch.arange(n) for n in lengths[b % 2]])[:S] for b in range(B)]
    return torch.stack(rows)


def _tiny_model_case(rank, world, padded=False, packed=False, **overrides):
    cfg = ModelConfig.from_preset("tiny", **overrides)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():  # identical weights on every rank, whatever the seeding does
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=0)

    B, S = 2, 32
    ids, mask, g = _padded_ids(cfg, B, S, seed=1)
    if not padded:
        mask = None
    labels = torch.roll(ids, -1, dims=1)  # any full-sequence labels (the loss here does not use them)
    go = torch.randn(B, S, cfg.vocab_size, generator=g)
    docs = _packed_positions(B, S) if packed else None

    ref_model = copy.deepcopy(model)
    ref = ref_model(ids, mask, torch.arange(S), position_ids_BS=docs)
    (ref * go).sum().backward()

    n_attn = 0
    for block in model.layers.values():
        block.attention.core_attention = AllGatherKVAttention(dist.group.WORLD)
        n_attn += 1
    assert n_attn == cfg.num_layers
    model.build_document_mask = block.attention.core_attention.document_mask  # as apply_cp does
    batch = {"input_ids": ids, "labels": labels, **({"attention_mask": mask} if padded else {}),
             **({"position_ids": docs} if packed else {})}
    local = shard_batch_for_cp(batch, world, rank)
    pos = local["global_positions"]
    out = model(local["input_ids"], local.get("attention_mask"), pos, position_ids_BS=local.get("position_ids"))
    _assert_rel(out, ref.detach()[:, pos], what="logits")
    assert torch.equal(local["labels"], labels[:, pos])
    (out * go[:, pos]).sum().backward()
    ref_grads = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank's tokens contribute their part of the gradient
        _assert_rel(grad, ref_grads[name].grad, rtol=1e-4, what=f"grad {name}")


MLA = dict(attention="mla", qk_norm="none", q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16)


def _cp_suite(rank, world):
    torch.manual_seed(1234)
    # GQA-shaped (heads already repeated), default scale
    _attention_case(rank, world, B=2, H=3, S=16, Kqk=8, Kv=8, scale=None, seed=0)
    # MLA-shaped: q/k head dim != v head dim, explicit scale
    _attention_case(rank, world, B=1, H=2, S=16, Kqk=24, Kv=16, scale=0.3, seed=1)
    # any split works, not just the load-balanced one: rank r holds cp=4 shards r and r + 2 (4 chunks each)
    idx4 = torch.cat([cp_shard_indices(32, 4, rank), cp_shard_indices(32, 4, rank + 2)])
    _attention_case(rank, world, B=1, H=2, S=32, Kqk=8, Kv=8, scale=None, seed=2, idx=idx4)
    # GQA kv heads and MLA's shared key part gathered compact, with key padding on every rank
    _attention_case(rank, world, B=2, H=4, S=16, Kqk=8, Kv=8, scale=None, seed=4, G=2, padded=True)
    _attention_case(rank, world, B=2, H=2, S=16, Kqk=24, Kv=16, scale=0.3, seed=5, P=8, padded=True)
    _gather_before_repeat_is_exact(rank, world)
    # one rank without padding in its tokens passes no mask while the other masks: same collectives, right result
    lead = torch.arange(16)[None] >= 3
    _attention_case(rank, world, B=1, H=2, S=16, Kqk=8, Kv=8, scale=None, seed=6, idx=torch.arange(8) + 8 * rank,
                    valid=lead)
    _tiny_model_case(rank, world)
    _tiny_model_case(rank, world, padded=True)
    _tiny_model_case(rank, world, padded=True, **MLA)
    # packed documents (position_ids restarting per document) under cp: the same logits and gradients
    _tiny_model_case(rank, world, packed=True)
    _tiny_model_case(rank, world, padded=True, packed=True, **MLA)
    return True


def test_cp2_attention_and_tiny_model():
    # one launch for all multi-rank cases (starting ranks dominates the run time)
    assert run_distributed(_cp_suite, 2)
