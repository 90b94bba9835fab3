"""Router losses and the bias rule against formulas written out from their definitions (loops, small tensors)."""

import math

import pytest
import torch

from lightning_moe.moe.losses import (
    aux_loss_scores,
    expert_bias_update,
    expert_counts,
    global_aux_loss,
    sequence_aux_loss,
    switch_aux_loss,
    topk_indices,
    z_loss,
)


def _loop_topk(row, k):
    """Indices of the k largest values, ties to the lower index (the documented tie-break)."""
    order = sorted(range(len(row)), key=lambda i: (-float(row[i]), i))
    return order[:k]


def _loop_switch(scores, k, valid=None):
    """coeff-free Switch loss E * sum_i f_i P_i over valid tokens, by loops."""
    T, E = scores.shape
    toks = [t for t in range(T) if valid is None or bool(valid[t])]
    N = len(toks)
    if N == 0:
        return 0.0
    c = [0] * E
    for t in toks:
        for i in _loop_topk(scores[t], k):
            c[i] += 1
    f = [c[i] / (k * N) for i in range(E)]
    P = [sum(float(scores[t, i]) for t in toks) / N for i in range(E)]
    return E * sum(f[i] * P[i] for i in range(E))


def test_topk_indices_tie_break_lower_index():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 1.0, 5.0]])
    assert topk_indices(x, 2).tolist() == [[1, 2], [0, 1], [3, 1]]
    assert topk_indices(x, 3).tolist() == [[1, 2, 0], [0, 1, 2], [3, 1, 2]]


def test_expert_counts_masks_and_zero_experts():
    ids = torch.tensor([[0, 2], [2, 0], [2, 3]])
    assert expert_counts(ids, 5).tolist() == [2, 0, 3, 1, 0]
    assert expert_counts(ids, 5, torch.tensor([True, False, True])).tolist() == [1, 0, 2, 1, 0]
    keep = torch.tensor([[True, False], [True, True], [False, True]])
    assert expert_counts(ids, 5, keep).tolist() == [2, 0, 1, 1, 0]
    # leading batch dim: [B, S, k] -> [B, E]
    assert expert_counts(ids.reshape(1, 3, 2).expand(2, 3, 2), 5).tolist() == [[2, 0, 3, 1, 0]] * 2


def test_aux_loss_scores():
    logits = torch.tensor([[0.0, 1.0, -2.0], [3.0, 3.0, 3.0]])
    s = torch.sigmoid(logits)
    torch.testing.assert_close(aux_loss_scores(logits, "sigmoid"), s / s.sum(-1, keepdim=True))
    e = logits.exp()
    torch.testing.assert_close(aux_loss_scores(logits, "softmax"), e / e.sum(-1, keepdim=True))
    with pytest.raises(ValueError):
        aux_loss_scores(logits, "relu")


def test_switch_aux_loss_hand_computed():
    # 2 tokens, 2 experts, k=1: token 0 -> expert 0 (0.7), token 1 -> expert 0 (0.6)
    scores = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    counts = torch.tensor([2, 0])
    # f = [1, 0], P = [0.65, 0.35]: loss = coeff * 2 * 0.65
    out = switch_aux_loss(scores, counts, 2, 1, coeff=0.1)
    torch.testing.assert_close(out, torch.tensor(0.1 * 2 * 0.65))
    assert out.dtype == torch.float32


@pytest.mark.parametrize("k", [1, 2, 4])
def test_switch_aux_loss_vs_loop(k):
    g = torch.Generator().manual_seed(0)
    T, E = 9, 6
    scores = torch.softmax(torch.randn(T, E, generator=g), -1)
    valid = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    counts = expert_counts(topk_indices(scores, k), E, valid)
    n = int(valid.sum())
    got = switch_aux_loss(scores, counts, n, k, coeff=0.3, valid_T=valid)
    assert got.item() == pytest.approx(0.3 * _loop_switch(scores, k, valid), rel=1e-5)
    # padding rows carry no weight: scrambling them changes nothing
    scrambled = scores.clone()
    scrambled[~valid] = 100.0
    assert switch_aux_loss(scrambled, counts, n, k, 0.3, valid).item() == pytest.approx(got.item(), rel=1e-6)
    # the global loss is the same formula on one process
    assert global_aux_loss(scores, counts, n, k, 0.3, valid).item() == pytest.approx(got.item(), rel=1e-6)


