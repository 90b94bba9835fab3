"""Token dispatchers: distributed dispatch -> experts -> combine equals the single-process formula.

Every rank builds every rank's routing and all experts' weights from fixed seeds, so it can compute the
reference for its own tokens with ALL experts (plain matmuls) and the true row counts of its local experts.
ETP is simulated by giving each etp rank a slice of F of its local experts (partial outputs sum to the expert).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _dist import run_distributed
from lightning_moe.moe.dispatch import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    LocalDispatcher,
    regroup_index,
)
from lightning_moe.moe.router import RoutingResult

D, FF = 8, 6  # hidden, expert hidden (divisible by etp = 2)
TOL = dict(rtol=1e-5, atol=1e-5)


def _close(got, want, what="", tol=TOL):
    # torch.testing.assert_close imports torch.distributed.tensor (and sympy): seconds per spawned rank
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, **tol), f"{what}: max abs diff {(got - want).abs().max().item():.3g}"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weights(E, seed=0):
    g = _gen(seed)
    w1 = torch.randn(E, FF, D, generator=g) * 0.5
    w3 = torch.randn(E, FF, D, generator=g) * 0.5
    w2 = torch.randn(E, D, FF, generator=g) * 0.5
    return w1, w3, w2


def _expert(x, w1, w3, w2):
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def _experts_fn(x_RD, counts_e, w1, w3, w2, probs_R=None):
    """Experts on grouped rows; with ``probs_R`` each row's activation is scaled before the down projection (the
    experts apply the combine weights, ``dispatch(weights_applied_by="experts")``)."""
    sizes = counts_e.tolist()
    p_parts = torch.split(probs_R, sizes) if probs_R is not None else [None] * len(sizes)
    outs = []
    for j, (x_e, p_e) in enumerate(zip(torch.split(x_RD, sizes, dim=0), p_parts)):
        h = F.silu(x_e @ w1[j].t()) * (x_e @ w3[j].t())
        outs.append((h if p_e is None else h * p_e.unsqueeze(1)) @ w2[j].t())
    return torch.cat(outs, dim=0)


def _weights_by(row_probs):
    return "experts" if row_probs else "combine"


def _experts_and_combine(disp, x_RD, counts_e, ctx, ws, row_probs):
    """experts -> combine, the weights in the combine or (``row_probs``) in the experts."""
    p_R = ctx.probs_R
    if row_probs:
        assert p_R.shape == (x_RD.shape[0],) and p_R.dtype == torch.float32 and ctx.weights_applied_by == "experts"
    else:
        assert p_R is None and ctx.weights_applied_by == "combine"
    return disp.combine(_experts_fn(x_RD, counts_e, *ws, probs_R=p_R), ctx, weights_applied_by=_weights_by(row_probs))


def _routing(rank, case):
    """Routing of ``rank`` for a case (deterministic: every rank can rebuild every rank's routing)."""
    E, k, T = case["E"], case["k"], case["T"][rank % len(case["T"])]
    g = _gen(1000 * case["seed"] + rank)
    scores = torch.rand(T, E, generator=g)
    if case.get("empty_expert") is not None:
        scores[:, case["empty_expert"]] = -1.0  # never chosen (k < E)
    ids = scores.topk(k, dim=1).indices
    if T > 0 and k == 2 and E == 8:
        ids[0] = torch.tensor([6, 7])  # both choices of one token on the same (remote for most ranks) rank
    probs = torch.softmax(torch.randn(T, k, generator=g), dim=1)
    x = torch.randn(T, D, generator=g)
    keep = None
    cap = case.get("capacity")
    if cap is not None:
        # keep the first `cap` assignments of each expert (token-major), then drop a few more at random;
        # dropped assignments keep non-zero probs: the dispatcher alone must ignore them
        flat = ids.reshape(-1)
        onehot = F.one_hot(flat, E)
        pos = (torch.cumsum(onehot, 0) - onehot)[torch.arange(flat.numel()), flat]
        keep = (pos < cap) & (torch.rand(flat.numel(), generator=g) > 0.2)
        keep = keep.view(T, k)
    return x, probs, ids, keep


def _reference(x, probs, ids, keep, w1, w3, w2):
    E = w1.shape[0]
    y_all = torch.stack([_expert(x, w1[j], w3[j], w2[j]) for j in range(E)])  # [E, T, D]
    T, k = ids.shape
    w = probs if keep is None else probs * keep
    y = torch.zeros_like(x)
    for c in range(k):
        y = y + w[:, c : c + 1] * y_all[ids[:, c], torch.arange(T)]
    return y


def _check_case(disp, case, world, device="cpu", tol=TOL, row_probs=False):
    """``world``: the ranks 0..world-1 form this dispatcher's ep x etp domain (the tests' layouts cover it).
    ``row_probs``: the experts apply the combine weights (``ctx.probs_R``), combine sums unweighted."""
    rank = dist.get_rank()
    E = case["E"]
    P, Q = disp.ep_size, disp.etp_size
    p, q = disp.ep_rank, disp.etp_rank
    e, f = E // P, FF // Q
    x0, probs0, ids, keep = (t if t is None else t.to(device) for t in _routing(rank, case))
    W1, W3, W2 = (w.to(device) for w in _weights(E))

    # distributed: local experts, this etp rank's slice of F
    x = x0.clone().requires_grad_()
    probs = probs0.clone().requires_grad_()
    ex = slice(p * e, (p + 1) * e)
    fs = slice(q * f, (q + 1) * f)
    w1 = W1[ex, fs].clone().requires_grad_()
    w3 = W3[ex, fs].clone().requires_grad_()
    w2 = W2[ex, :, fs].clone().requires_grad_()
    routing = RoutingResult(
        probs=probs, expert_ids=ids, tokens_per_expert=torch.bincount(ids.reshape(-1), minlength=E),
        aux_loss=torch.zeros((), device=device), z_loss=torch.zeros((), device=device), keep_mask=keep,
        capacity=case.get("capacity"),
    )
    x_RD, counts_e, ctx = disp.dispatch(x, routing, E, weights_applied_by=_weights_by(row_probs))
    assert disp.num_local_experts == e
    assert counts_e.dtype == torch.int64 and counts_e.shape == (e,)
    assert x_RD.shape[0] == int(counts_e.sum())

    # true rows per local expert: every rank of the (ep x etp) world routes to this rank's experts
    true_E = torch.zeros(E, dtype=torch.long, device=device)
    for r in range(world):
        _, _, ids_r, keep_r = (t if t is None else t.to(device) for t in _routing(r, case))
        flat = ids_r.reshape(-1) if keep_r is None else ids_r.reshape(-1)[keep_r.reshape(-1)]
        true_E += torch.bincount(flat, minlength=E)
    if getattr(disp, "pad_to_capacity", False) and case.get("capacity") is not None:
        assert torch.equal(counts_e, torch.full((e,), case["capacity"] * world, device=device))
    else:  # dispatchers with an expert alignment (DeepEP's) round each count up, padding with zero rows
        align = getattr(disp, "expert_alignment", 1)
        want = (true_E[ex] + align - 1) // align * align
        assert torch.equal(counts_e, want), (counts_e, want)

    y = _experts_and_combine(disp, x_RD, counts_e, ctx, (w1, w3, w2), row_probs)
    g_out = torch.randn(x0.shape, generator=_gen(7 + rank)).to(device)
    (y * g_out).sum().backward()

    # reference on this rank's tokens with all experts
    xr = x0.clone().requires_grad_()
    pr = probs0.clone().requires_grad_()
    R1, R3, R2 = (w.clone().requires_grad_() for w in (W1, W3, W2))
    y_ref = _reference(xr, pr, ids, keep, R1, R3, R2)
    (y_ref * g_out).sum().backward()

    _close(y, y_ref, "output", tol)
    _close(x.grad, xr.grad, "grad x", tol)
    _close(probs.grad, pr.grad, "grad probs", tol)
    # expert weights see every rank's tokens: the reference gradient is the sum over ranks
    for name, loc, ref, idx in (
        ("w1", w1, R1, (ex, fs)), ("w3", w3, R3, (ex, fs)), ("w2", w2, R2, (ex, slice(None), fs))
    ):
        full = ref.grad.clone()
        dist.all_reduce(full)
        got = loc.grad if loc.grad is not None else torch.zeros_like(loc)
        _close(got, full[idx], f"grad {name}", tol)


CASES = [
    # T differs per rank, rank 1 has no tokens, expert 5 gets none, token 0 sends both choices to experts 6 and 7
    dict(name="uneven", E=8, k=2, T=[5, 0, 7, 3], seed=1, empty_expert=5),
    dict(name="k=E", E=4, k=4, T=[3, 2, 1, 4], seed=2),
    dict(name="capacity", E=8, k=2, T=[6, 4, 5, 6], seed=3, capacity=2),
]


def _layouts(world, device="cpu"):
    from torch.distributed.device_mesh import init_device_mesh

    if world == 2:
        mesh = init_device_mesh(device, (2, 1), mesh_dim_names=("ep", "etp"))
        mesh2 = init_device_mesh(device, (1, 2), mesh_dim_names=("ep", "etp"))
        return [("ep2", mesh["ep"], mesh["etp"]), ("ep1xetp2", mesh2["ep"], mesh2["etp"])]
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("ep", "etp"))
    return [("ep2xetp2", mesh["ep"], mesh["etp"]), ("ep4", dist.group.WORLD, None)]


