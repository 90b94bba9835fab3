"""The MoE layer's plan (moe/layer_plan.py) and the combine-weights contract of the dispatchers: who applies the
combine weights is fixed when the layer is built, handed to the experts as an argument, and every mismatch is a
clear error instead of weights applied twice or never."""

import copy

import pytest
import torch

from lightning_moe.callbacks.low_precision import LowPrecisionGroupedMM
from lightning_moe.config import MoEConfig
from lightning_moe.moe.dispatch import DispatchContext, LocalDispatcher, TokenDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.moe.grouped_mm import TorchGroupedMM
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.router import RoutingResult

D, FF, E, K, T = 16, 32, 4, 2, 10


def _layer(**cfg):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(num_experts=E, top_k=K, expert_hidden_size=FF, **cfg), D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def _routing():
    g = torch.Generator().manual_seed(1)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    return RoutingResult(torch.rand(T, K, generator=g), ids, torch.bincount(ids.reshape(-1), minlength=E),
                         torch.zeros(()), torch.zeros(()))


def _run(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


def test_combine_refuses_a_choice_other_than_the_dispatch_one():
    disp, routing = LocalDispatcher(), _routing()
    x = torch.randn(T, D)
    for by, other in (("experts", "combine"), ("combine", "experts")):
        x_RD, _, ctx = disp.dispatch(x, routing, E, weights_applied_by=by)
        assert ctx.weights_applied_by == by and (ctx.probs_R is not None) == (by == "experts")
        with pytest.raises(ValueError, match="applied twice or never"):
            disp.combine(x_RD, ctx, weights_applied_by=other)
        disp.combine(x_RD, ctx, weights_applied_by=by)  # the same choice is accepted
    with pytest.raises(ValueError, match="weights_applied_by must be one of"):
        disp.dispatch(x, routing, E, weights_applied_by="router")
    with pytest.raises(ValueError, match="does not overlap"):
        disp.dispatch(x, routing, E, overlap=lambda: None)


def test_rows_weights_are_handed_over_once_without_a_state_flip():
    """Reading ``ctx.probs_R`` twice changes nothing: the experts-side result equals the combine-side one."""
    disp, routing = LocalDispatcher(), _routing()
    x = torch.randn(T, D)
    rows, _, ctx_c = disp.dispatch(x, routing, E, weights_applied_by="combine")
    y_c = disp.combine(rows * 2.0, ctx_c)
    rows, _, ctx_e = disp.dispatch(x, routing, E, weights_applied_by="experts")
    p_R = ctx_e.probs_R
    assert torch.equal(p_R, ctx_e.probs_R)
    y_e = disp.combine(rows * 2.0 * p_R.unsqueeze(1), ctx_e)
    torch.testing.assert_close(y_e, y_c)
    assert ctx_c.weights_applied_by == "combine"  # the other dispatch's context is untouched


def test_dispatcher_without_expert_weights_is_planned_for_the_combine_and_refused_for_the_experts():
    class PlainLocal(LocalDispatcher):
        supports_expert_weights = False

    layer = _layer()
    x = torch.randn(2, 5, D)
    ref = _run(copy.deepcopy(layer), x)
    assert layer.plan.weights_applied_by == "experts"
    plan = layer.replan(dispatcher=PlainLocal())
    assert plan.weights_applied_by == "combine" and layer.plan is plan
    with pytest.raises(ValueError, match="cannot hand the rows their combine weights"):
        plan.dispatcher.dispatch(torch.randn(T, D), _routing(), E, weights_applied_by="experts")
    with pytest.raises(ValueError, match="PlainLocal does not declare supports_expert_weights"):
        layer.replan(weights_applied_by="experts")
    assert layer.plan is plan  # a refused replan keeps the old plan
    for a, b in zip(_run(layer, x), ref):  # the same numbers through the other path
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_experts_told_to_apply_the_weights_get_them_as_an_argument():
    seen = []

    class Spy(GroupedExperts):
        applies_row_weights = True  # declared again: this forward takes and applies probs_R

        def forward(self, x_RD, counts_e, probs_R=None):
            seen.append(probs_R)
            return super().forward(x_RD, counts_e, probs_R)

    layer = _layer()
    spy_layer = copy.deepcopy(layer)
    spy_layer.experts.__class__ = Spy
    spy_layer.replan()  # capabilities are read when the plan is made
    assert spy_layer.plan.weights_applied_by == "experts" and not spy_layer.plan.regather_rows
    x = torch.randn(2, 5, D)
    for a, b in zip(_run(spy_layer, x), _run(layer, x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    assert len(seen) == 1 and seen[0] is not None and seen[0].shape == (2 * 5 * K,)


def test_experts_with_a_bare_forward_are_planned_for_the_combine():
    class Bare(GroupedExperts):  # the older signature: forward(x_RD, counts_e)
        def forward(self, x_RD, counts_e):
            return super().forward(x_RD, counts_e)

    assert not Bare.applies_row_weights and not Bare.gathers_rows_from_tokens
    assert GroupedExperts.applies_row_weights  # the base class keeps its declarations
    layer = _layer()
    ref = copy.deepcopy(layer)
    layer.experts.__class__ = Bare
    with pytest.raises(ValueError, match=r"experts \(Bare\) do not declare applies_row_weights"):
        layer.replan(weights_applied_by="experts")
    assert layer.replan().weights_applied_by == "combine"
    x = torch.randn(2, 5, D)
    for a, b in zip(_run(layer, x), _run(ref, x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_planned_attributes_change_through_replan_only():
    layer = _layer(shared_expert_hidden_size=FF)
    for name, value in (("dispatcher", LocalDispatcher()), ("regather_rows", False), ("overlap_shared_experts", True)):
        with pytest.raises(AttributeError, match=rf"layer.replan\({name}="):
            setattr(layer, name, value)
    with pytest.raises(ValueError, match="unknown options"):
        layer.replan(regather=False)
    with pytest.raises(TypeError, match="TokenDispatcher"):
        layer.replan(dispatcher=object())
    # the local dispatcher does not overlap: the option is kept but resolves to False, and survives a replan
    assert layer.plan.options.overlap_shared_experts and not layer.plan.overlap_shared_experts
    assert layer.replan(regather_rows=False).options.overlap_shared_experts
    assert isinstance(layer.dispatcher, TokenDispatcher) and "plan=MoELayerPlan(" in repr(layer)


def test_grouped_mm_is_a_typed_build_time_component():
    layer = _layer()
    assert type(layer.plan.grouped_mm) is TorchGroupedMM and layer.plan.regather_rows
    impl = LowPrecisionGroupedMM("fp8_rowwise", emulate=True, name="experts", fuse=False)
    plan = layer.replan(grouped_mm=impl)
    # the fused row gather calls torch._grouped_mm itself: not with another implementation
    assert plan.grouped_mm is impl and layer.experts.grouped_mm is impl and not plan.regather_rows
    assert not plan.fp8_fused
    layer(torch.randn(2, 5, D)).sum().backward()
    # unless it offers the quantizing gather (the FP8 rowwise one, fused: lightning_moe.lowp.fp8_fused)
    fused = LowPrecisionGroupedMM("fp8_rowwise", emulate=True, name="experts")
    plan = layer.replan(grouped_mm=fused)
    assert plan.fp8_fused and plan.regather_rows
    assert not layer.replan(fuse_fp8_quant=False).fp8_fused
    impl = layer.replan(grouped_mm=impl).grouped_mm
    layer(torch.randn(2, 5, D)).sum().backward()
    # no per-expert loop fallback that would skip it: shapes it cannot take, and the loop, are errors
    experts = GroupedExperts(3, 6, 10, grouped_mm=LowPrecisionGroupedMM("fp8_rowwise", emulate=True))
    with pytest.raises(ValueError, match="no per-expert loop fallback.*keep_bf16"):
        experts(torch.randn(4, 6), torch.tensor([1, 2, 1]))
    experts.use_grouped_mm = False
    with pytest.raises(ValueError, match="use_grouped_mm=False"):
        experts(torch.randn(4, 6), torch.tensor([1, 2, 1]))
    loop = GroupedExperts(E, D, FF, use_grouped_mm=False)
    with pytest.raises(ValueError, match="use_grouped_mm=False"):
        loop.set_grouped_mm(impl)
    with pytest.raises(TypeError, match="GroupedMM"):
        loop.set_grouped_mm(torch._grouped_mm)
    assert type(loop.grouped_mm) is TorchGroupedMM  # a refused implementation changes nothing


def test_context_default_is_the_reference_path():
    ctx = DispatchContext(0, torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert ctx.weights_applied_by == "combine" and ctx.probs_R is None
