"""Packed sequences: ``position_ids`` restarting at 0 per document make attention block-causal per document, RoPE
restart per document and no label predict across a boundary. The reference: each document run alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from _dist import run_distributed
from parallel_harness import DEEPSEEK_V3_MOE, DEEPSEEK_V3_TINY, compare, reference_state_dict, small_config, train
from lightning_moe.config import ModelConfig
from lightning_moe.data.collate import validate_batch
from lightning_moe.models.document_mask import DocumentMask, document_ids, resolve_attn_impl, varlen_segments
from lightning_moe.models.transformer import MoETransformer
from lightning_moe.module import shift_labels

ATTENTIONS = {
    "mha": dict(num_heads=4, num_kv_heads=4, qk_norm="none"),
    "gqa_qk_norm": dict(num_heads=4, num_kv_heads=2, qk_norm="head"),
    "mla": DEEPSEEK_V3_TINY,
}
S = 24
# two rows: three documents + trailing padding, and two documents filling the row
DOC_LENGTHS = ([7, 5, 9], [13, 11])


def _config(attention: str, **fields) -> ModelConfig:
    moe = DEEPSEEK_V3_MOE if attention == "mla" else {}
    return small_config({**ATTENTIONS[attention], **fields}, **moe)


def _model(cfg: ModelConfig) -> MoETransformer:
    model = MoETransformer(cfg)
    model.load_state_dict(reference_state_dict(cfg))
    return model


def _packed_batch(vocab: int, seed: int = 0):
    """(input_ids, attention_mask, position_ids) [2, S] and the documents [(row, start, ids)]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(2, S, dtype=torch.long)
    mask = torch.zeros(2, S, dtype=torch.long)
    pos = torch.zeros(2, S, dtype=torch.long)
    docs = []
    for b, lengths in enumerate(DOC_LENGTHS):
        start = 0
        for n in lengths:
            doc = torch.randint(0, vocab, (n,), generator=g)
            ids[b, start:start + n], mask[b, start:start + n] = doc, 1
            pos[b, start:start + n] = torch.arange(n)
            docs.append((b, start, doc))
            start += n
    return ids, mask, pos, docs


def _assert_rel(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5, what: str = "") -> None:
    err = float((got - want).norm() / want.norm().clamp(min=1e-12))
    assert err < rtol, f"{what}: rel err {err:.2e}"


# ---- the ids and the masks ---------------------------------------------------------------------------------------


def test_document_ids_and_dense_mask():
    pos = torch.tensor([[3, 4, 0, 1, 2, 0, 0, 0]])  # a fragment, a document, a one-token document, two pads
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]).bool()
    g = torch.arange(8)
    doc = document_ids(g, pos, valid)
    assert doc.tolist() == [[-3, -3, 2, 2, 2, 5, -7, -8]]  # start index of the document; pads -1 - index
    allowed = DocumentMask(doc, g, "sdpa").dense_B1SL[0, 0]
    for q in range(8):
        for k in range(8):
            want = k <= q and doc[0, q] == doc[0, k]
            assert bool(allowed[q, k]) == bool(want), (q, k)
    assert bool(allowed.diagonal().all())  # every row, padding included, attends to itself: finite


def test_varlen_segments():
    doc = torch.tensor([[0, 0, 0, 3, 3, -6, -7], [0, 0, 0, 0, 4, 4, 4]])
    cu, longest = varlen_segments(doc)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 7, 11, 14] and longest == 4


