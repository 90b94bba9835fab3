"""Packed batches with their document structure computed on the host (``DocumentSegments``, from the collate): the
forward reads nothing back from the device, builds one DocumentMask for all layers, runs single-document rows through
the plain causal kernel, and equals the SDPA reference with its explicit mask (MHA, GQA, MLA; one process, tp=2,
ep=2). torch's CUDA-only ``varlen_attn`` is replaced by a per-segment SDPA reference on this CPU."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import lightning_moe.models.document_mask as dm
from _dist import run_distributed
from parallel_harness import DEEPSEEK_V3_MOE, DEEPSEEK_V3_TINY, reference_state_dict, small_config
from lightning_moe.data.collate import collate, validate_batch
from lightning_moe.models.document_mask import DocumentMask, DocumentSegments, document_ids, document_segments
from lightning_moe.models.transformer import MoETransformer
from lightning_moe.module import shift_labels

ATTENTIONS = {
    "mha": dict(num_heads=4, num_kv_heads=4, qk_norm="none"),
    "gqa": dict(num_heads=4, num_kv_heads=2, qk_norm="head"),
    "mla": DEEPSEEK_V3_TINY,
}
S = 24
# rows: three documents + trailing padding; one document; two documents; one document (a fragment: positions from 5)
ROWS = ([7, 5, 9, "pad3"], [24], [13, 11], ["from5"])
_tolist = torch.Tensor.tolist  # the reference kernel reads cu_seqlens outside the no-sync guard's patches


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B = len(ROWS)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    pos = torch.zeros(B, S, dtype=torch.long)
    for b, row in enumerate(ROWS):
        start = 0
        for n in row:
            if n == "pad3":
                mask[b, start:] = 0
            elif n == "from5":
                pos[b] = torch.arange(5, 5 + S)
            else:
                pos[b, start:start + n] = torch.arange(n)
                start += n
    return ids, mask, pos


def _config(attention: str, impl: str):
    moe = DEEPSEEK_V3_MOE if attention == "mla" else {}
    return small_config({**ATTENTIONS[attention], "attn_impl": impl, "max_seq_len": 32}, **moe)


def _model(cfg) -> MoETransformer:
    model = MoETransformer(cfg)
    model.load_state_dict(reference_state_dict(cfg))
    return model


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch's varlen_attn contract, per segment through SDPA (differentiable)."""
    assert window_size == (-1, 0) and cu_q is cu_k and cu_q.dtype == torch.int32
    cu = _tolist(cu_q)
    assert cu[0] == 0 and cu[-1] == q.shape[0] and max_q == max_k >= max(b - a for a, b in zip(cu[:-1], cu[1:]))
    assert enable_gqa or k.shape[1] == q.shape[1]
    outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale,
                                           enable_gqa=enable_gqa).transpose(0, 1) for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(outs)


