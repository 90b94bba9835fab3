"""TopKRouter against routing rules written out per token (loops over small explicit tensors).

One piece (about 600 lines): every routing rule is checked against the per-token reference written out at its top;
split, that reference would be copied."""

import math

import pytest
import torch
import torch.utils.checkpoint

from lightning_moe.config import MoEConfig
from lightning_moe.moe.router import RoutingResult, TopKRouter


def make(**kw):
    kw.setdefault("num_experts", 4)
    kw.setdefault("top_k", 2)
    kw.setdefault("aux_loss_type", "none")
    return TopKRouter(MoEConfig(**kw), hidden_size=8)


def sig(v):
    return 1.0 / (1.0 + math.exp(-v))


def softmax_row(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    return [x / sum(e) for x in e]


def loop_topk(row, k):
    """k largest, ties to the lower index."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]


def ref_route(logits, cfg, bias=None):
    """Per-token reference: (ids, probs) lists from the definitions (no capacity, no padding)."""
    E, k = cfg.num_experts, cfg.top_k
    ids, probs = [], []
    for row in logits.tolist():
        if cfg.score_func == "softmax":
            scores = softmax_row(row)
            choice = scores if cfg.pre_softmax else row
        else:
            scores = [sig(v) for v in row]
            choice = list(scores)
        if bias is not None:
            choice = [c + b for c, b in zip(choice, bias)]
        if cfg.num_groups:
            size = E // cfg.num_groups
            gscore = []
            for g in range(cfg.num_groups):
                member = sorted(choice[g * size:(g + 1) * size], reverse=True)
                gscore.append(sum(member[: k // cfg.group_topk]))
            groups = loop_topk(gscore, cfg.group_topk)
            masked = [c if i // size in groups else -math.inf for i, c in enumerate(choice)]
            chosen = loop_topk(masked, k)
        else:
            chosen = loop_topk(choice, k)
        if cfg.score_func == "softmax" and not cfg.pre_softmax:
            p = softmax_row([row[i] for i in chosen])
        else:
            p = [scores[i] for i in chosen]
            if cfg.norm_topk_prob and k > 1:
                p = [x / sum(p) for x in p]
        if cfg.scaling_factor is not None:
            p = [x * cfg.scaling_factor for x in p]
        ids.append(chosen)
        probs.append(p)
    return ids, probs


def check_against_ref(router, logits, bias=None):
    out = router.route(logits)
    ids, probs = ref_route(logits, router.config, bias)
    assert out.expert_ids.tolist() == ids
    torch.testing.assert_close(out.probs, torch.tensor(probs), rtol=1e-5, atol=1e-7)
    return out


LOGITS = torch.tensor(
    [[1.0, 2.0, 3.0, 0.0], [0.5, -1.0, 0.2, 2.0], [-0.3, 0.8, 0.1, 0.7], [2.0, 1.5, -2.0, 1.0]]
)


# ---- scores and combine weights -----------------------------------------------------------------------


def test_softmax_pre_softmax_normalised_qwen3_hand_values():
    r = make(score_func="softmax", pre_softmax=True, norm_topk_prob=True)
    out = check_against_ref(r, LOGITS)
    # token 0: experts 2 (logit 3) and 1 (logit 2); normalised softmax = [e^3, e^2] / (e^3 + e^2)
    assert out.expert_ids[0].tolist() == [2, 1]
    assert out.probs[0, 0].item() == pytest.approx(math.exp(3) / (math.exp(3) + math.exp(2)), rel=1e-6)
    assert out.probs.dtype == torch.float32 and out.expert_ids.dtype == torch.int64


def test_softmax_pre_softmax_unnormalised():
    r = make(score_func="softmax", pre_softmax=True, norm_topk_prob=False)
    out = check_against_ref(r, LOGITS)
    z = sum(math.exp(v) for v in [1.0, 2.0, 3.0, 0.0])
    assert out.probs[0].tolist() == pytest.approx([math.exp(3) / z, math.exp(2) / z], rel=1e-6)
    assert out.probs.sum(-1).max() < 1.0


def test_softmax_post_topk_mixtral():
    r = make(score_func="softmax", pre_softmax=False, norm_topk_prob=True)
    out = check_against_ref(r, LOGITS)
    # softmax over the two chosen logits only (equals the normalised pre-softmax weights)
    assert out.probs[1].tolist() == pytest.approx(softmax_row([2.0, 0.5]), rel=1e-6)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(4))


def test_sigmoid_norm_and_scaling_deepseek_v3():
    r = make(score_func="sigmoid", norm_topk_prob=True, scaling_factor=2.5)
    out = check_against_ref(r, LOGITS)
    s2, s1 = sig(3.0), sig(2.0)
    assert out.probs[0].tolist() == pytest.approx([2.5 * s2 / (s2 + s1), 2.5 * s1 / (s2 + s1)], rel=1e-6)
    torch.testing.assert_close(out.probs.sum(-1), torch.full((4,), 2.5))
    # monitoring scores: sigmoid normalised over all experts, unbiased
    s = torch.sigmoid(LOGITS)
    torch.testing.assert_close(out.scores, s / s.sum(-1, keepdim=True))


def test_sigmoid_without_norm_keeps_raw_scores():
    r = make(score_func="sigmoid", norm_topk_prob=False, scaling_factor=2.0)
    out = check_against_ref(r, LOGITS)
    assert out.probs[0].tolist() == pytest.approx([2 * sig(3.0), 2 * sig(2.0)], rel=1e-6)


# ---- choice ---------------------------------------------------------------------------------------------


def test_group_limited_routing_changes_choice():
    # 4 groups of 2; keep 2 groups scored by the sum of their top-2 (k / group_topk) scores
    logits = torch.tensor([[5.0, -5.0, 3.0, 3.0, 2.9, 2.9, -1.0, -1.0]])
    plain = make(num_experts=8, top_k=4, score_func="sigmoid")
    grouped = make(num_experts=8, top_k=4, score_func="sigmoid", num_groups=4, group_topk=2)
    assert sorted(plain.route(logits).expert_ids[0].tolist()) == [0, 2, 3, 4]  # expert 0 has the top score
    out = check_against_ref(grouped, logits)
    # group 0 scores sig(5)+sig(-5) = 1.0 < groups 1 and 2: expert 0 is excluded
    assert sorted(out.expert_ids[0].tolist()) == [2, 3, 4, 5]
    # more tokens, softmax, against the loop reference
    g = torch.Generator().manual_seed(3)
    many = torch.randn(16, 8, generator=g)
    check_against_ref(make(num_experts=8, top_k=2, num_groups=4, group_topk=2), many)
    check_against_ref(make(num_experts=8, top_k=2, num_groups=2, group_topk=1, pre_softmax=False), many)


def test_expert_bias_changes_choice_not_probs():
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3], [0.3, 0.2, 0.1, 0.0]])
    r = make(score_func="sigmoid", expert_bias=True, norm_topk_prob=True)
    before = check_against_ref(r, logits)
    assert before.expert_ids.tolist() == [[3, 2], [0, 1]]
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    out = check_against_ref(r, logits, bias=[1.0, 0.0, 0.0, 0.0])
    assert out.expert_ids.tolist() == [[0, 3], [0, 1]]
    # probs are the unbiased sigmoid scores of the chosen experts, normalised
    s0, s3 = sig(0.0), sig(0.3)
    assert out.probs[0].tolist() == pytest.approx([s0 / (s0 + s3), s3 / (s0 + s3)], rel=1e-6)
    torch.testing.assert_close(out.probs[1], before.probs[1])
    torch.testing.assert_close(out.scores, before.scores)  # monitoring scores carry no bias


def test_ties_break_to_lower_expert_index():
    logits = torch.zeros(3, 4)
    for kw in ({}, {"score_func": "sigmoid"}, {"pre_softmax": False}, {"num_groups": 2, "group_topk": 1}):
        out = make(**kw).route(logits)
        assert out.expert_ids.tolist() == [[0, 1]] * 3, kw
        torch.testing.assert_close(out.probs, torch.full((3, 2), 0.5))
    # partial tie: experts 1 and 3 tie for the top, 0 and 2 for the second place
    out = make(top_k=3).route(torch.tensor([[1.0, 2.0, 1.0, 2.0]]))
    assert out.expert_ids.tolist() == [[1, 3, 0]]


def test_k_equals_e():
    r = make(num_experts=4, top_k=4, aux_loss_type="aux", aux_loss_coeff=0.1)
    out = check_against_ref(r, LOGITS)
    assert sorted(out.expert_ids[0].tolist()) == [0, 1, 2, 3]
    assert out.tokens_per_expert.tolist() == [4, 4, 4, 4]
    # every f_i = 1/E, so the switch loss is coeff * sum_i P_i = coeff
    assert out.aux_loss.item() == pytest.approx(0.1, rel=1e-6)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_one_expert(score_func):
    r = TopKRouter(MoEConfig(num_experts=1, top_k=1, score_func=score_func, aux_loss_coeff=0.1, z_loss_coeff=0.1), 8)
    x = torch.randn(5, 8)
    out = r(x)
    assert out.expert_ids.tolist() == [[0]] * 5
    assert out.tokens_per_expert.tolist() == [5]
    if score_func == "softmax":
        torch.testing.assert_close(out.probs, torch.ones(5, 1))
    else:  # k = 1: no renormalisation (it would make every weight 1)
        torch.testing.assert_close(out.probs, torch.sigmoid(x @ r.weight.t()))
    assert out.aux_loss.item() == pytest.approx(0.1)
    logits = x @ r.weight.t()
    assert out.z_loss.item() == pytest.approx(0.1 * (logits[:, 0] ** 2).mean().item(), rel=1e-5)


def test_force_balance_round_robin():
    r = make(num_experts=4, top_k=3, force_balance=True, score_func="sigmoid", norm_topk_prob=True)
    out = r.route(LOGITS)
    assert out.expert_ids.tolist() == [[(t * 3 + j) % 4 for j in range(3)] for t in range(4)]
    assert out.tokens_per_expert.tolist() == [3, 3, 3, 3]
    s = torch.sigmoid(LOGITS).gather(1, out.expert_ids)
    torch.testing.assert_close(out.probs, s / s.sum(-1, keepdim=True))


def test_zero_token_experts_and_tokens_per_expert():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0]] * 3 + [[0.0, 4.0, 5.0, 0.0, 0.0]])
    out = make(num_experts=5, top_k=2, aux_loss_type="aux", aux_loss_coeff=1.0).route(logits)
    assert out.tokens_per_expert.tolist() == [3, 4, 1, 0, 0]
    assert out.tokens_per_expert.dtype == torch.int64
    assert out.keep_mask is None and out.capacity is None and out.num_dropped is None
    # switch loss by the definition: f = c / (k T), P = mean score
    s = torch.softmax(logits, -1)
    f = torch.tensor([3, 4, 1, 0, 0]) / (2 * 4)
    assert out.aux_loss.item() == pytest.approx((5 * (f * s.mean(0)).sum()).item(), rel=1e-6)


# ---- padding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aux_type", ["aux", "seq", "global"])
def test_padding_excluded_from_counts_aux_and_z(aux_type):
    g = torch.Generator().manual_seed(4)
    B, S, E = 2, 5, 6
    logits = torch.randn(B * S, E, generator=g)
    mask = torch.tensor([1, 1, 1, 0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    kw = dict(num_experts=E, top_k=2, aux_loss_type=aux_type, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    r = make(**kw)
    out = r.route(logits, mask, seq_len=S)
    # same as routing only the valid tokens (for "seq", sequence by sequence)
    if aux_type == "seq":
        parts = [r.route(logits[0:3]), r.route(logits[5:9])]
        aux_ref = (parts[0].aux_loss + parts[1].aux_loss) / 2
        n0, n1 = 3, 4
        z_ref = (parts[0].z_loss * n0 + parts[1].z_loss * n1) / (n0 + n1)
        tpe_ref = parts[0].tokens_per_expert + parts[1].tokens_per_expert
    else:
        ref = r.route(logits[mask])
        aux_ref, z_ref, tpe_ref = ref.aux_loss, ref.z_loss, ref.tokens_per_expert
    torch.testing.assert_close(out.aux_loss, aux_ref)
    torch.testing.assert_close(out.z_loss, z_ref)
    assert torch.equal(out.tokens_per_expert, tpe_ref)
    assert out.tokens_per_expert.sum().item() == 2 * int(mask.sum())
    assert out.keep_mask.tolist() == [[bool(m)] * 2 for m in mask]
    assert (out.probs[~mask] == 0).all() and (out.probs[mask] > 0).all()
    # padding contents do not matter
    scrambled = logits.clone()
    scrambled[~mask] = 50.0
    out2 = r.route(scrambled, mask, seq_len=S)
    torch.testing.assert_close(out2.aux_loss, out.aux_loss)
    torch.testing.assert_close(out2.z_loss, out.z_loss)


# ---- capacity -----------------------------------------------------------------------------------------


CAP_LOGITS = torch.tensor(
    [  # k=1, E=2: tokens 0..4 prefer expert 0 with these margins, token 5 prefers expert 1
        [1.0, 0.0],
        [3.0, 0.0],
        [2.0, 0.0],
        [3.0, 0.0],
        [0.5, 0.0],
        [0.0, 1.0],
    ]
)


@pytest.mark.parametrize(
    "policy,kept0",
    [("probs", [1, 3]), ("position", [0, 1])],  # probs: the two 3.0s (tie -> both); position: earliest two
)
def test_capacity_dropping_exact_kept_set(policy, kept0):
    r = make(num_experts=2, top_k=1, capacity_factor=0.5, drop_policy=policy, norm_topk_prob=False)
    out = r.route(CAP_LOGITS)
    assert out.capacity == math.ceil(0.5 * 6 * 1 / 2) == 2
    kept = [t for t in range(6) if out.keep_mask[t, 0]]
    assert kept == kept0 + [5]
    assert out.tokens_per_expert.tolist() == [2, 1]
    assert out.num_dropped.item() == 3
    full = torch.softmax(CAP_LOGITS, -1).gather(1, out.expert_ids)
    torch.testing.assert_close(out.probs, torch.where(out.keep_mask, full, torch.zeros_like(full)))


def test_capacity_probs_ties_go_to_earlier_token():
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    r = make(num_experts=2, top_k=1, capacity_factor=0.8, drop_policy="probs")  # C = ceil(0.8*5/2) = 2
    out = r.route(logits)
    assert out.capacity == 2
    assert out.keep_mask[:, 0].tolist() == [True, False, True, False, True]


def loop_capacity(ids, probs, valid, E, C, policy):
    """Reference: per expert, list its valid assignments in policy order and keep the first C."""
    T, k = len(ids), len(ids[0])
    keep = [[False] * k for _ in range(T)]
    for e in range(E):
        cand = [(t, j) for t in range(T) for j in range(k) if ids[t][j] == e and valid[t]]
        if policy == "probs":
            cand.sort(key=lambda tj: (-probs[tj[0]][tj[1]], tj[0], tj[1]))
        for t, j in cand[:C]:
            keep[t][j] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_k2_with_padding_vs_loop(policy):
    g = torch.Generator().manual_seed(5)
    T, E, k = 12, 4, 2
    logits = torch.randn(T, E, generator=g)
    logits[:, 0] += 2.0  # overload expert 0
    valid = torch.ones(T, dtype=torch.bool)
    valid[[2, 7]] = False
    r = make(num_experts=E, top_k=k, capacity_factor=1.0, drop_policy=policy)
    out = r.route(logits, valid)
    C = math.ceil(1.0 * T * k / E)
    assert out.capacity == C
    nodrop = make(num_experts=E, top_k=k).route(logits)
    ref = loop_capacity(nodrop.expert_ids.tolist(), nodrop.probs.tolist(), valid.tolist(), E, C, policy)
    assert out.keep_mask.tolist() == ref
    assert (out.tokens_per_expert <= C).all()
    ids = nodrop.expert_ids.tolist()
    kept_per_expert = [sum(ref[t][j] and ids[t][j] == e for t in range(T) for j in range(k)) for e in range(E)]
    assert out.tokens_per_expert.tolist() == kept_per_expert
    n_valid_assign = 2 * int(valid.sum())
    assert out.num_dropped.item() == n_valid_assign - sum(map(sum, ref)) > 0
    assert not out.keep_mask[~valid].any()


# ---- aux losses vs loops --------------------------------------------------------------------------------


def loop_switch(scores, k, valid):
    T, E = len(scores), len(scores[0])
    toks = [t for t in range(T) if valid[t]]
    if not toks:
        return 0.0
    c = [0] * E
    for t in toks:
        for i in loop_topk(scores[t], k):
            c[i] += 1
    N = len(toks)
    return E * sum((c[i] / (k * N)) * (sum(scores[t][i] for t in toks) / N) for i in range(E))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("aux_type", ["aux", "seq", "global", "none"])
def test_aux_loss_types_vs_loop(score_func, aux_type):
    g = torch.Generator().manual_seed(6)
    B, S, E, k = 3, 4, 6, 2
    logits = torch.randn(B * S, E, generator=g)
    valid = [True] * (B * S)
    valid[5] = valid[11] = False
    kw = dict(num_experts=E, top_k=k, score_func=score_func, aux_loss_type=aux_type, aux_loss_coeff=0.25)
    if score_func == "sigmoid":
        kw.update(expert_bias=True, num_groups=2, group_topk=1)  # neither may affect the aux loss
    r = make(**kw)
    if r.expert_bias is not None:
        with torch.no_grad():
            r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 5.0]))
    out = r.route(logits, torch.tensor(valid), seq_len=S)
    if score_func == "softmax":
        scores = [softmax_row(row) for row in logits.tolist()]
    else:
        scores = [[sig(v) for v in row] for row in logits.tolist()]
        scores = [[v / sum(row) for v in row] for row in scores]
    if aux_type == "none":
        expected = 0.0
    elif aux_type == "seq":
        per = [loop_switch(scores[b * S:(b + 1) * S], k, valid[b * S:(b + 1) * S]) for b in range(B)]
        expected = sum(per) / B
    else:
        expected = loop_switch(scores, k, valid)
    assert out.aux_loss.item() == pytest.approx(0.25 * expected, rel=1e-5)
    assert out.aux_loss.dim() == 0 and out.aux_loss.dtype == torch.float32
    torch.testing.assert_close(out.scores, torch.tensor(scores))


def test_aux_coeff_zero_and_z_loss_vs_loop():
    r = make(aux_loss_type="aux", aux_loss_coeff=0.0, z_loss_coeff=0.3)
    valid = torch.tensor([True, False, True, True])
    out = r.route(LOGITS, valid)
    assert out.aux_loss.item() == 0.0
    rows = [LOGITS[t].tolist() for t in (0, 2, 3)]
    ref = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in rows) / 3
    assert out.z_loss.item() == pytest.approx(0.3 * ref, rel=1e-6)
    assert make().route(LOGITS).z_loss.item() == 0.0


# ---- gradients, forward, precision, construction ---------------------------------------------------------


def test_gradients_reach_router_weight():
    torch.manual_seed(0)
    x = torch.randn(10, 8)
    w_probe = torch.randn(10, 2)
    for name in ("aux", "z", "probs"):
        r = make(aux_loss_type="aux", aux_loss_coeff=0.1, z_loss_coeff=0.1)
        out = r(x)
        loss = {"aux": out.aux_loss, "z": out.z_loss, "probs": (out.probs * w_probe).sum()}[name]
        loss.backward()
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0, name
    # aux-loss gradient equals autograd of the loop formula with counts held fixed
    r = make(aux_loss_type="aux", aux_loss_coeff=0.1)
    r(x).aux_loss.backward()
    w = r.weight.detach().clone().requires_grad_(True)
    s = torch.softmax(x @ w.t(), -1)
    c = torch.zeros(4)
    for row in s.detach().tolist():
        for i in loop_topk(row, 2):
            c[i] += 1
    (0.1 * 4 * ((c / (2 * 10)) * s.mean(0)).sum()).backward()
    torch.testing.assert_close(r.weight.grad, w.grad)


def test_forward_fp32_gate_under_autocast_and_3d_input():
    r = make(aux_loss_type="aux", z_loss_coeff=0.1)
    x = torch.randn(2, 3, 8).bfloat16().float()
    ref = r.route(x.reshape(6, 8) @ r.weight.t())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 gate GEMM would be off by ~1e-2
        out = r(x)
    assert out.probs.dtype == torch.float32
    torch.testing.assert_close(out.probs, ref.probs)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss)
    # bf16 input: the gate still runs in fp32 on the upcast input
    xb = x.bfloat16()
    out_b = r(xb)
    torch.testing.assert_close(out_b.probs, r.route(xb.float().reshape(6, 8) @ r.weight.t()).probs)
    with pytest.raises(ValueError):
        r(x.reshape(6, 8), seq_len=4)


def test_meta_device_construction_and_reset():
    cfg = MoEConfig(num_experts=16, top_k=2, score_func="sigmoid", expert_bias=True)
    with torch.device("meta"):
        r = TopKRouter(cfg, hidden_size=64)
    assert r.weight.is_meta and r.expert_bias.is_meta
    r.to_empty(device="cpu")
    r.reset_parameters()
    assert r.weight.dtype == torch.float32 and r.weight.shape == (16, 64)
    assert 0.015 < r.weight.std().item() < 0.025
    assert torch.equal(r.expert_bias, torch.zeros(16)) and r.expert_bias.dtype == torch.float32
    assert set(r.state_dict()) == {"weight", "expert_bias"}
    assert set(dict(r.named_buffers())) == {"expert_bias"}  # no count kept: forwards return their demand
    assert r.token_group is None and r.global_group is None
    assert set(make().state_dict()) == {"weight"}


# ---- expert-bias update ---------------------------------------------------------------------------------


def test_bias_update_over_two_micro_batches():
    rate = 0.01
    r = make(num_experts=4, top_k=2, score_func="sigmoid", expert_bias=True, bias_update_rate=rate)
    r.train()
    g = torch.Generator().manual_seed(7)
    x1, x2 = torch.randn(6, 8, generator=g), torch.randn(5, 8, generator=g)
    m1 = torch.tensor([True, True, True, True, False, True])
    o1 = r(x1, m1)
    o2 = r(x2)
    expected = torch.zeros(4, dtype=torch.long)
    for out, mask in ((o1, m1), (o2, torch.ones(5, dtype=torch.bool))):
        for t, ids in enumerate(out.expert_ids.tolist()):
            if mask[t]:
                for i in ids:
                    expected[i] += 1
    demand = o1.bias_demand + o2.bias_demand
    assert demand.dtype == torch.long and torch.equal(demand, expected)  # both micro-batches, padding excluded
    assert torch.equal(r.expert_bias, torch.zeros(4))  # no update before the step
    r.update_expert_bias(demand)
    mean = expected.sum().item() / 4
    ref = [rate * ((mean > n) - (mean < n)) for n in expected.tolist()]
    assert torch.equal(r.expert_bias, torch.tensor(ref, dtype=torch.float32))  # fp32, bit-exact
    assert r.expert_bias.dtype == torch.float32
    # eval forwards report no demand; balanced counts change nothing
    r.eval()
    assert r(x1).bias_demand is None
    before = r.expert_bias.clone()
    r.update_expert_bias(torch.full((4,), 3, dtype=torch.long))
    assert torch.equal(r.expert_bias, before)
    r.train()
    assert make().train()(x1).bias_demand is None  # no expert bias: no demand
    make().update_expert_bias(expected)  # no-op without expert bias


def test_bias_demand_before_capacity():
    """The demand is the biased choice before capacity. (That a checkpoint's re-run counts nothing twice is the
    recorder's guard: tests/test_layer.py::test_checkpoint_recompute_records_once.)"""
    r = make(num_experts=2, top_k=1, score_func="sigmoid", expert_bias=True, capacity_factor=0.5)
    r.train()
    out = r.route(torch.tensor([[1.0, 0.0]] * 4))  # all 4 choose expert 0; C = 1
    assert out.tokens_per_expert.tolist() == [1, 0]
    assert out.bias_demand.tolist() == [4, 0]  # demand, not the capacity-clipped count
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([-2.0, 0.0]))  # the bias moves the choice, and the demand with it
    assert r.route(torch.tensor([[1.0, 0.0]] * 4)).bias_demand.tolist() == [0, 4]


def test_route_rejects_bad_shapes():
    r = make()
    with pytest.raises(ValueError):
        r.route(torch.zeros(3, 5))
    with pytest.raises(ValueError):
        r.route(torch.zeros(3, 4), torch.ones(2, dtype=torch.bool))
    assert isinstance(r.route(torch.zeros(3, 4)), RoutingResult)


# ---- reduction seam on 2 gloo ranks ---------------------------------------------------------------------


def _two_rank_seam(rank, world_size):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(8)
    B, S, E, k = 2, 6, 4, 2
    logits = torch.randn(B * S, E, generator=g)
    valid = torch.ones(B * S, dtype=torch.bool)
    valid[[4, 5, 9]] = False
    half = S // 2  # cp-style: rank r holds tokens [r*half, (r+1)*half) of every sequence
    rows = torch.cat([torch.arange(b * S + rank * half, b * S + (rank + 1) * half) for b in range(B)])
    out = {}
    for aux_type in ("aux", "seq", "global"):
        kw = dict(num_experts=E, top_k=k, score_func="sigmoid", aux_loss_type=aux_type, aux_loss_coeff=0.1,
                  z_loss_coeff=0.01, expert_bias=True, bias_update_rate=0.5)
        ref = make(**kw)
        r = make(**kw)
        r.token_group = r.global_group = dist.group.WORLD
        full = ref.route(logits, valid, seq_len=S)
        part = r.route(logits[rows], valid[rows], seq_len=half)
        aux = part.aux_loss.clone()
        z = part.z_loss.clone()
        dist.all_reduce(aux)
        dist.all_reduce(z)
        torch.testing.assert_close(aux, full.aux_loss)
        torch.testing.assert_close(z, full.z_loss)
        out[aux_type] = aux.item()
    # bias counts summed over ranks: every rank gets the bias of the full batch, bitwise
    r.train()
    ref.train()
    demand = r.route(logits[rows], valid[rows], seq_len=half).bias_demand.clone()
    dist.all_reduce(demand)  # as the step's finalisation does, in its one routing all-reduce
    r.update_expert_bias(demand)
    ref.update_expert_bias(ref.route(logits, valid, seq_len=S).bias_demand)
    assert torch.equal(r.expert_bias, ref.expert_bias) and ref.expert_bias.abs().sum() > 0
    gathered = [torch.zeros(E) for _ in range(world_size)]
    dist.all_gather(gathered, r.expert_bias)
    assert torch.equal(gathered[0], gathered[1])
    return out


def test_reduction_groups_two_ranks_match_one_process():
    from _dist import run_distributed

    out = run_distributed(_two_rank_seam, 2, timeout=120)
    assert set(out) == {"aux", "seq", "global"}


def _two_data_ranks_seam(rank, world_size):
    """Data-parallel split (as parallelize sets it for dp=2): each rank routes whole sequences of its own, with a
    different number of padding tokens; token_group is None, global_group every rank, num_data_shards 2."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(11)
    B, S, E, k = 4, 5, 4, 2
    logits = torch.randn(B * S, E, generator=g)
    valid = torch.ones(B * S, dtype=torch.bool)
    valid[[3, 4, 8, 9, 14]] = False  # rank 0 (sequences 0, 1): 6 real tokens; rank 1 (sequences 2, 3): 9
    rows = torch.arange(rank * B // 2 * S, (rank + 1) * B // 2 * S)
    out = {}
    for aux_type in ("none", "global", "aux"):
        kw = dict(num_experts=E, top_k=k, score_func="softmax", aux_loss_type=aux_type, aux_loss_coeff=0.1,
                  z_loss_coeff=0.05)
        full = make(**kw).route(logits, valid, seq_len=S)
        r = make(**kw)
        r.token_group, r.global_group, r.num_data_shards = None, dist.group.WORLD, world_size
        part = r.route(logits[rows], valid[rows], seq_len=S)
        z, aux = part.z_loss.clone(), part.aux_loss.clone()
        dist.all_reduce(z)
        dist.all_reduce(aux)
        # the z-loss partials sum to one process's z-loss on the whole batch, however the padding is spread
        torch.testing.assert_close(z, full.z_loss, rtol=1e-6, atol=0)
        if aux_type == "global":
            torch.testing.assert_close(aux, full.aux_loss, rtol=1e-6, atol=0)
        # what the per-rank normaliser (Megatron's mean over data ranks of per-rank means) would give instead
        alone = make(**kw)
        own = alone.route(logits[rows], valid[rows], seq_len=S).z_loss / world_size
        dist.all_reduce(own)
        out[aux_type] = (z.item(), full.z_loss.item(), own.item())
    return out


def test_z_loss_over_data_ranks_with_unequal_padding_matches_one_process():
    from _dist import run_distributed

    out = run_distributed(_two_data_ranks_seam, 2, timeout=120)
    for z, full, per_rank_mean in out.values():
        assert z == pytest.approx(full, rel=1e-6)
        assert abs(per_rank_mean - full) > 1e-3 * full  # the test would see the per-rank definition