@pytest.mark.parametrize("heads", ["gqa", "mla_shared_key"])
def test_varlen_path_equals_sdpa(heads, monkeypatch):
    """The varlen path's layout work (flattening, the GQA repeat, MLA's shared key, cu_seqlens) against SDPA, with
    torch's CUDA-only varlen_attn replaced by a per-segment reference."""
    import torch.nn.attention.varlen as varlen

    def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and q.shape[1] == k.shape[1]
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2])
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*seg, is_causal=True, scale=scale).transpose(0, 1)
        return out

    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen)
    torch.manual_seed(0)
    B, H, G, K = 2, 4, (2 if heads == "gqa" else 4), 8
    P = 4 if heads == "mla_shared_key" else 0
    _, mask, pos, _ = _packed_batch(260)
    doc = document_ids(torch.arange(S), pos, mask.bool())
    # the model hands over [B, S, heads, K] tensors viewed as [B, heads, S, K]
    q = torch.randn(B, S, H, K + P).transpose(1, 2)
    k = torch.randn(B, S, G, K).transpose(1, 2)
    v = torch.randn(B, S, G, K + P).transpose(1, 2)  # one head dim for q, k (with the shared part) and v
    shared = torch.randn(B, S, 1, P).transpose(1, 2) if P else None
    ref = DocumentMask(doc, torch.arange(S), "sdpa").attend(q, k, v, 0.3, shared)
    got = DocumentMask(doc, torch.arange(S), "varlen").attend(q, k, v, 0.3, shared)
    real = mask.bool()[:, None, :, None].expand_as(ref)
    _assert_rel(got[real], ref[real], what="varlen vs sdpa")  # padding rows: each token alone in both, too
    _assert_rel(got, ref, what="all rows")


def test_attn_impl_choice_and_errors():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attn_impl("auto", cpu, True) == "sdpa"
    assert resolve_attn_impl("auto", cuda, True) == "varlen" and resolve_attn_impl("auto", cuda, False) == "flex"
    assert resolve_attn_impl("split", cpu, False) == "split"  # the causal kernel per document: any device
    with pytest.raises(ValueError, match="CUDA only"):
        resolve_attn_impl("varlen", cpu, True)
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        ModelConfig.from_preset("tiny", attn_impl="flash")
    with pytest.raises(ValueError, match="use 'flex'"):
        _config("mla", attn_impl="varlen")
    assert _config("mla").same_head_dims is False and _config("gqa_qk_norm").same_head_dims


# ---- one process: packed logits equal each document alone ----------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "flex", "split"])
@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_packed_logits_equal_each_document_alone(attention, impl):
    cfg = _config(attention, attn_impl=impl)
    model = _model(cfg).eval()
    ids, mask, pos, docs = _packed_batch(cfg.vocab_size)
    with torch.no_grad():  # torch's flex attention has no CPU backward
        packed = model(ids, mask, position_ids_BS=pos)
        unpacked = model(ids, mask)
        for b, start, doc in docs:
            alone = model(doc[None])[0]
            _assert_rel(packed[b, start:start + len(doc)], alone, what=f"{attention} {impl} document at {b},{start}")
    # without position_ids attention crosses the documents: the later documents' logits differ
    b, start, doc = docs[1]
    assert (unpacked[b, start:start + len(doc)] - packed[b, start:start + len(doc)]).abs().max() > 1e-3


def _packed_loss_and_grads(model, ids, mask, pos, labels):
    model.zero_grad()
    loss = model(ids, mask, labels_BS=labels, position_ids_BS=pos, loss_impl="torch").loss_sum
    loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", ["sdpa", "split"])
@pytest.mark.parametrize("attention", ["gqa_qk_norm", "mla"])
def test_packed_loss_and_gradients_equal_the_documents_alone(attention, impl):
    """The packed loss sum and its gradients equal the sum over documents run alone: labels of documents' last
    tokens are dropped (shift_labels with position_ids), so nothing predicts the next document's first token."""
    cfg = _config(attention, attn_impl=impl)
    model = _model(cfg)
    ids, mask, pos, docs = _packed_batch(cfg.vocab_size, seed=1)
    labels = shift_labels(ids, mask, pos)
    for b, start, doc in docs:
        assert labels[b, start + len(doc) - 1] == -100  # the document's last token predicts nothing
    loss, grads = _packed_loss_and_grads(model, ids, mask, pos, labels)
    model.zero_grad()
    ref = sum(model(doc[None], labels_BS=shift_labels(doc[None]), loss_impl="torch").loss_sum for _, _, doc in docs)
    ref.backward()
    _assert_rel(loss, ref.detach(), what="loss")
    for n, p in model.named_parameters():
        if p.grad is not None and "router" not in n:  # the routers' aux losses are not part of the LM loss sum
            _assert_rel(grads[n], p.grad, rtol=1e-4, what=f"grad {n}")


