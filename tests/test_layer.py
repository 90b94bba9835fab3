"""MoELayer against a dense reference: every expert on every token, weighted by a [T, E] matrix built from the
router's decision (zero for unchosen, dropped and padding assignments)."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.config import MoEConfig
from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.record import MoERecorder
from lightning_moe.moe.router import TopKRouter

D, FF, E, K = 16, 32, 8, 2
B, S = 2, 12
# fp32; the layer applies the combine weight before the down projection, the references after it (a reassociation:
# differences of a few ulps of the O(1) values)
RTOL, ATOL = 1e-5, 2e-6

SOFTMAX = dict(num_experts=E, top_k=K, expert_hidden_size=FF, score_func="softmax", pre_softmax=True,
               aux_loss_type="aux", z_loss_coeff=1e-3)
MIXTRAL = dict(SOFTMAX, pre_softmax=False)
SIGMOID = dict(num_experts=E, top_k=K, expert_hidden_size=FF, score_func="sigmoid", norm_topk_prob=True,
               scaling_factor=2.5, num_groups=4, group_topk=2, expert_bias=True, aux_loss_type="seq",
               aux_loss_coeff=1e-4)


def _layer(seed=0, **cfg):
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(**cfg), D)
    with torch.no_grad():  # larger weights than the init, so outputs and gradients are O(1)
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.3)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.normal_(0.0, 0.05)
    return layer


def _swiglu(x, w1, w3, w2):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def dense_reference(layer, x_BSD, valid_BS=None):
    """y[t] = sum_e W[t, e] * expert_e(x[t]) (+ shared(x[t])), every expert run on every token."""
    Bx, Sx, Dx = x_BSD.shape
    x_TD = x_BSD.reshape(-1, Dx)
    valid_T = None if valid_BS is None else valid_BS.reshape(-1)
    r = layer.router(x_TD, valid_T, seq_len=Sx)
    keep = torch.ones_like(r.expert_ids, dtype=torch.bool) if r.keep_mask is None else r.keep_mask
    W_TE = torch.zeros(x_TD.shape[0], layer.num_experts).scatter_add(1, r.expert_ids, r.probs * keep)
    ex = layer.experts
    y = torch.zeros_like(x_TD)
    for e in range(layer.num_experts):
        y = y + W_TE[:, e:e + 1] * _swiglu(x_TD, ex.w1[e], ex.w3[e], ex.w2[e])
    sh = layer.shared_experts
    if sh is not None:
        ys = _swiglu(x_TD, sh.w1.weight, sh.w3.weight, sh.w2.weight)
        if sh.gate is not None:
            ys = torch.sigmoid(x_TD @ sh.gate.weight.T) * ys
        y = y + ys
    return y.reshape(Bx, Sx, Dx), r


def _fwd_bwd(layer, fn, x0, up, valid=None):
    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    out = fn(x, valid)
    y = out[0] if isinstance(out, tuple) else out
    (y * up).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in layer.named_parameters()})
    return y.detach(), grads


def _recorded(layer, *args):
    """The layer's output and the one MoERecord its forward handed the recorder."""
    recorder = MoERecorder()
    y = layer(*args, recorder=recorder, layer_idx=3)
    assert list(recorder.records) == [3]
    return y, recorder.records[3]


