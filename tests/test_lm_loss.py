"""The output projection + cross-entropy paths against the reference (logits, then F.cross_entropy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.config import resolve_model_config
from lightning_moe.models.lm_loss import IGNORE_INDEX, linear_cross_entropy, resolve_loss_impl
from lightning_moe.models.transformer import MoETransformer


def _reference(h, w, labels):
    return F.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _inputs(N=37, D=24, V=101, dtype=torch.float32, ignore_every=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=dtype) * 0.3).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        labels[::ignore_every] = IGNORE_INDEX
    return h, w, labels


def _grads(fn, h, w, labels, scale=1.0):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 16, 37, 1000])
def test_chunked_matches_reference_loss_and_grads(chunk):
    h, w, labels = _inputs()
    scale = 1 / 29  # the pre-normalised step's 1/N reaches the stored gradients through backward
    ref = _grads(_reference, h, w, labels, scale)
    got = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, "chunked", chunk_tokens=chunk), h, w, labels, scale)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)


def test_chunked_all_ignored_and_no_grad():
    h, w, labels = _inputs(N=9)
    labels[:] = IGNORE_INDEX
    loss, gh, gw = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, "chunked", chunk_tokens=4), h, w, labels)
    assert loss.item() == 0.0
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
    h, w, labels = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy(h, w, labels, "chunked", chunk_tokens=8)
    torch.testing.assert_close(got, _reference(h, w, labels).detach(), rtol=1e-5, atol=1e-5)


def test_chunked_bf16_close_to_fp32_reference():
    h, w, labels = _inputs(N=64, D=32, V=300)
    ref = _grads(_reference, h, w, labels)
    got = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, "chunked", chunk_tokens=16),
                 h.to(torch.bfloat16), w.to(torch.bfloat16), labels)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=0)
    for r, o in zip(ref[1:], got[1:]):
        torch.testing.assert_close(o.float(), r, rtol=5e-2, atol=2e-2)


def test_chunked_under_autocast_runs_in_the_autocast_dtype():
    h, w, labels = _inputs(N=16, D=16, V=50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, labels, "chunked", chunk_tokens=5)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, _reference(h, w, labels), rtol=2e-2, atol=0)


def test_bad_impl_and_missing_backend_are_clear_errors():
    h, w, labels = _inputs(N=4)
    with pytest.raises(ValueError, match="loss_impl must be one of"):
        linear_cross_entropy(h, w, labels, "fast")
    with pytest.raises(ValueError, match="CUDA only|liger-kernel"):
        resolve_loss_impl("liger", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"h \[N, D\]"):
        linear_cross_entropy(h, w[:, :3], labels)
    assert resolve_loss_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_loss_impl("auto", torch.device("cuda")) == "chunked"


@pytest.mark.parametrize("tie", [False, True])
def test_model_forward_with_labels_equals_logits_loss(tie):
    cfg = resolve_model_config({"preset": "tiny", "tie_embeddings": tie})
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    model.init_weights()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    ref = F.cross_entropy(model(ids).flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="sum")
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got = model(ids, labels_BS=labels, loss_impl="chunked").loss_sum
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)