@pytest.mark.parametrize("impl", ["sdpa", "split"])
def test_recomputation_options_keep_packed_gradients(impl):
    """Recomputation leaves the packed loss and gradients as they are; "split" holds its windows' graphs outside
    the checkpoints' saved-tensor hooks (a nested backward per window would re-run a region once each)."""
    from lightning_moe.parallel.parallelize import apply_ac
    from lightning_moe.parallel.recompute import apply_recompute

    cfg = _config("mla", attn_impl=impl)
    ids, mask, pos, _ = _packed_batch(cfg.vocab_size, seed=2)
    labels = shift_labels(ids, mask, pos)
    base_loss, base = _packed_loss_and_grads(_model(cfg), ids, mask, pos, labels)
    for kinds in (["attn_core", "norm", "mla_up_proj"], "full"):
        model = _model(cfg)
        if kinds == "full":
            apply_ac(model, "full")
        else:
            apply_recompute(model, kinds)
        loss, grads = _packed_loss_and_grads(model, ids, mask, pos, labels)
        assert torch.equal(loss, base_loss), kinds
        for n, g in base.items():
            assert torch.allclose(grads[n], g, rtol=1e-6, atol=1e-7), (kinds, n)


# ---- the batch contract ------------------------------------------------------------------------------------------


def test_batch_contract_errors():
    ids = torch.randint(0, 200, (1, 8))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    validate_batch({"input_ids": ids, "position_ids": pos}, 260, 16)
    with pytest.raises(ValueError, match="goes from 2 to 4 at index 3"):
        validate_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 4, 5, 6, 7, 8]])})
    with pytest.raises(ValueError, match="max_seq_len=8"):
        validate_batch({"input_ids": ids, "position_ids": pos + 4}, 260, 8)
    with pytest.raises(ValueError, match="shape"):
        validate_batch({"input_ids": ids, "position_ids": pos[0]})
    # transformers' DataCollatorWithFlattening: unshifted labels (each equal to its own input) are refused
    hf_labels = ids.clone()
    hf_labels[0, [0, 3]] = -100
    with pytest.raises(ValueError, match="unshifted"):
        validate_batch({"input_ids": ids, "labels": hf_labels, "position_ids": pos})
    # shifted as the message says, they are accepted and equal what the module derives itself
    ours = torch.full_like(hf_labels, -100)
    ours[:, :-1] = hf_labels[:, 1:]
    validate_batch({"input_ids": ids, "labels": ours, "position_ids": pos})
    assert torch.equal(ours, shift_labels(ids, None, pos))


def test_module_refuses_hf_collator_batches_and_trains_on_packed_ones():
    import lightning as L
    from transformers import DataCollatorWithFlattening

    from lightning_moe import MoELanguageModel

    cfg = _config("gqa_qk_norm")
    g = torch.Generator().manual_seed(0)
    features = [{"input_ids": torch.randint(0, 260, (n,), generator=g).tolist()} for n in (5, 9, 7, 11)]
    hf_batch = DataCollatorWithFlattening()(features)  # [1, 32]: labels unshifted, position_ids restarting

    class Data(L.LightningDataModule):
        def __init__(self, drop_labels: bool) -> None:
            super().__init__()
            self.drop_labels = drop_labels

        def train_dataloader(self):
            batch = {k: v for k, v in hf_batch.items() if not (self.drop_labels and k == "labels")}
            return torch.utils.data.DataLoader([batch] * 4, batch_size=None)

    def fit(drop_labels: bool) -> MoELanguageModel:
        module = MoELanguageModel(cfg, lr=1e-2, warmup_steps=0)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            num_sanity_val_steps=0)
        trainer.fit(module, Data(drop_labels))
        return module

    with pytest.raises(ValueError, match="unshifted"):
        fit(drop_labels=False)
    module = fit(drop_labels=True)
    # the step's token count excludes each document's last token: 32 tokens, 4 documents
    assert float(module.step_result.num_tokens) == 32 - 4
    with torch.no_grad():
        logits = module(hf_batch["input_ids"], position_ids=hf_batch["position_ids"])
        first = module(hf_batch["input_ids"][:, :5])
    _assert_rel(logits[:, :5], first, what="the first document alone")


