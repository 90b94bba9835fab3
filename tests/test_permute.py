"""permute / unpermute / sort_assignments against explicit loops."""

import pytest
import torch

from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.moe.permute import permute, sort_assignments, unpermute
from lightning_moe.moe.router import RoutingResult


def _routing(T, k, E, seed=0, drop_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    probs = torch.rand(T, k, generator=g)
    keep = None
    if drop_frac > 0:
        keep = torch.rand(T, k, generator=g) >= drop_frac
        probs = probs * keep
    return ids, probs, keep


def _loop_order(ids, keep, E):
    """(assignment flat index, expert) pairs grouped by expert, in token order within an expert."""
    T, k = ids.shape
    order = []
    for e in range(E):
        for t in range(T):
            for j in range(k):
                if ids[t, j] == e and (keep is None or keep[t, j]):
                    order.append(t * k + j)
    counts = [sum(1 for a in order if ids.reshape(-1)[a] == e) for e in range(E)]
    return order, counts


@pytest.mark.parametrize("drop_frac", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("T,k,E", [(10, 2, 4), (7, 3, 3), (5, 1, 8), (0, 2, 4)])
def test_sort_assignments(T, k, E, drop_frac):
    ids, _, keep = _routing(T, k, E, drop_frac=drop_frac)
    order, counts = sort_assignments(ids, keep, E)
    ref_order, ref_counts = _loop_order(ids, keep, E)
    assert order.tolist() == ref_order
    assert counts.tolist() == ref_counts and counts.dtype == torch.int64


def test_permute_and_unpermute_against_loops():
    T, k, E, D = 9, 2, 4, 5
    ids, probs, keep = _routing(T, k, E, drop_frac=0.25)
    x = torch.randn(T, D, requires_grad=True)
    order, counts = sort_assignments(ids, keep, E)
    x_R = permute(x, order, k)
    ref = torch.stack([x[a // k] for a in order.tolist()])
    assert torch.equal(x_R, ref)
    # a per-row transform stands in for the experts
    y_R = x_R * 2.0 + 1.0
    probs = probs.clone().requires_grad_(True)
    out = unpermute(y_R, order, probs, T)
    ref_out = torch.zeros(T, D)
    for r, a in enumerate(order.tolist()):
        ref_out[a // k] += probs[a // k, a % k] * y_R[r]
    torch.testing.assert_close(out, ref_out)
    # tokens whose assignments were all dropped get zeros
    for t in range(T):
        if not keep[t].any():
            assert torch.count_nonzero(out[t]) == 0
    # gradients: d/dx and d/dprobs match the loop
    up = torch.randn(T, D)
    gx, gp = torch.autograd.grad((out * up).sum(), (x, probs), retain_graph=True)
    gx_ref, gp_ref = torch.autograd.grad((ref_out * up).sum(), (x, probs))
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gp, gp_ref)
    assert torch.count_nonzero(gp[~keep]) == 0


def test_unpermute_bf16_rows_fp32_weights():
    T, k, E, D = 6, 2, 3, 4
    ids, probs, _ = _routing(T, k, E)
    order, _ = sort_assignments(ids, None, E)
    y = torch.randn(order.numel(), D).bfloat16()
    out = unpermute(y, order, probs, T)
    assert out.dtype == torch.bfloat16
    ref = unpermute(y.float(), order, probs, T)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("pad", [False, True])
def test_local_dispatcher_round_trip(pad):
    T, k, E, D = 12, 2, 4, 6
    ids, probs, keep = _routing(T, k, E, drop_frac=0.2)
    kept_counts = torch.bincount(ids[keep], minlength=E)
    capacity = int(kept_counts.max()) + 1
    routing = RoutingResult(probs=probs, expert_ids=ids, tokens_per_expert=kept_counts, aux_loss=torch.zeros(()),
                            z_loss=torch.zeros(()), keep_mask=keep, capacity=capacity)
    disp = LocalDispatcher(pad_to_capacity=pad)
    x = torch.randn(T, D)
    x_R, counts_e, ctx = disp.dispatch(x, routing, E)
    if pad:
        assert x_R.shape[0] == E * capacity and counts_e.tolist() == [capacity] * E
    else:
        assert counts_e.tolist() == kept_counts.tolist() and x_R.shape[0] == int(keep.sum())
    # rows of expert e are its tokens, in token order
    starts = torch.cumsum(counts_e, 0) - counts_e
    for e in range(E):
        toks = [t for t in range(T) for j in range(k) if ids[t, j] == e and keep[t, j]]
        got = x_R[int(starts[e]):int(starts[e]) + len(toks)]
        assert torch.equal(got, x[toks])
        if pad:  # padding rows are zero
            assert torch.count_nonzero(x_R[int(starts[e]) + len(toks):int(starts[e]) + capacity]) == 0
    out = disp.combine(x_R * 3.0, ctx)
    ref = 3.0 * x * (probs * keep).sum(1, keepdim=True)
    torch.testing.assert_close(out, ref)
