"""GroupedExperts (grouped GEMM vs per-expert loop) and SharedExperts."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.moe.experts import GroupedExperts, SharedExperts
from lightning_moe.moe.grouped_mm import TorchGroupedMM

E, D, FF = 4, 16, 32
RTOL = 1e-5


def _make(seed=0, **kw):
    torch.manual_seed(seed)
    return GroupedExperts(E, D, FF, **kw)


def _grads(module, x):
    return [x.grad] + [p.grad for p in (module.w1, module.w2, module.w3)]


def _run(module, fn, x0, counts, upstream=None):
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    y = fn(x, counts)
    g = upstream if upstream is not None else torch.ones_like(y)
    (y * g).sum().backward()
    return y.detach(), _grads(module, x)


def _close(a, b, rtol=RTOL, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "counts",
    [[3, 5, 2, 6], [3, 0, 5, 0], [0, 0, 11, 0], [11, 0, 0, 0], [0, 0, 0, 0]],
    ids=["all", "zero-token-experts", "one-expert", "first-expert", "zero-rows"],
)
def test_grouped_matches_loop(counts):
    m = _make()
    counts_e = torch.tensor(counts, dtype=torch.int64)
    R = sum(counts)
    torch.manual_seed(1)
    x0 = torch.randn(R, D)
    up = torch.randn(R, D)
    y_g, g_g = _run(m, m.forward, x0, counts_e, up)
    y_l, g_l = _run(m, m.forward_loop, x0, counts_e, up)
    assert y_g.shape == (R, D) and y_g.dtype == torch.float32
    _close(y_g, y_l)
    for a, b in zip(g_g, g_l):
        assert a is not None and b is not None
        _close(a, b)
    # experts without tokens get exactly zero gradient
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(g_g[1][e]) == 0 and torch.count_nonzero(g_g[3][e]) == 0


def test_loop_matches_explicit_formula():
    m = _make()
    counts = [2, 0, 3, 1]
    x = torch.randn(6, D)
    y = m.forward_loop(x, torch.tensor(counts))
    rows = []
    r = 0
    for e, c in enumerate(counts):
        for _ in range(c):
            xi = x[r]
            h = F.silu(m.w1[e] @ xi) * (m.w3[e] @ xi)
            rows.append(m.w2[e] @ h)
            r += 1
    _close(y, torch.stack(rows).detach())


def test_sum_backward_expanded_grad():
    """y.sum().backward() hands the kernel an expanded stride-0 gradient; it must work."""
    m = _make()
    x = torch.randn(10, D, requires_grad=True)
    y = m(x, torch.tensor([4, 0, 3, 3]))
    y.sum().backward()
    assert x.grad is not None and m.w1.grad is not None and m.w2.grad is not None
    m2 = copy.deepcopy(m)
    m2.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_(True)
    m2.forward_loop(x2, torch.tensor([4, 0, 3, 3])).sum().backward()
    _close(x.grad, x2.grad)
    _close(m.w2.grad, m2.w2.grad)


def test_bf16_autocast():
    m = _make()
    counts_e = torch.tensor([5, 0, 4, 7])
    x0 = torch.randn(16, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, grads = _run(m, m.forward, x0, counts_e)
    assert y.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads)  # master weights and fp32 input keep fp32 grads
    y_ref, g_ref = _run(m, m.forward_loop, x0, counts_e)  # fp32 reference
    _close(y.float(), y_ref, rtol=3e-2, atol=3e-3)
    for a, b in zip(grads, g_ref):
        _close(a, b, rtol=5e-2, atol=5e-2 * b.abs().max().item())
    # the loop under autocast agrees with the grouped path under autocast (same bf16 operands)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_l, _ = _run(m, m.forward_loop, x0, counts_e)
    assert y_l.dtype == torch.bfloat16
    _close(y.float(), y_l.float(), rtol=2e-2, atol=2e-3)


def test_bf16_weights_fp32_input():
    m = _make().to(torch.bfloat16)
    x = torch.randn(9, D, requires_grad=True)
    y = m(x, torch.tensor([2, 3, 0, 4]))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.w1.grad.dtype == torch.bfloat16


def test_unaligned_dims_fall_back_to_loop():
    torch.manual_seed(0)
    m = GroupedExperts(3, 6, 10)  # 6 * 4 bytes is not a multiple of 16
    x = torch.randn(7, 6)
    counts = torch.tensor([3, 0, 4])
    with pytest.warns(UserWarning, match="16 bytes"):
        y = m(x, counts)
    _close(y, m.forward_loop(x, counts))


def test_use_grouped_mm_false_and_seam():
    calls = []

    class Spy(TorchGroupedMM):
        def __call__(self, x_MK, w_EKN, offs_E):
            calls.append((tuple(x_MK.shape), tuple(w_EKN.shape), offs_E.dtype))
            return super().__call__(x_MK, w_EKN, offs_E)

    torch.manual_seed(0)
    spy = GroupedExperts(E, D, FF, grouped_mm=Spy())
    loop = copy.deepcopy(spy)
    loop.use_grouped_mm = False
    x = torch.randn(8, D)
    c = torch.tensor([1, 2, 3, 2])
    _close(spy(x, c), loop(x, c))
    assert calls == [((8, D), (E, D, FF), torch.int32), ((8, D), (E, D, FF), torch.int32),
                     ((8, FF), (E, FF, D), torch.int32)]


def test_shapes_init_and_meta():
    m = GroupedExperts(E, D, FF, init_std=0.02, out_init_std=0.005)
    assert dict((n, tuple(p.shape)) for n, p in m.named_parameters()) == {
        "w1": (E, FF, D), "w3": (E, FF, D), "w2": (E, D, FF)}
    with torch.device("meta"):
        mm = GroupedExperts(64, 64, 128, out_init_std=0.005)
    assert mm.w1.is_meta
    mm.to_empty(device="cpu")
    mm.reset_parameters()
    assert abs(mm.w1.std().item() - 0.02) < 1e-3 and abs(mm.w3.std().item() - 0.02) < 1e-3
    assert abs(mm.w2.std().item() - 0.005) < 3e-4
    assert abs(mm.w1.mean().item()) < 1e-3
    with pytest.raises(ValueError, match="local experts"):
        m(torch.randn(3, D), torch.tensor([1, 2]))


# ---- DTensor weights (expert parallel): the local shard's experts only ----------------------------


def test_dtensor_weights_use_local_shard():
    """Rank 0 of a 2-way ep mesh (an in-process fake process group: no communication is needed, since
    forward only takes ``to_local()``): local experts are the first half, gradients land on the local shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        full = _make()
        ep = copy.deepcopy(full)
        e = E // 2
        for name in ("w1", "w2", "w3"):
            local = getattr(full, name).detach()[:e].clone()
            setattr(ep, name, torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))
        assert ep.w1.shape == (E, FF, D)  # global shape is unchanged
        counts = torch.tensor([3, 2])
        torch.manual_seed(10)
        x0 = torch.randn(5, D)
        up = torch.randn(5, D)
        y, grads = _run(ep, ep.forward, x0, counts, up)
        full_counts = torch.tensor([3, 2, 0, 0])
        y_ref, g_ref = _run(full, full.forward_loop, x0, full_counts, up)
        _close(y, y_ref)
        _close(grads[0], g_ref[0])
        for g, gr in zip(grads[1:], g_ref[1:]):
            assert isinstance(g, DTensor) and g.to_local().shape[0] == e
            _close(g.to_local(), gr[:e])
        with pytest.raises(ValueError, match="2 local experts"):
            ep(x0, full_counts)
    finally:
        dist.destroy_process_group()


# ---- shared experts ------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts(gate):
    torch.manual_seed(0)
    s = SharedExperts(D, FF, gate=gate)
    names = {n: tuple(p.shape) for n, p in s.named_parameters()}
    expected = {"w1.weight": (FF, D), "w3.weight": (FF, D), "w2.weight": (D, FF)}
    if gate:
        expected["gate.weight"] = (1, D)
    assert names == expected
    x = torch.randn(5, D)
    ref = (F.silu(x @ s.w1.weight.T) * (x @ s.w3.weight.T)) @ s.w2.weight.T
    if gate:
        ref = torch.sigmoid(x @ s.gate.weight.T) * ref
    _close(s(x), ref)


def test_shared_experts_meta_init():
    with torch.device("meta"):
        s = SharedExperts(64, 256, gate=True, init_std=0.02, out_init_std=0.004)
    s.to_empty(device="cpu")
    for m in s.modules():  # what the model does after to_empty, in either order
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    assert abs(s.w1.weight.std().item() - 0.02) < 1.5e-3
    assert abs(s.w2.weight.std().item() - 0.004) < 3e-4
    assert torch.isfinite(s.gate.weight).all()