# ---- layouts: tp=2, ep=2, cp=2 ---------------------------------------------------------------------------------------


def _layout_logits_worker(rank: int, world_size: int) -> str:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lightning_moe.build import build_model
    from lightning_moe.parallel import ParallelDims, parallelize

    failures = []
    for sizes in (dict(tp=2), dict(ep=2), dict(tp=2, ep=2)):
        dims = ParallelDims(world_size=world_size, dp_shard=1 if "tp" in sizes else -1, **sizes).build_meshes("cpu")
        for attention, impl in (("gqa_qk_norm", "auto"), ("mla", "auto"), ("gqa_qk_norm", "split"), ("mla", "split")):
            cfg = _config(attention, attn_impl=impl)
            weights = reference_state_dict(cfg)

            def load(model):
                set_model_state_dict(model, copy.copy(weights), options=StateDictOptions(full_state_dict=True))
                model.reset_buffers()

            model = build_model(cfg, initialize=load, parallelize=lambda m: (parallelize(m, dims), m)[1]).eval()
            ref = _model(cfg).eval()
            ids, mask, pos, docs = _packed_batch(cfg.vocab_size, seed=3)  # the same batch on every rank
            with torch.no_grad():
                packed = model(ids, mask, position_ids_BS=pos)
                for b, start, doc in docs:
                    alone = ref(doc[None])[0]
                    got = packed[b, start:start + len(doc)]
                    err = float((got - alone).norm() / alone.norm())
                    if err > 1e-5:
                        failures.append(f"{sizes} {attention} {impl} document {b},{start}: rel err {err:.2e}")
    assert not failures, "\n".join(failures)
    return "ok"


def test_packed_logits_equal_each_document_alone_under_tp2_and_ep2():
    assert run_distributed(_layout_logits_worker, 2) == "ok"


PACKED_LAYOUTS = {
    "tp=2 ep=2": dict(tp=2, ep=2, dp_shard=1),
    "cp=2 ep=2": dict(cp=2, ep=2, dp_shard=1),
    "ep=2 folded over dp": dict(ep=2),
}


# The harness's SGD step of 0.5 makes this packed trajectory ill-conditioned: perturbing one process's initial weights
# by 2e-7 (relative) moved its final weights by 3.4e-5 (unpacked: 1.0e-6); at 0.2 by 6.8e-7, so layouts compare at 1e-5.
PACKED_LR = 0.2


def _packed_training_worker(rank: int, world_size: int) -> dict:
    return {name: train(layout, world_size, packed=True, model=DEEPSEEK_V3_TINY if "cp" in name else None,
                        lr=PACKED_LR) for name, layout in PACKED_LAYOUTS.items()}


def test_packed_training_matches_one_process_under_layouts():
    """Three SGD steps on packed batches (harness PACK_PATTERNS) give one process's losses and weights under tp,
    ep and cp (MLA under cp)."""
    results = run_distributed(_packed_training_worker, 2, timeout=600)
    refs = {False: train(None, 1, packed=True, lr=PACKED_LR),
            True: train(None, 1, packed=True, model=DEEPSEEK_V3_TINY, lr=PACKED_LR)}
    unpacked = train(None, 1, lr=PACKED_LR)
    assert refs[False]["losses"][0] > refs[False]["losses"][-1], "the packed reference should learn"
    assert abs(refs[False]["losses"][0] - unpacked["losses"][0]) > 1e-4, "packing changed nothing"
    failures = [f"[{name}] " + "; ".join(problems[:6]) for name, res in results.items()
                if (problems := compare(res, refs["cp" in name]))]
    assert not failures, "\n".join(failures)