def _worker(rank, world):
    for name, ep, etp in _layouts(world):
        dispatchers = [
            AllToAllDispatcher(ep, etp),
            AllToAllDispatcher(ep, etp, pad_to_capacity=True),
            AllGatherDispatcher(ep, etp),
        ]
        for case in CASES:
            if case["E"] % dispatchers[0].ep_size:
                continue
            for disp in dispatchers:
                for row_probs in (False, True):
                    try:
                        _check_case(disp, case, world, row_probs=row_probs)
                    except Exception as err:
                        raise AssertionError(f"layout {name}, case {case['name']}, {disp!r}, row_probs={row_probs}: "
                                             f"{err}") from err
    # a wrong expert count is a clear error
    d = AllToAllDispatcher(dist.group.WORLD)
    try:
        d.dispatch(torch.zeros(1, D), RoutingResult(torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long),
                                                    torch.ones(1), torch.zeros(()), torch.zeros(())), 3)
    except ValueError as err:
        assert "divisible" in str(err)
    else:
        raise AssertionError("E % ep != 0 was accepted")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_dispatchers_match_single_process(world):
    assert run_distributed(_worker, world) is True


def test_regroup_index_matches_naive():
    g = _gen(0)
    counts = torch.randint(0, 3, (3, 4), generator=g)  # 3 sources, 4 experts
    counts[1] = 0  # a source with nothing
    counts[:, 2] = 0  # an expert with nothing
    gap = 2  # padding rows between sources
    base, src_rows, labels = [], [], []
    off = 0
    for s in range(3):
        base.append(off)
        for j in range(4):
            for i in range(int(counts[s, j])):
                labels.append((j, s, i))
                src_rows.append(off)
                off += 1
        off += gap
    idx = regroup_index(counts, torch.tensor(base), int(counts.sum()))
    expected = [row for _, row in sorted(zip(labels, src_rows))]  # expert-major, then source, then order
    assert idx.tolist() == expected


