"""Tests of lightning_moe.data: byte tokenizer, packing, split, sampling, file reading, bad input.

One piece (540 lines): the tests of one package's user contract (lightning_moe.data), sharing its corpus fixtures."""

from __future__ import annotations

import json
import math
import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_moe.data import ByteTokenizer, TextDataModule
from lightning_moe.data.corpus import EMBEDDED_CORPUS_MAX_BYTES, embedded_corpus_documents

EOS = ByteTokenizer.EOS


# ---------------------------------------------------------------------------- helpers
def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture
def small_corpus(tmp_path):
    """Three documents, ~6k bytes in all, as .txt files in a directory."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(3):
        _write(d / f"doc{i}.txt", "".join(f"document {i} line {j}: the quick brown fox\n" for j in range(50)))
    return str(d)


@pytest.fixture(scope="module")
def embedded_dm():
    dm = TextDataModule(seq_len=128, batch_size=4)
    t0 = time.perf_counter()
    dm.setup("fit")
    dm.setup_seconds = time.perf_counter() - t0
    return dm


def _sample_starts(loader):
    """Token offsets of the windows a loader yields, as a list (identifies samples)."""
    ds = loader.dataset
    return [(ds.first + i) * ds.seq_len for i in loader.sampler]


# ---------------------------------------------------------------------------- tokenizer
def test_byte_tokenizer_roundtrip_non_ascii():
    tok = ByteTokenizer()
    text = "plain ASCII, h\u00e9llo w\u00f6rld, \u65e5\u672c\u8a9e, emoji \U0001f642, tab\tand newline\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) > len(text)  # multi-byte characters
    assert tok.decode(ids) == text
    assert tok.encode_tensor(text).tolist() == ids
    assert tok.encode_tensor("").numel() == 0
    # specials are skipped on decode; framing
    framed = tok.encode(text, add_bos=True, add_eos=True)
    assert framed[0] == ByteTokenizer.BOS == 256 and framed[-1] == ByteTokenizer.EOS == 257
    assert tok.decode(framed + [ByteTokenizer.PAD, 259]) == text
    assert tok.decode(torch.tensor(framed)) == text
    # broken UTF-8 is replaced, not raised
    assert tok.decode([0xE6, 0x97]) == "\ufffd"
    assert tok.vocab_size == len(tok) == 260 and ByteTokenizer.PAD == 258


# ---------------------------------------------------------------------------- packing
def test_packing_eos_between_docs_and_shifted_labels(tmp_path):
    a = _write(tmp_path / "a.txt", "abc")
    b = _write(tmp_path / "b.txt", "de")
    dm = TextDataModule(files=[a, b], seq_len=2, batch_size=1, val_fraction=0.0, shuffle=False)
    dm.setup("fit")
    A, B_, C, D, E = (ord(c) for c in "abcde")
    assert dm.tokens.tolist() == [A, B_, C, EOS, D, E, EOS]
    assert dm.tokens.dtype == torch.int32
    ds = dm.train_dataset
    assert len(ds) == 3  # (7 - 1) // 2
    assert ds[0]["input_ids"].tolist() == [A, B_] and ds[0]["labels"].tolist() == [B_, C]
    assert ds[1]["input_ids"].tolist() == [C, EOS] and ds[1]["labels"].tolist() == [EOS, D]
    assert ds[2]["input_ids"].tolist() == [D, E] and ds[2]["labels"].tolist() == [E, EOS]
    assert ds[-1]["input_ids"].tolist() == [D, E]
    with pytest.raises(IndexError):
        ds[3]


def test_labels_are_inputs_shifted_by_one(small_corpus):
    dm = TextDataModule(files=[small_corpus], seq_len=16, batch_size=4, val_fraction=0.0, shuffle=False)
    dm.setup("fit")
    ds = dm.train_dataset
    for i in (0, 1, 7, len(ds) - 2):
        x, y = ds[i]["input_ids"], ds[i]["labels"]
        assert torch.equal(y[:-1], x[1:])
        assert y[-1] == ds[i + 1]["input_ids"][0]
        assert torch.equal(x, dm.tokens[i * 16 : (i + 1) * 16].long())
    # one EOS per document, each right after its text
    assert int((dm.tokens == EOS).sum()) == 3
    assert dm.tokens[-1] == EOS


def test_max_tokens_caps_stream(small_corpus):
    dm = TextDataModule(files=[small_corpus], seq_len=8, max_tokens=100, val_fraction=0.0, batch_size=2)
    dm.setup()
    assert dm.tokens.numel() == 100
    assert len(dm.train_dataset) == (100 - 1) // 8


# ---------------------------------------------------------------------------- split
def test_split_deterministic_disjoint_and_world_size_independent(small_corpus):
    def build(**kw):
        dm = TextDataModule(files=[small_corpus], seq_len=16, batch_size=2, val_fraction=0.1, **kw)
        dm.setup("fit")
        return dm

    dm1 = build(seed=0)
    dm2 = build(seed=123, shuffle=False)
    dm2.set_batch_view(4, 3)
    n = (dm1.tokens.numel() - 1) // 16
    assert len(dm1.val_dataset) == math.ceil(n * 0.1) > 0
    assert len(dm1.train_dataset) + len(dm1.val_dataset) == n
    assert torch.equal(dm2.tokens, dm1.tokens)
    assert (len(dm2.train_dataset), len(dm2.val_dataset)) == (len(dm1.train_dataset), len(dm1.val_dataset))
    for i in range(len(dm2.val_dataset)):
        assert torch.equal(dm2.val_dataset[i]["input_ids"], dm1.val_dataset[i]["input_ids"])
    # input windows of train and val never overlap
    S = 16
    train_tokens = set(range(0, len(dm1.train_dataset) * S))
    val_first = dm1.val_dataset.first * S
    val_tokens = set(range(val_first, val_first + len(dm1.val_dataset) * S))
    assert not train_tokens & val_tokens
    assert val_first == len(dm1.train_dataset) * S


def test_val_fraction_zero_gives_no_val_loader(small_corpus):
    dm = TextDataModule(files=[small_corpus], seq_len=16, batch_size=2, val_fraction=0.0)
    dm.setup("fit")
    assert len(dm.val_dataset) == 0
    assert dm.val_dataloader() == []


# ---------------------------------------------------------------------------- embedded corpus
def test_embedded_corpus_loads_offline_and_is_substantial(embedded_dm):
    docs = embedded_corpus_documents()
    assert len(docs) > 100
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    assert 2_000_000 < nbytes <= EMBEDDED_CORPUS_MAX_BYTES + max(len(d.encode("utf-8")) for d in docs)
    assert embedded_corpus_documents() == docs  # deterministic
    assert embedded_dm.tokens.numel() == nbytes + len(docs)  # bytes + one EOS per document
    assert embedded_dm.setup_seconds < 5.0
    assert len(embedded_dm.train_dataset) > 10_000 and len(embedded_dm.val_dataset) > 100
    text = ByteTokenizer().decode(embedded_dm.train_dataset[0]["input_ids"])
    assert text.isprintable() or "\n" in text
    assert embedded_dm.vocab_size == 260


def test_dataloader_batch_shapes_and_dtypes(embedded_dm):
    loader = embedded_dm.train_dataloader()
    assert isinstance(loader.sampler, DistributedSampler)  # so Lightning keeps it
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels"}
    for v in batch.values():
        assert v.shape == (4, 128) and v.dtype == torch.long
    assert int(batch["input_ids"].max()) < 260 and int(batch["input_ids"].min()) >= 0
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    vbatch = next(iter(embedded_dm.val_dataloader()))
    assert vbatch["input_ids"].shape == (4, 128) and vbatch["labels"].dtype == torch.long


# ---------------------------------------------------------------------------- sampling
def _dm(corpus, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("batch_size", 2)
    kw.setdefault("val_fraction", 0.0)
    dm = TextDataModule(files=[corpus], **kw)
    dm.setup("fit")
    return dm


def test_distributed_shards_disjoint_and_batch_view_peers_identical(small_corpus):
    loaders = {}
    for rank in (0, 1):
        for peer in ("a", "b"):  # e.g. two tensor-parallel peers with the same batch-view rank
            dm = _dm(small_corpus, shuffle=True, seed=7)
            dm.set_batch_view(2, rank)
            loaders[rank, peer] = dm.train_dataloader()
    for rank in (0, 1):
        la, lb = loaders[rank, "a"], loaders[rank, "b"]
        assert _sample_starts(la) == _sample_starts(lb)
        for ba, bb in zip(la, lb):
            assert torch.equal(ba["input_ids"], bb["input_ids"]) and torch.equal(ba["labels"], bb["labels"])
    s0, s1 = set(_sample_starts(loaders[0, "a"])), set(_sample_starts(loaders[1, "a"]))
    assert not s0 & s1
    n = len(loaders[0, "a"].dataset)
    assert len(s0) == len(s1) == n // 2
    # a new epoch (Lightning calls set_epoch) reshuffles, identically on peers
    first = _sample_starts(loaders[0, "a"])
    for peer in ("a", "b"):
        loaders[0, peer].sampler.set_epoch(1)
    assert _sample_starts(loaders[0, "a"]) == _sample_starts(loaders[0, "b"]) != first


def test_shuffle_false_is_sequential(small_corpus):
    dm = _dm(small_corpus, shuffle=False, batch_size=3)
    loader = dm.train_dataloader()
    ds = dm.train_dataset
    batches = list(loader)
    assert len(batches) == len(ds) // 3
    for b, batch in enumerate(batches):
        expected = torch.stack([ds[b * 3 + j]["input_ids"] for j in range(3)])
        assert torch.equal(batch["input_ids"], expected)
    # with two replicas, rank r reads samples r, r + 2, r + 4, ...
    dm.set_batch_view(2, 1)
    starts = _sample_starts(dm.train_dataloader())
    assert starts == [(2 * i + 1) * 16 for i in range(len(ds) // 2)]


def test_batch_view_from_attached_trainer(small_corpus):
    dm = _dm(small_corpus)
    assert dm.batch_view() == (1, 0)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1}))
    assert dm.batch_view() == (2, 1)
    sampler = dm.train_dataloader().sampler
    assert (sampler.num_replicas, sampler.rank, sampler.seed) == (2, 1, 0)
    dm.set_batch_view(4, 2)  # explicit view wins
    assert dm.batch_view() == (4, 2)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace())  # single-device strategies have no kwargs
    dm._batch_view = None
    assert dm.batch_view() == (1, 0)
    with pytest.raises(ValueError, match="rank"):
        dm.set_batch_view(2, 2)


def test_lightning_fit_keeps_sampler_and_order(small_corpus):
    import lightning.pytorch as pl

    seen = []

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(260, 4)

        def training_step(self, batch, batch_idx):
            seen.append(batch["input_ids"].clone())
            return self.emb(batch["input_ids"]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    dm = TextDataModule(files=[small_corpus], seq_len=16, batch_size=2, val_fraction=0.0, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Tiny(), datamodule=dm)
    assert isinstance(trainer.train_dataloader.sampler, DistributedSampler)
    ds = dm.train_dataset
    assert len(seen) == 3
    for b in range(3):
        assert torch.equal(seen[b], torch.stack([ds[2 * b]["input_ids"], ds[2 * b + 1]["input_ids"]]))


# ---------------------------------------------------------------------------- files
def test_jsonl_reading(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text(
        json.dumps({"text": "first doc", "id": 1}) + "\n\n" + json.dumps({"text": "s\u00e9cond"}) + "\n",
        encoding="utf-8",
    )
    dm = TextDataModule(files=[str(p)], seq_len=4, batch_size=1, val_fraction=0.0)
    dm.setup()
    expected = list(b"first doc") + [EOS] + list("s\u00e9cond".encode()) + [EOS]
    assert dm.tokens.tolist() == expected

    q = tmp_path / "other.jsonl"
    q.write_text(json.dumps({"content": "custom field text"}) + "\n", encoding="utf-8")
    dm = TextDataModule(files=[str(q)], text_field="content", seq_len=4, batch_size=1, val_fraction=0.0)
    dm.setup()
    assert dm.tokens.tolist() == list(b"custom field text") + [EOS]

    # a directory mixing .txt and .jsonl, read in sorted order; other suffixes ignored
    d = tmp_path / "mixed"
    d.mkdir()
    _write(d / "b.txt", "BB")
    (d / "a.jsonl").write_text(json.dumps({"text": "AA"}) + "\n", encoding="utf-8")
    _write(d / "c.md", "ignored")
    dm = TextDataModule(files=[str(d)], seq_len=2, batch_size=1, val_fraction=0.0)
    dm.setup()
    assert dm.tokens.tolist() == list(b"AA") + [EOS] + list(b"BB") + [EOS]


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seq_len": 0}, "seq_len"),
        ({"seq_len": -3}, "seq_len"),
        ({"batch_size": 0}, "batch_size"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": -0.1}, "val_fraction"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextDataModule(**kwargs)


def test_bad_data_raises(tmp_path):
    def setup(files, **kw):
        kw.setdefault("seq_len", 8)
        kw.setdefault("batch_size", 1)
        TextDataModule(files=files, **kw).setup("fit")

    with pytest.raises(ValueError, match="does not exist"):
        setup([str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match="does not exist"):
        setup([str(tmp_path / "missing_dir")])
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="holds no .txt, .jsonl or .json"):
        setup([str(empty_dir)])
    with pytest.raises(ValueError, match="empty"):
        setup([_write(tmp_path / "empty.txt", "")])
    with pytest.raises(ValueError, match="empty"):
        setup([])
    with pytest.raises(ValueError, match="seq_len"):
        setup([_write(tmp_path / "tiny.txt", "short")], seq_len=64)
    with pytest.raises(ValueError, match="val_fraction"):  # one sample, nothing left for training
        setup([_write(tmp_path / "one.txt", "x" * 10)], seq_len=8, val_fraction=0.5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        setup([str(bad)])
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="text_field"):
        setup([str(nofield)])
    # enough for samples but not for one full batch per rank
    dm = TextDataModule(files=[_write(tmp_path / "few.txt", "y" * 40)], seq_len=8, batch_size=16, val_fraction=0.0)
    dm.setup("fit")
    with pytest.raises(ValueError, match="batch_size"):
        dm.train_dataloader()


# ---------------------------------------------------------------------------- Hugging Face tokenizer branch
def test_hf_tokenizer_missing_path(tmp_path):
    dm = TextDataModule(tokenizer=str(tmp_path / "no_such_tokenizer"))
    with pytest.raises(ValueError, match="does not exist"):
        dm.vocab_size
    with pytest.raises(ValueError, match="tokenizer"):
        dm.setup("fit")


def test_hf_tokenizer_missing_transformers(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    dm = TextDataModule(tokenizer=str(tmp_path))
    with pytest.raises(ImportError, match="transformers"):
        dm.vocab_size


def test_hf_tokenizer_branch_with_stub(tmp_path, monkeypatch, small_corpus):
    calls = []

    class StubTokenizer:
        eos_token_id = 1000

        def __len__(self):
            return 1003

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return [ord(c) % 500 for c in text]

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path, **kwargs):
            calls.append((path, kwargs))
            return StubTokenizer()

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=AutoTokenizer))
    dm = TextDataModule(files=[small_corpus], tokenizer=str(tmp_path), seq_len=16, batch_size=2)
    assert dm.vocab_size == 1003
    dm.setup("fit")
    assert calls == [(str(tmp_path), {"local_files_only": True})]
    assert int((dm.tokens == 1000).sum()) == 3 and dm.tokens[-1] == 1000
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 16)


# ---------------------------------------------------------------------------- formats: .json, compressed, binary
def _tokens_of(files, **kw):
    kw.setdefault("seq_len", 2)
    kw.setdefault("batch_size", 1)
    dm = TextDataModule(files=files, val_fraction=0.0, **kw)
    dm.setup()
    return dm.tokens.tolist()


def _doc_tokens(*docs):
    out = []
    for d in docs:
        out += list(d.encode()) + [EOS]
    return out


def test_compressed_and_json_files(tmp_path):
    import bz2
    import gzip
    import lzma

    records = [{"text": "alpha doc"}, {"text": "b\u00e9ta"}]
    jsonl = "\n".join(json.dumps(r) for r in records) + "\n"
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl.encode()))
    assert _tokens_of(str(tmp_path / "a.jsonl.gz")) == _doc_tokens("alpha doc", "b\u00e9ta")
    (tmp_path / "b.txt.bz2").write_bytes(bz2.compress(b"bzip text"))
    assert _tokens_of(str(tmp_path / "b.txt.bz2")) == _doc_tokens("bzip text")
    (tmp_path / "c.txt.xz").write_bytes(lzma.compress(b"xz text"))
    assert _tokens_of(str(tmp_path / "c.txt.xz")) == _doc_tokens("xz text")
    # gzip without the suffix is recognised by its magic number
    (tmp_path / "d.txt").write_bytes(gzip.compress(b"hidden gzip"))
    assert _tokens_of(str(tmp_path / "d.txt")) == _doc_tokens("hidden gzip")
    # .json: an array of objects (text_field), an array of strings, JSON Lines saved as .json, gzipped
    _write(tmp_path / "e.json", json.dumps([{"body": "one"}, {"body": "two"}]))
    assert _tokens_of(str(tmp_path / "e.json"), text_field="body") == _doc_tokens("one", "two")
    _write(tmp_path / "f.json", json.dumps(["s1", "s2"]))
    assert _tokens_of(str(tmp_path / "f.json")) == _doc_tokens("s1", "s2")
    _write(tmp_path / "g.json", jsonl)
    assert _tokens_of(str(tmp_path / "g.json")) == _doc_tokens("alpha doc", "b\u00e9ta")
    (tmp_path / "h.json.gz").write_bytes(gzip.compress(json.dumps(["zipped"]).encode()))
    assert _tokens_of(str(tmp_path / "h.json.gz")) == _doc_tokens("zipped")
    # a directory takes every readable format, in sorted order
    d = tmp_path / "dir"
    d.mkdir()
    (d / "1.jsonl.gz").write_bytes(gzip.compress(b'{"text": "first"}\n'))
    _write(d / "2.json", '["second"]')
    (d / "3.bin").write_bytes(b"\x00\x01")  # not a data suffix: ignored
    assert _tokens_of(str(d)) == _doc_tokens("first", "second")


@pytest.mark.parametrize("content, match", [
    (b"\x00\x01\x02binary" * 10, "binary"),
    (b"PK\x03\x04" + b"x" * 50, "zip archive"),
    (b"PAR1" + b"x" * 50, "Parquet"),
    (b"\x28\xb5\x2f\xfd" + b"x" * 50, "zstd"),
    (bytes(range(128, 256)) * 8, "not UTF-8"),
])
def test_binary_files_are_refused(tmp_path, content, match):
    p = tmp_path / "data.txt"
    p.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        _tokens_of(str(p))


def test_bad_json_files(tmp_path):
    _write(tmp_path / "obj.json", json.dumps({"rows": ["x"]}))
    with pytest.raises(ValueError, match="array of strings or of objects"):
        _tokens_of(str(tmp_path / "obj.json"))
    _write(tmp_path / "nofield.json", json.dumps([{"content": "x"}]))
    with pytest.raises(ValueError, match=r"nofield.json\[0\] has no field 'text' \(its keys: content\)"):
        _tokens_of(str(tmp_path / "nofield.json"))
    (tmp_path / "cut.jsonl.gz").write_bytes(__import__("gzip").compress(b'{"text": "x"}\n')[:-6])
    with pytest.raises(ValueError, match="cannot decompress"):
        _tokens_of(str(tmp_path / "cut.jsonl.gz"))


def test_files_as_one_path_and_checked_at_construction(tmp_path):
    p = _write(tmp_path / "own.txt", "own text")
    assert TextDataModule(files=p).files == [p]
    assert TextDataModule(files=str(tmp_path)).files == [str(tmp_path)]
    with pytest.raises(ValueError, match="does not exist"):
        TextDataModule(files=str(tmp_path / "typo.txt"))


# ---------------------------------------------------------------------------- model limits and batch checks
def test_limits_checked_where_the_data_is_made(tmp_path, small_corpus):
    dm = TextDataModule(files=small_corpus, seq_len=16, batch_size=2)
    dm.set_model_limits(vocab_size=100, max_seq_len=64)  # bytes of the text reach 'x' = 120 and EOS = 257
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"token id 257 >= the model's vocab_size=100.*vocab_size >= 260"):
        dm.train_dataloader()
    dm.set_model_limits(vocab_size=260, max_seq_len=8)
    with pytest.raises(ValueError, match=r"data.seq_len=16 exceeds the model's max_seq_len=8"):
        dm.train_dataloader()
    # limits from the attached trainer's module when none are set
    dm = TextDataModule(files=small_corpus, seq_len=16, batch_size=2)
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(config=SimpleNamespace(vocab_size=260,
                                                                                        max_seq_len=8)),
                                 strategy=SimpleNamespace(distributed_sampler_kwargs=None))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        dm.train_dataloader()
    # every batch goes through the checking collate
    dm.set_model_limits(vocab_size=260, max_seq_len=16)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 16)


@pytest.mark.parametrize("change, match", [
    (lambda b: b.update(input_ids=b["input_ids"] + 300), r"input_ids holds token id \d+ >= vocab_size=260"),
    (lambda b: b["input_ids"].__setitem__((0, 0), -1), "negative token id -1"),
    (lambda b: b["labels"].__setitem__((0, 0), 260), r"labels holds token id 260 >= vocab_size=260"),
    (lambda b: b.update(input_ids=torch.zeros(2, 32, dtype=torch.long), labels=None),
     r"32 tokens exceed the model's max_seq_len=16"),
    (lambda b: b.update(input_ids=b["input_ids"].float()), "integer token ids"),
    (lambda b: b.update(attention_mask=torch.tensor([[1.0, float("nan"), 1, 1]] * 2)), "NaN"),
    (lambda b: b.update(attention_mask=torch.tensor([[0.0, float("-inf"), 0, 0]] * 2)), "not an additive"),
    (lambda b: b.update(attention_mask=torch.ones(2, 3)), "shape"),
    (lambda b: b.update(input_ids=torch.zeros(0, 4, dtype=torch.long), labels=None), r"shape \(0, 4\): a batch needs"),
    (lambda b: b.update(input_ids=torch.zeros(2, 0, dtype=torch.long), labels=None), r"shape \(2, 0\): a batch needs"),
])
def test_validate_batch_refuses(change, match):
    from lightning_moe.data import validate_batch

    batch = {"input_ids": torch.randint(0, 260, (2, 4)), "labels": torch.randint(0, 260, (2, 4))}
    batch["labels"][0, 1] = -100  # ignored positions are fine
    validate_batch(batch, vocab_size=260, max_seq_len=16)
    validate_batch({**batch, "attention_mask": torch.tensor([[1.0, 1, 0, 0]] * 2)}, 260, 16)
    change(batch)
    batch = {k: v for k, v in batch.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        validate_batch(batch, vocab_size=260, max_seq_len=16)


def test_collate_stacks_and_checks():
    from lightning_moe.data import collate

    samples = [{"input_ids": torch.arange(4), "labels": torch.arange(1, 5)} for _ in range(3)]
    batch = collate(samples, vocab_size=10, max_seq_len=4)
    assert batch["input_ids"].shape == (3, 4)
    with pytest.raises(ValueError, match="vocab_size=4"):
        collate(samples, vocab_size=4)
    with pytest.raises(ValueError, match="different shapes"):
        collate([{"input_ids": torch.arange(4)}, {"input_ids": torch.arange(3)}])