def test_switch_aux_loss_balanced_minimum():
    # perfectly balanced counts and uniform scores give loss = coeff (its minimum)
    T, E, k = 8, 4, 2
    scores = torch.full((T, E), 1.0 / E)
    counts = torch.full((E,), T * k // E)
    assert switch_aux_loss(scores, counts, T, k, 0.01).item() == pytest.approx(0.01)
    assert switch_aux_loss(scores, counts, T, k, 0.0).item() == 0.0


def _loop_seq(scores, k, seq_len, valid=None):
    T, E = scores.shape
    losses = []
    for b in range(T // seq_len):
        rows = list(range(b * seq_len, (b + 1) * seq_len))
        v = None if valid is None else valid[rows]
        if v is not None and not bool(v.any()):
            continue  # sequence without valid tokens is skipped
        losses.append(_loop_switch(scores[rows], k, v))
    return sum(losses) / len(losses) if losses else 0.0


def test_sequence_aux_loss_vs_loop():
    g = torch.Generator().manual_seed(1)
    B, S, E, k = 4, 5, 6, 2
    scores = torch.softmax(torch.randn(B * S, E, generator=g), -1)
    valid = torch.ones(B * S, dtype=torch.bool)
    valid[3:5] = False  # tail padding of sequence 0
    valid[10:15] = False  # sequence 2 is all padding: skipped in the mean
    ids = topk_indices(scores, k)
    counts_BE = expert_counts(ids.reshape(B, S, k), E, valid.reshape(B, S))
    n_B = valid.reshape(B, S).sum(-1)
    got = sequence_aux_loss(scores, counts_BE, n_B, k, 0.2, S, valid)
    assert got.item() == pytest.approx(0.2 * _loop_seq(scores, k, S, valid), rel=1e-5)
    # it is not the micro-batch loss
    micro = _loop_switch(scores, k, valid)
    assert abs(got.item() - 0.2 * micro) > 1e-4
    with pytest.raises(ValueError):
        sequence_aux_loss(scores, counts_BE, n_B, k, 0.2, 7, valid)
    # no valid token at all: zero, not NaN
    none = torch.zeros(B * S, dtype=torch.bool)
    zero_BE, zero_B = torch.zeros(B, E, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    z = sequence_aux_loss(scores, zero_BE, zero_B, k, 0.2, S, none)
    assert z.item() == 0.0


def test_z_loss_vs_loop():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0], [3.0, -1.0, 2.0], [9.0, 9.0, 9.0]])
    valid = torch.tensor([True, True, True, False])
    ref = sum(math.log(sum(math.exp(float(v)) for v in logits[t])) ** 2 for t in range(3)) / 3
    assert z_loss(logits, 0.5, valid).item() == pytest.approx(0.5 * ref, rel=1e-6)
    ref_all = sum(math.log(sum(math.exp(float(v)) for v in logits[t])) ** 2 for t in range(4)) / 4
    assert z_loss(logits, 0.5).item() == pytest.approx(0.5 * ref_all, rel=1e-6)
    assert z_loss(logits, 0.0).item() == 0.0
    assert z_loss(logits, 1.0, torch.zeros(4, dtype=torch.bool)).item() == 0.0