def _check_against_reference(layer, valid=None, seed=1):
    """Output and gradients against the dense reference; returns (input, output, the forward's MoERecord)."""
    torch.manual_seed(seed)
    x0 = torch.randn(B, S, D)
    up = torch.randn(B, S, D)
    recorder = MoERecorder()
    y, g = _fwd_bwd(layer, lambda x, v: layer(x, v, recorder=recorder), x0, up, valid)
    y_ref, g_ref = _fwd_bwd(layer, lambda x, v: dense_reference(layer, x, v), x0, up, valid)
    torch.testing.assert_close(y, y_ref, rtol=RTOL, atol=ATOL)
    assert set(g) == set(g_ref)
    for name in g:
        assert g[name] is not None and g_ref[name] is not None, name
        torch.testing.assert_close(g[name], g_ref[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return x0, y, recorder.records[0]


@pytest.mark.parametrize(
    "cfg",
    [
        SOFTMAX,
        MIXTRAL,
        SIGMOID,
        dict(SOFTMAX, shared_expert_hidden_size=24),
        dict(SIGMOID, shared_expert_hidden_size=24, shared_expert_gate=True),
    ],
    ids=["softmax", "mixtral", "sigmoid-groups-bias", "softmax-shared", "sigmoid-shared-gated"],
)
def test_matches_dense_reference(cfg):
    layer = _layer(**cfg)
    assert isinstance(layer.router, TopKRouter) and isinstance(layer.experts, GroupedExperts)
    assert isinstance(layer.dispatcher, LocalDispatcher)
    assert "dispatcher" not in dict(layer.named_modules())
    assert (layer.shared_experts is not None) == bool(cfg.get("shared_expert_hidden_size"))
    _, _, rec = _check_against_reference(layer)
    st = rec.routing
    assert st.tokens_per_expert.shape == (E,) and int(st.tokens_per_expert.sum()) == B * S * K
    assert int(st.num_dropped) == 0 and int(st.num_tokens) == B * S
    assert all(not t.requires_grad for t in st.values() if t is not None)
    # a training forward with expert bias reports the demand (every valid token's k choices, before capacity)
    assert (st.bias_demand is not None) == bool(cfg.get("expert_bias"))
    if st.bias_demand is not None:
        assert st.bias_demand.shape == (E,) and int(st.bias_demand.sum()) == B * S * K
    assert rec.aux_loss.requires_grad and rec.aux_loss.dim() == 0
    assert rec.z_loss.dim() == 0


def test_sum_backward_and_loop_experts_agree():
    layer = _layer(**SOFTMAX)
    loop = copy.deepcopy(layer)
    loop.experts.use_grouped_mm = False
    x = torch.randn(B, S, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    layer(x).sum().backward()
    loop(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(layer.experts.w2.grad, loop.experts.w2.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_dropping(policy):
    cfg = dict(SOFTMAX, capacity_factor=0.5, drop_policy=policy, shared_expert_hidden_size=24)
    layer = _layer(**cfg)
    _check_against_reference(layer)  # dropped assignments have zero weight in the reference
    torch.manual_seed(1)
    x = torch.randn(B, S, D)
    y, rec = _recorded(layer, x)
    r = layer.router(x.reshape(-1, D), None, seq_len=S)
    keep = r.keep_mask
    assert keep is not None and r.capacity == 3  # ceil(0.5 * 24 * 2 / 8)
    expected_dropped = int((~keep).sum())
    assert expected_dropped > 0
    assert int(rec.routing.num_dropped) == expected_dropped
    kept_per_expert = torch.bincount(r.expert_ids[keep], minlength=E)
    assert torch.equal(rec.routing.tokens_per_expert, kept_per_expert)
    assert int(kept_per_expert.max()) <= r.capacity
    # explicit per-assignment sum over kept assignments only
    x_TD = x.reshape(-1, D)
    ex, sh = layer.experts, layer.shared_experts
    ref = _swiglu(x_TD, sh.w1.weight, sh.w3.weight, sh.w2.weight)
    rows = []
    for t in range(B * S):
        acc = ref[t]
        for j in range(K):
            if keep[t, j]:
                e = int(r.expert_ids[t, j])
                acc = acc + r.probs[t, j] * _swiglu(x_TD[t:t + 1], ex.w1[e], ex.w3[e], ex.w2[e])[0]
        rows.append(acc)
    torch.testing.assert_close(y.reshape(-1, D), torch.stack(rows), rtol=RTOL, atol=ATOL)


def test_pad_to_capacity_same_output():
    cfg = dict(SIGMOID, capacity_factor=0.75)
    plain = _layer(**cfg)
    padded = MoELayer(MoEConfig(**dict(cfg, pad_to_capacity=True)), D)
    padded.load_state_dict(plain.state_dict())
    assert padded.dispatcher.pad_to_capacity and not plain.dispatcher.pad_to_capacity
    seen = []
    padded.experts.register_forward_hook(lambda m, args, out: seen.append((args[0].shape[0], args[1].tolist())))
    torch.manual_seed(1)
    x0 = torch.randn(B, S, D)
    up = torch.randn(B, S, D)
    rec1, rec2 = MoERecorder(), MoERecorder()
    y1, g1 = _fwd_bwd(plain, lambda x, v: plain(x, v, recorder=rec1), x0, up)
    y2, g2 = _fwd_bwd(padded, lambda x, v: padded(x, v, recorder=rec2), x0, up)
    cap = plain.router(x0.reshape(-1, D), None, seq_len=S).capacity
    assert seen == [(E * cap, [cap] * E)]  # static shapes: every expert buffer padded to capacity
    torch.testing.assert_close(y1, y2, rtol=RTOL, atol=ATOL)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=RTOL, atol=ATOL)
    assert torch.equal(rec1.records[0].routing.num_dropped, rec2.records[0].routing.num_dropped)
    _check_against_reference(padded)


@pytest.mark.parametrize("cfg", [dict(SOFTMAX, shared_expert_hidden_size=24),
                                 dict(SIGMOID, capacity_factor=1.0)], ids=["dropless", "capacity"])
def test_padding_tokens(cfg):
    layer = _layer(**cfg)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[0, 9:] = False
    valid[1, 4:] = False
    x0, _, rec = _check_against_reference(layer, valid)
    n_valid = int(valid.sum())
    st = rec.routing
    assert int(st.num_tokens) == n_valid
    assert int(st.tokens_per_expert.sum()) + int(st.num_dropped) == n_valid * K
    if st.bias_demand is not None:  # the demand counts valid tokens only, before capacity
        assert int(st.bias_demand.sum()) == n_valid * K
    # padding tokens get no routed output: only the shared experts (if any) act on them
    y = layer(x0, valid)
    pad = ~valid
    if layer.shared_experts is None:
        assert torch.count_nonzero(y[pad]) == 0
    else:
        torch.testing.assert_close(y[pad], layer.shared_experts(x0[pad]), rtol=RTOL, atol=ATOL)


def test_all_padding_zero_rows():
    layer = _layer(**dict(SOFTMAX, shared_expert_hidden_size=24))
    x = torch.randn(B, S, D, requires_grad=True)
    valid = torch.zeros(B, S, dtype=torch.bool)
    y, rec = _recorded(layer, x, valid)
    torch.testing.assert_close(y, layer.shared_experts(x), rtol=RTOL, atol=ATOL)
    y.sum().backward()
    assert int(rec.routing.tokens_per_expert.sum()) == 0 and int(rec.routing.num_tokens) == 0
    assert layer.experts.w1.grad is not None and torch.count_nonzero(layer.experts.w1.grad) == 0


def test_dtypes():
    layer = _layer(**dict(SOFTMAX, shared_expert_hidden_size=24, shared_expert_gate=True))
    torch.manual_seed(1)
    x = torch.randn(B, S, D)
    y_ref = layer(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x.clone().requires_grad_(True))
    assert y.dtype == torch.float32  # activations come back in the input dtype
    torch.testing.assert_close(y, y_ref, rtol=5e-2, atol=5e-2 * y_ref.abs().max().item())
    y.sum().backward()
    assert layer.experts.w1.grad.dtype == torch.float32
    # bf16 everything ("bf16-true"): the router still routes in fp32
    layer16 = copy.deepcopy(layer).to(torch.bfloat16)
    x16 = x.bfloat16().requires_grad_(True)
    y16, rec16 = _recorded(layer16, x16)
    assert y16.dtype == torch.bfloat16
    y16.float().sum().backward()
    assert x16.grad.dtype == torch.bfloat16
    assert rec16.aux_loss.dtype == torch.float32


def test_meta_init_and_state_dict_keys():
    cfg = MoEConfig(**dict(SIGMOID, shared_expert_hidden_size=24, shared_expert_gate=True))
    with torch.device("meta"):
        layer = MoELayer(cfg, D)
    assert layer.experts.w1.is_meta
    layer.to_empty(device="cpu")
    for m in layer.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    assert all(torch.isfinite(p).all() for p in layer.parameters())
    keys = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert keys == {
        "router.weight": (E, D), "router.expert_bias": (E,),
        "experts.w1": (E, FF, D), "experts.w3": (E, FF, D), "experts.w2": (E, D, FF),
        "shared_experts.w1.weight": (24, D), "shared_experts.w3.weight": (24, D),
        "shared_experts.w2.weight": (D, 24), "shared_experts.gate.weight": (1, D),
    }
    y = layer(torch.randn(B, S, D))
    assert torch.isfinite(y).all()


def test_bad_input():
    layer = _layer(**SOFTMAX)
    with pytest.raises(ValueError, match=r"\[B, S, 16\]"):
        layer(torch.randn(B * S, D))
    with pytest.raises(ValueError, match="padding_mask"):
        layer(torch.randn(B, S, D), torch.ones(B * S, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_experts"):
        MoELayer(dataclasses.replace(MoEConfig(), num_experts=0), D)


def test_checkpoint_recompute_records_once():
    """A user's own checkpoint passes lightning_moe's recompute_context (as apply_ac does): the re-run marks itself
    and adds nothing to the recorder; without it the re-run would record the layer a second time."""
    from torch.utils.checkpoint import checkpoint

    from lightning_moe.autograd import recompute_context

    layer = _layer(**dict(SIGMOID, z_loss_coeff=1e-3))
    x = torch.randn(B, S, D, requires_grad=True)
    recorder = MoERecorder()
    y = checkpoint(lambda t: layer(t, recorder=recorder), x, use_reentrant=False, context_fn=recompute_context)
    (rec,) = recorder.records.values()
    demand = rec.routing.bias_demand.clone()
    (y.sum() + rec.aux_loss + rec.z_loss).backward()  # recomputes the forward inside backward
    assert len(recorder.records) == 1 and recorder.records[0] is rec
    assert torch.equal(rec.routing.bias_demand, demand)
    assert layer.router.weight.grad is not None
    copy.deepcopy(layer)  # the layer holds no graph tensor

    plain = MoERecorder()
    y = checkpoint(lambda t: layer(t, recorder=plain), x, use_reentrant=False)  # no recompute_context
    with pytest.raises(RuntimeError, match="recorded twice"):
        y.sum().backward()