@pytest.mark.parametrize("row_probs", [False, True], ids=["weighted_combine", "row_probs"])
@pytest.mark.parametrize("mode", ["plain", "capacity", "pad", "k=E"])
def test_local_dispatcher_matches_reference(mode, row_probs):
    """Values and gradients (x, probs, expert weights) of LocalDispatcher against the formula."""
    g = _gen(4)
    E, T = 4, 7
    k = E if mode == "k=E" else 2
    x0 = torch.randn(T, D, generator=g)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    probs0 = torch.rand(T, k, generator=g)
    keep = (torch.rand(T, k, generator=g) > 0.3) if mode in ("capacity", "pad") else None
    cap = None
    if keep is not None:
        cap = int(torch.bincount(ids.reshape(-1)[keep.reshape(-1)], minlength=E).max()) + 1
    W = _weights(E)
    g_out = torch.randn(T, D, generator=g)

    def run(fn):
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in W]
        y = fn(x, probs, ws)
        (y * g_out).sum().backward()
        return [y, x.grad, probs.grad] + [w.grad for w in ws]

    def local(x, probs, ws):
        disp = LocalDispatcher(pad_to_capacity=mode == "pad")
        routing = RoutingResult(probs, ids, torch.zeros(E), torch.zeros(()), torch.zeros(()), keep, cap)
        x_RD, counts, ctx = disp.dispatch(x, routing, E, weights_applied_by=_weights_by(row_probs))
        assert disp.num_local_experts == E
        if mode == "pad":
            assert counts.tolist() == [cap] * E and x_RD.shape[0] == E * cap
        else:
            flat = ids.reshape(-1) if keep is None else ids.reshape(-1)[keep.reshape(-1)]
            assert torch.equal(counts, torch.bincount(flat, minlength=E))
        return _experts_and_combine(disp, x_RD, counts, ctx, ws, row_probs)

    for got, want, what in zip(run(local), run(lambda x, p, ws: _reference(x, p, ids, keep, *ws)),
                               ["y", "x", "probs", "w1", "w3", "w2"]):
        _close(got, want, what)


def test_fast_row_ops_bf16_match_reference():
    """The atomics-free permute / unpermute agree with permute.py's reference in bf16 (values and gradients)."""
    from lightning_moe.moe.permute import permute, sort_assignments, unpermute

    g = _gen(5)
    E, T, k, Dh = 6, 40, 3, 32
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    probs0 = torch.rand(T, k, generator=g)
    x0 = torch.randn(T, Dh, generator=g).bfloat16()
    g_out = torch.randn(T, Dh, generator=g).bfloat16()

    def run(local):
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        if local:
            disp = LocalDispatcher()
            routing = RoutingResult(probs, ids, torch.zeros(E), torch.zeros(()), torch.zeros(()))
            rows, _, ctx = disp.dispatch(x, routing, E)
            y = disp.combine(rows * 1.5, ctx)
        else:
            order, _ = sort_assignments(ids, None, E)
            y = unpermute(permute(x, order, k) * 1.5, order, probs, T)
        (y.float() * g_out.float()).sum().backward()
        return y.float(), x.grad.float(), probs.grad.float()

    for got, want in zip(run(True), run(False)):
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (got - want).abs().max()