def test_partial_losses_over_split_tokens_sum_to_full_loss():
    """Two 'ranks' split each sequence (cp-style); with counts and N summed over both, partials add up."""
    g = torch.Generator().manual_seed(2)
    B, S, E, k = 3, 6, 8, 2
    logits = torch.randn(B * S, E, generator=g)
    valid = torch.ones(B * S, dtype=torch.bool)
    valid[[4, 5, 11]] = False
    scores = aux_loss_scores(logits, "sigmoid")
    ids = topk_indices(scores, k)

    full_counts = expert_counts(ids, E, valid)
    n = int(valid.sum())
    full = switch_aux_loss(scores, full_counts, n, k, 0.1, valid)
    full_z = z_loss(logits, 0.1, valid)
    full_counts_BE = expert_counts(ids.reshape(B, S, k), E, valid.reshape(B, S))
    full_seq = sequence_aux_loss(scores, full_counts_BE, valid.reshape(B, S).sum(-1), k, 0.1, S, valid)

    # rank r holds tokens [r*S/2, (r+1)*S/2) of every sequence
    half = S // 2
    parts = []
    for r in range(2):
        rows = torch.cat([torch.arange(b * S + r * half, b * S + (r + 1) * half) for b in range(B)])
        parts.append(rows)
    loc_counts_BE = [expert_counts(ids[p].reshape(B, half, k), E, valid[p].reshape(B, half)) for p in parts]
    counts_BE = loc_counts_BE[0] + loc_counts_BE[1]
    counts_E = counts_BE.sum(0)
    n_B = counts_BE.sum(-1) // k
    assert torch.equal(counts_E, full_counts)
    aux_sum = sum(switch_aux_loss(scores[p], counts_E, n, k, 0.1, valid[p]) for p in parts)
    z_sum = sum(z_loss(logits[p], 0.1, valid[p], n) for p in parts)
    seq_sum = sum(sequence_aux_loss(scores[p], counts_BE, n_B, k, 0.1, half, valid[p]) for p in parts)
    torch.testing.assert_close(aux_sum, full)
    torch.testing.assert_close(z_sum, full_z)
    torch.testing.assert_close(seq_sum, full_seq)
    # with local normalisers instead, the partials would not add up (the reduction matters)
    wrong = sum(switch_aux_loss(scores[p], counts_E, int(valid[p].sum()), k, 0.1, valid[p]) for p in parts)
    assert abs(wrong.item() - full.item()) > 1e-3


def test_loss_gradients_flow_through_scores_only():
    logits = torch.randn(6, 4, requires_grad=True)
    scores = aux_loss_scores(logits, "softmax")
    counts = expert_counts(topk_indices(scores.detach(), 2), 4)
    (switch_aux_loss(scores, counts, 6, 2, 1.0) + z_loss(logits, 1.0)).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    # autograd of the loop formula with the counts held fixed
    l2 = logits.detach().clone().requires_grad_(True)
    s2 = torch.softmax(l2, -1)
    ref = 4 * sum((counts[i].item() / (2 * 6)) * s2[:, i].mean() for i in range(4))
    ref = ref + (torch.logsumexp(l2, -1) ** 2).mean()
    ref.backward()
    torch.testing.assert_close(logits.grad, l2.grad)


def test_expert_bias_update_rule():
    bias = torch.tensor([0.5, 0.0, -0.25, 0.0])
    counts = torch.tensor([3, 1, 2, 2])  # mean 2: over, under, equal, equal
    out = expert_bias_update(bias, counts, 0.01)
    assert out.dtype == torch.float32
    expected = torch.tensor([0.5 - 0.01, 0.0 + 0.01, -0.25, 0.0], dtype=torch.float32)
    assert torch.equal(out, expected)
    assert torch.equal(bias, torch.tensor([0.5, 0.0, -0.25, 0.0]))  # input untouched
    # float counts give the same bits; a bf16 bias comes back fp32
    assert torch.equal(expert_bias_update(bias, counts.float(), 0.01), expected)
    assert expert_bias_update(bias.bfloat16(), counts, 0.01).dtype == torch.float32
    # mean not an integer (7/3): exact comparison, no rounding flips the sign
    out3 = expert_bias_update(torch.zeros(3), torch.tensor([2, 2, 3]), 1.0)
    assert out3.tolist() == [1.0, 1.0, -1.0]
    # no tokens: no change
    assert torch.equal(expert_bias_update(bias, torch.zeros(4, dtype=torch.long), 0.01), bias)