@pytest.fixture
def cpu_varlen(monkeypatch):
    """attn_impl='varlen' on this CPU: the reference kernel, and the impl check let through."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen)
    real = dm.resolve_attn_impl
    monkeypatch.setattr(dm, "resolve_attn_impl", lambda impl, device, same: impl if impl == "varlen" else
                        real(impl, device, same))


@contextlib.contextmanager
def no_host_reads():
    """Fails on any read of a tensor's values into Python (what syncs a CUDA stream: item, tolist, nonzero, bool,
    int, float, index)."""
    names = ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def f(*_, **__):
            raise AssertionError(f"host read Tensor.{name} in the forward")
        return f

    for n in names:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


# ---- the structure ---------------------------------------------------------------------------------------------------


def test_document_segments_match_the_device_path():
    _, mask, pos = _batch(260)
    seg = document_segments(pos, mask)
    cu, longest = dm.varlen_segments(document_ids(torch.arange(S), pos, mask.bool()))
    assert seg.cu_seqlens.tolist() == cu.tolist() and seg.max_seqlen == longest == S
    assert seg.row_segments == (6, 1, 2, 1)  # three documents and three padding tokens; one; two; one fragment
    lengths = (seg.cu_seqlens[1:] - seg.cu_seqlens[:-1]).tolist()
    assert lengths == [7, 5, 9, 1, 1, 1, 24, 13, 11, 24]


def test_collate_carries_segments_and_validation_refuses_wrong_ones():
    ids, mask, pos = _batch(260)
    batch = collate([{"input_ids": i, "position_ids": p, "attention_mask": m} for i, p, m in zip(ids, pos, mask)])
    got, want = batch["document_segments"], document_segments(pos, mask)
    assert torch.equal(got.cu_seqlens, want.cu_seqlens) and (got.max_seqlen, got.row_segments) == (
        want.max_seqlen, want.row_segments)
    assert "document_segments" not in collate([{"input_ids": i} for i in ids])
    validate_batch(batch)
    wrong = dict(batch, document_segments=document_segments(pos.flip(0), mask.flip(0)))  # another batch's rows
    with pytest.raises(ValueError, match="do not match"):
        validate_batch(wrong)
    with pytest.raises(ValueError, match="needs their position_ids"):
        validate_batch({"input_ids": ids, "document_segments": batch["document_segments"]})


def test_row_runs():
    _, mask, pos = _batch(260)
    doc = document_ids(torch.arange(S), pos, mask.bool())
    seg = document_segments(pos, mask)
    assert DocumentMask(doc, torch.arange(S), "varlen", seg).row_runs == [
        (0, 1, "varlen"), (1, 2, "causal"), (2, 3, "varlen"), (3, 4, "causal")]
    assert DocumentMask(doc, torch.arange(S), "sdpa", seg).row_runs == [(0, 4, "sdpa")]  # the reference
    one = DocumentMask(doc[1::2], torch.arange(S), "flex", DocumentSegments(seg.cu_seqlens[:3], S, (1, 1)))
    assert one.row_runs == [(0, 2, "causal")] and one.block_mask is None  # no mask built at all
    assert DocumentMask(doc, torch.arange(S), "flex", seg).row_runs == [(0, 4, "flex")]  # flex: whole batches only


# ---- the forward: no host reads, one mask, the reference's numbers ---------------------------------------------------


def test_forward_with_segments_reads_nothing_back_and_builds_one_mask(cpu_varlen, monkeypatch):
    cfg = _config("gqa", "varlen")
    model = _model(cfg)
    ids, _, pos = _batch(cfg.vocab_size)
    seg = document_segments(pos)
    built = []
    init = DocumentMask.__init__

    def counting_init(self, *args, **kwargs):
        built.append(args[3] if len(args) >= 4 else kwargs.get("segments"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(DocumentMask, "__init__", counting_init)
    device_path = dm.varlen_segments
    monkeypatch.setattr(dm, "varlen_segments", lambda *_: pytest.fail("the device path ran despite the segments"))
    labels = shift_labels(ids, None, pos)
    with no_host_reads():
        loss = model(ids, labels_BS=labels, position_ids_BS=pos, document_segments=seg, loss_impl="torch").loss_sum
        loss.backward()
    assert len(built) == 1 and built[0] is seg  # one DocumentMask for all layers, built from the host's structure
    monkeypatch.setattr(dm, "varlen_segments", device_path)
    with pytest.raises(AssertionError, match="host read"):  # the guard does catch the device path's reads
        with no_host_reads():
            init(DocumentMask.__new__(DocumentMask), document_ids(torch.arange(S), pos), torch.arange(S), "varlen")


def _loss_and_grads(model, ids, mask, pos, seg):
    model.zero_grad()
    loss = model(ids, mask, labels_BS=shift_labels(ids, mask, pos), position_ids_BS=pos, document_segments=seg,
                 loss_impl="torch").loss_sum
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(got, want):
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


@pytest.mark.parametrize("attention", ["mha", "gqa"])
def test_varlen_rows_and_causal_rows_equal_the_sdpa_reference(attention, cpu_varlen):
    """Loss and every gradient of the varlen/causal row split against SDPA with the explicit block-causal mask."""
    ids, mask, pos = _batch(260, seed=1)
    ref_model = _model(_config(attention, "sdpa"))
    ref_loss, ref_grads = _loss_and_grads(ref_model, ids, mask, pos, None)
    model = _model(_config(attention, "varlen"))
    for seg in (document_segments(pos, mask), None):  # the host's structure, and the device path
        loss, grads = _loss_and_grads(model, ids, mask, pos, seg)
        assert _rel(loss, ref_loss) < 1e-5, seg
        for n, g in ref_grads.items():
            assert _rel(grads[n], g) < 1e-4, (n, seg is None)


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_flex_and_the_causal_shortcut_equal_the_sdpa_reference(attention):
    """Forward (torch's flex has no CPU backward): a mixed batch through flex, and a batch of one document per row
    through the plain causal kernel, against the reference."""
    ids, mask, pos = _batch(260, seed=2)
    ref, fast = _model(_config(attention, "sdpa")).eval(), _model(_config(attention, "flex")).eval()
    single = [1, 3]
    with torch.no_grad():
        for rows in (slice(None), single):
            i, m, p = ids[rows], mask[rows], pos[rows]
            seg = document_segments(p, m)
            want = ref(i, m, position_ids_BS=p)
            got = fast(i, m, position_ids_BS=p, document_segments=seg)
            assert _rel(got, want) < 1e-5, rows


def test_datamodule_batches_reach_the_model_with_their_segments(monkeypatch):
    """Through Lightning: TextDataModule(document_mask=True) batches carry document_segments, moved with the batch
    and handed to the model's DocumentMask (the first training batch checked against its position_ids)."""
    import lightning as L

    from lightning_moe import MoELanguageModel
    from lightning_moe.data import TextDataModule

    seen = []
    init = DocumentMask.__init__

    def recording_init(self, doc_BS, positions_S, impl, segments=None, lengths=None):
        seen.append(segments)
        init(self, doc_BS, positions_S, impl, segments, lengths)

    monkeypatch.setattr(DocumentMask, "__init__", recording_init)
    cfg = small_config({"max_seq_len": 64})
    data = TextDataModule(seq_len=64, batch_size=2, document_mask=True, max_tokens=20_000, val_fraction=0.0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(MoELanguageModel(cfg, lr=1e-3, warmup_steps=0), data)
    assert len(seen) == 2 and all(isinstance(s, DocumentSegments) and len(s.row_segments) == 2 for s in seen)


# ---- layouts: tp=2, ep=2 ---------------------------------------------------------------------------------------------


def _layout_worker(rank: int, world_size: int) -> str:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lightning_moe.build import build_model
    from lightning_moe.parallel import ParallelDims, parallelize

    failures = []
    ids, mask, pos = _batch(260, seed=3)  # the same batch on every rank
    for sizes in (dict(tp=2), dict(ep=2)):
        dims = ParallelDims(world_size=world_size, dp_shard=1 if "tp" in sizes else -1, **sizes).build_meshes("cpu")
        for attention in ("gqa", "mla"):
            cfg = _config(attention, "flex")
            weights = reference_state_dict(cfg)

            def load(model):
                set_model_state_dict(model, copy.copy(weights), options=StateDictOptions(full_state_dict=True))
                model.reset_buffers()

            model = build_model(cfg, initialize=load, parallelize=lambda m: (parallelize(m, dims), m)[1]).eval()
            ref = _model(_config(attention, "sdpa")).eval()
            with torch.no_grad():
                for rows in (slice(None), [1, 3]):  # flex's block mask; the causal shortcut
                    i, m, p = ids[rows], mask[rows], pos[rows]
                    got = model(i, m, position_ids_BS=p, document_segments=document_segments(p, m))
                    err = _rel(got, ref(i, m, position_ids_BS=p))
                    if err > 1e-5:
                        failures.append(f"{sizes} {attention} rows {rows}: rel err {err:.2e}")
    assert not failures, "\n".join(failures)
    return "ok"


def test_segments_under_tp2_and_ep2():
    assert run_distributed(_layout_worker, 2) == "ok"
