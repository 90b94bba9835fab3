"""attn_impl='cudnn' (cuDNN's ragged flash attention, lightning_moe.models.cudnn_ragged): on this CPU the ATen op
is replaced by a per-segment SDPA reference that checks its calling contract, so what is tested is everything
around the kernel: the [T, H, K] layouts, GQA's repeat, MLA's shared key part and different v head dim, the
segments, the backward through the op, and the forward's loss and gradients against the SDPA reference with
its explicit block-causal mask. The kernel itself is checked on the H200 by ``python -m bench doc_mask`` (its kernel
checks) and ``.gpu``'s cudnn_micro (bench/RESULTS.md, issue 22)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_moe.models.cudnn_ragged as cr
import lightning_moe.models.document_mask as dm
from test_document_mask_segments import _batch, _config, _loss_and_grads, _model, _rel, no_host_reads
from lightning_moe.models.document_mask import DocumentMask, document_ids, document_segments, resolve_attn_impl

CALLS: list[str] = []


def _segments_attention(q, k, v, cu, scale):
    bounds = cu.tolist()
    return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                                     scale=scale).transpose(0, 1)
                      for a, b in zip(bounds[:-1], bounds[1:])])


def fake_forward(q, k, v, bias, cu_q, cu_k, max_q, max_k, lse, dropout, causal, debug, *, scale=None):
    """The op's contract (differentiable here through SDPA, as ATen's derivative makes the real one)."""
    assert bias is None and cu_q is cu_k and cu_q.dtype == torch.int32 and lse and dropout == 0.0 and causal
    assert not debug and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[-1] == k.shape[-1]
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    assert cu_q[0] == 0 and cu_q[-1] == q.shape[0] and max_q == max_k >= max(lengths)
    CALLS.append("fwd")
    o = _segments_attention(q, k, v, cu_q, scale)
    seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    return o, torch.zeros(q.shape[1], q.shape[0]), cu_q, cu_k, max_q, max_k, seed, offset, torch.empty(0)


@pytest.fixture
def cpu_cudnn(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(cr, "_forward_op", lambda: fake_forward)
    real = dm.resolve_attn_impl
    monkeypatch.setattr(dm, "resolve_attn_impl", lambda impl, device, same: impl if impl == "cudnn" else
                        real(impl, device, same))


def test_cudnn_is_cuda_only_and_a_config_choice():
    with pytest.raises(ValueError, match="CUDA only"):
        resolve_attn_impl("cudnn", torch.device("cpu"), True)
    assert _config("mla", "cudnn").attn_impl == "cudnn"  # MLA's head dims are fine for cuDNN (not for varlen)


def test_one_ragged_call_over_the_whole_batch(cpu_cudnn):
    _, mask, pos = _batch(260)
    S = pos.shape[1]
    seg = document_segments(pos, mask)
    doc = document_ids(torch.arange(S), pos, mask.bool())
    m = DocumentMask(doc, torch.arange(S), "cudnn", seg)
    assert m.row_runs == [(0, 4, "cudnn")] and m.cu_seqlens is not None and m.max_len == seg.max_seqlen
    single = document_segments(torch.arange(S).repeat(2, 1))
    assert DocumentMask(doc[:2] * 0, torch.arange(S), "cudnn", single).row_runs == [(0, 2, "causal")]
    q, k, v = torch.randn(4, 4, S, 8), torch.randn(4, 2, S, 8), torch.randn(4, 2, S, 6)
    o = m.attend(q, k, v, None)
    ref = DocumentMask(doc, torch.arange(S), "sdpa").attend(q, k, v, None)
    valid = mask.bool()[:, None, :, None].expand_as(ref)
    assert o.shape == (4, 4, S, 6) and torch.allclose(o[valid], ref[valid], atol=1e-5) and CALLS == ["fwd"]


@pytest.mark.parametrize("attention", ["mha", "gqa", "mla"])
def test_cudnn_equals_the_sdpa_reference(attention, cpu_cudnn):
    ids, mask, pos = _batch(260, seed=1)
    ref_loss, ref_grads = _loss_and_grads(_model(_config(attention, "sdpa")), ids, mask, pos, None)
    model = _model(_config(attention, "cudnn"))
    for seg in (document_segments(pos, mask), None):  # the host's structure, and the device path
        CALLS.clear()
        loss, grads = _loss_and_grads(model, ids, mask, pos, seg)
        assert CALLS.count("fwd") == model.config.num_layers
        assert _rel(loss, ref_loss) < 1e-5
        for n, g in ref_grads.items():
            assert _rel(grads[n], g) < 1e-4, (n, seg is None)


def test_cudnn_forward_reads_nothing_back_with_segments(cpu_cudnn):
    model = _model(_config("gqa", "cudnn"))
    ids, _, pos = _batch(model.config.vocab_size)
    seg = document_segments(pos)
    fwd = fake_forward

    def unguarded(*args, **kwargs):  # the stand-in kernel reads its segments; the real one runs on the device
        with pytest.MonkeyPatch.context() as mp:
            for n in ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__"):
                mp.setattr(torch.Tensor, n, _REAL[n])
            return fwd(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cr, "_forward_op", lambda: unguarded)
        with no_host_reads():
            out = model(ids, position_ids_BS=pos, document_segments=seg)
    assert torch.isfinite(out.logits if hasattr(out, "logits") else out).all()


_REAL = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__",
                                                 "__float__")}
