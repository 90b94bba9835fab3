"""attn_impl="split": the plain causal kernel once per document, on bucket-length windows of the flattened tokens
(models/document_windows.py), against SDPA with the explicit block-causal mask (forward and every input gradient,
float64), and the per-batch "auto" choice."""

from __future__ import annotations

import pytest
import torch

import lightning_moe.models.document_mask as dm
import lightning_moe.models.document_windows as dw
from lightning_moe.models.document_mask import DocumentMask, document_ids, document_segments
from lightning_moe.models.document_windows import WindowPlan, prefer_windows, window_length, window_lengths

pytestmark = pytest.mark.quick


def test_window_lengths_are_few_short_and_cover_their_documents():
    for S in (24, 512, 4096, 16384):
        buckets = window_lengths(S)
        assert len(buckets) <= 16 + 16 * max(0, (S // 2048).bit_length()) + 1, (S, len(buckets))
        assert max(buckets) == S
        for n in range(2, S + 1, 7):
            w = window_length(n, S)
            assert n <= w <= S and w in buckets
            assert w - n < max(dw.MIN_STEP, n / 16 + 1), (n, w)  # at most one step longer
    assert len(window_lengths(4096)) == 32 and len(window_lengths(16384)) == 64


def test_plan_covers_every_token_once():
    plan = WindowPlan.from_lengths([100, 1, 1, 150, 70, 1, 200, 117, 1], 320)
    covered = torch.zeros(plan.total, dtype=torch.long)
    for start, n, w in plan.windows:
        covered[start:start + n] += 1
        assert w == window_length(n, 320)
    for a, b in plan.singles:
        covered[a:b] += 1
    assert covered.eq(1).all() and plan.singles == ((100, 102), (322, 323), (640, 641)) and plan.total == 641
    with pytest.raises(ValueError, match="cannot lie in a row"):
        WindowPlan.from_lengths([321], 320)


ROWS = ([100, 150, 70], [1, 1, 200, 116, "pad2"])  # windows cross rows, the last one runs past the end (padded)
S = 320


def _batch():
    B = len(ROWS)
    pos = torch.zeros(B, S, dtype=torch.long)
    mask = torch.ones(B, S, dtype=torch.long)
    for b, row in enumerate(ROWS):
        start = 0
        for n in row:
            if n == "pad2":
                mask[b, start:] = 0
            else:
                pos[b, start:start + n] = torch.arange(n)
                start += n
    return pos, mask


@pytest.mark.parametrize("heads", ["mha", "gqa", "mla_shared_key"])
def test_split_equals_the_sdpa_reference_with_gradients(heads):
    torch.manual_seed(0)
    pos, mask = _batch()
    B, H = pos.shape[0], 4
    G = 2 if heads == "gqa" else H
    K, P, V = 16, (8 if heads == "mla_shared_key" else 0), (12 if heads == "mla_shared_key" else 16)
    doc = document_ids(torch.arange(S), pos, mask.bool())
    seg = document_segments(pos, mask)

    def leaf(*shape):  # the model hands over [B, S, heads, K] tensors viewed as [B, heads, S, K]
        return torch.randn(B, S, *shape, dtype=torch.float64).transpose(1, 2).requires_grad_()

    q, k, v = leaf(H, K + P), leaf(G, K), leaf(G, V)
    shared = leaf(1, P) if P else None
    inputs = [t for t in (q, k, v, shared) if t is not None]

    def run(impl, segments):
        for t in inputs:
            t.grad = None
        mask_ = DocumentMask(doc, torch.arange(S), impl, segments)
        o = mask_.attend(q, k, v, 0.3, shared)
        weights = torch.sin(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)
        (o * weights).sum().backward()
        return mask_, o.detach(), [t.grad.clone() for t in inputs]

    _, ref_o, ref_g = run("sdpa", None)
    for segments in (seg, None):  # the collate's host structure, and the device path
        m, o, grads = run("split", segments)
        assert m.window_plan is not None and len(m.window_plan.windows) == 5 and m.window_plan.singles
        assert any(s + w > B * S for s, _, w in m.window_plan.windows)  # the padded last window
        assert (o - ref_o).abs().max() < 1e-12
        for g, r in zip(grads, ref_g):
            assert (g - r).abs().max() < 1e-12
    with torch.no_grad():
        o = DocumentMask(doc, torch.arange(S), "split", seg).attend(q, k, v, 0.3, shared)
    assert (o - ref_o).abs().max() < 1e-12


def test_split_takes_the_causal_kernel_for_single_document_rows(monkeypatch):
    pos = torch.arange(S).repeat(2, 1)
    doc = document_ids(torch.arange(S), pos)
    for segments in (document_segments(pos), None):
        m = DocumentMask(doc, torch.arange(S), "split", segments)
        assert m.row_runs == [(0, 2, "causal")] and m.window_plan is None


def test_auto_takes_split_for_few_long_documents_only(monkeypatch):
    """On CUDA "auto" resolves to varlen / flex and takes split per batch (the device faked through the resolver)."""
    assert prefer_windows([4096, 3000, 1096, 1, 1]) and not prefer_windows([200] * 20)
    assert not prefer_windows([1, 1]) and not prefer_windows([2048] * 65)
    monkeypatch.setattr(dm, "resolve_attn_impl", lambda impl, device, same: "varlen" if impl == "auto" else impl)
    long_pos = torch.cat([torch.arange(1500), torch.arange(2596)]).repeat(2, 1)
    short_pos = torch.arange(256).repeat(16)[None].repeat(2, 1)
    for pos, want in ((long_pos, "split"), (short_pos, "varlen")):
        S_ = pos.shape[1]
        doc = document_ids(torch.arange(S_), pos)
        built = DocumentMask.build(doc, torch.arange(S_), "auto", True, document_segments(pos))
        assert built.impl == want
    doc = document_ids(torch.arange(4096), long_pos)
    kept = DocumentMask.build(doc, torch.arange(4096), "auto", True, document_segments(long_pos), windows=False)
    assert kept.impl == "varlen"  # a model that recomputes or offloads: never the windows
    assert DocumentMask.build(doc, torch.arange(4096), "split", True).impl == "split"  # explicit: always


def test_a_model_that_recomputes_or_offloads_says_so():
    from parallel_harness import small_config

    from lightning_moe.models.transformer import MoETransformer
    from lightning_moe.parallel.recompute import apply_recompute

    model = MoETransformer(small_config({}))
    assert not model._plans_activations()
    apply_recompute(model, ["attn_core"])
    assert model._plans_activations()


def test_warming_runs_nothing_off_cuda(monkeypatch):
    ran = []
    monkeypatch.setattr(dw, "_sdpa_window", lambda *a: ran.append(a) or pytest.fail("ran on the CPU"))
    dw.warm_window_plans(512, 4, 2, 16, 16, torch.float32, torch.device("cpu"), None, True)
    assert not ran


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_every_window_has_the_warmed_layout(attention, monkeypatch):
    """The kernel's plan cache keys on strides: every window (views and the padded last one) must have the layout of
    the contiguous tensors warm_window_plans runs, also for MLA, whose v is a strided slice of a projection."""
    from parallel_harness import DEEPSEEK_V3_MOE, DEEPSEEK_V3_TINY, small_config

    from lightning_moe.models.transformer import MoETransformer

    fields = DEEPSEEK_V3_TINY if attention == "mla" else dict(num_heads=4, num_kv_heads=2)
    cfg = small_config({**fields, "attn_impl": "split", "max_seq_len": 64}, **(DEEPSEEK_V3_MOE if attention == "mla"
                                                                              else {}))
    model = MoETransformer(cfg)
    model.init_weights()
    seen = []
    window = dw._sdpa_window

    def spy(*args):
        seen.append([(tuple(t.shape), t.stride()) for t in args[:3]])
        return window(*args)

    monkeypatch.setattr(dw, "_sdpa_window", spy)
    pos = torch.cat([torch.arange(40), torch.arange(24)]).repeat(2, 1)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    model(ids, position_ids_BS=pos, document_segments=document_segments(pos)).float().sum().backward()
    assert seen
    for shapes in seen:
        for shape, stride in shapes:
            assert stride == torch.empty(shape).stride(), (shape, stride)


def test_split_inside_compiled_attention_matches_eager():
    """Regional torch.compile (the attention module compiled whole): the windows run eagerly behind one graph
    break, for batches of different plans, with the eager model's loss and gradients."""
    import copy

    from parallel_harness import small_config

    from lightning_moe.models.transformer import MoETransformer
    from lightning_moe.module import shift_labels
    from lightning_moe.parallel.compile import apply_compile

    torch._dynamo.reset()
    cfg = small_config({"num_heads": 4, "num_kv_heads": 2, "attn_impl": "split", "max_seq_len": 64})
    ref = MoETransformer(cfg)
    ref.init_weights()
    comp = copy.deepcopy(ref)
    apply_compile(comp, ["attention"], backend="eager")
    for cut in (40, 17, 51):  # three plans
        pos = torch.cat([torch.arange(cut), torch.arange(64 - cut)]).repeat(2, 1)
        ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(cut))
        labels = shift_labels(ids, None, pos)
        grads = []
        for m in (ref, comp):
            m.zero_grad()
            out = m(ids, labels_BS=labels, position_ids_BS=pos, document_segments=document_segments(pos),
                    loss_impl="torch")
            out.loss_sum.backward()
            grads.append((out.loss_sum.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]))
        torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)
        for a, b in zip(grads[1][1], grads[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
