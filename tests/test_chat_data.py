"""Chat / instruction data (TextDataModule(format="chat")) and document-masked text packing."""

from __future__ import annotations

import json

import pytest
import torch

from _chat_data import build_tokenizer, conversations, write_jsonl
from lightning_moe.data import TextDataModule
from lightning_moe.data.chat import render_conversation, tokenize_chat_files
from lightning_moe.data.datamodule import document_positions
from lightning_moe.data.tokenizer import load_hf_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def chat_file(tmp_path):
    return write_jsonl(tmp_path / "chat.jsonl", conversations(60))


def _dm(chat_file, tok_dir, **kw):
    kw = {"seq_len": 128, "batch_size": 2, "val_fraction": 0.2, "shuffle": False, **kw}
    dm = TextDataModule(files=chat_file, tokenizer=tok_dir, format="chat", **kw)
    dm.setup("fit")
    return dm


def _decode(tok, ids):
    return tok.decode([int(i) for i in ids])


def test_loss_only_on_assistant_tokens(tok_dir):
    tok = load_hf_tokenizer(tok_dir)
    messages = [{"role": "system", "content": "answer briefly."}, {"role": "user", "content": "what color is the sky?"},
                {"role": "assistant", "content": "the sky is red."}, {"role": "user", "content": "and the sun?"},
                {"role": "assistant", "content": "the sun is white."}]
    ids, trained = render_conversation(messages, tok, "x")
    assert _decode(tok, ids) == tok.apply_chat_template(messages, tokenize=False)
    assert _decode(tok, [i for i, t in zip(ids, trained) if t]) == \
        "the sky is red.<|im_end|>\nthe sun is white.<|im_end|>\n"
    ids_all, trained_all = render_conversation(messages, tok, "x", train_on="all")
    assert ids_all == ids and all(trained_all)


def test_rows_labels_positions_and_split(chat_file, tok_dir):
    dm = _dm(chat_file, tok_dir)
    tok = dm.get_tokenizer()
    stats = dm.chat_stats
    assert stats.conversations == 60 and stats.cut == stats.dropped == 0
    assert len(dm.train_dataset) + len(dm.val_dataset) == stats.rows and len(dm.val_dataset) == -(-stats.rows // 5)
    row = dm.train_dataset[0]
    assert set(row) == {"input_ids", "labels", "position_ids", "attention_mask"}
    ids, labels, pos, mask = row["input_ids"], row["labels"], row["position_ids"], row["attention_mask"]
    starts = (pos == 0).nonzero().squeeze(1).tolist()
    real = int(mask.sum())
    assert mask[:real].all() and not mask[real:].any() and (labels[real:] == -100).all()
    docs = [d for d in starts if d < real]
    assert len(docs) >= 2, "several conversations share a row"
    for a, b in zip(docs, docs[1:] + [real]):
        conv = ids[a:b]
        assert _decode(tok, conv).startswith("<|im_start|>") and (pos[a:b] == torch.arange(b - a)).all()
        assert labels[b - 1] == -100  # the conversation's last token predicts nothing (no label across two)
        kept = labels[a:b] != -100
        # pre-shifted: each label is the next input, and what is trained on is the assistant's part
        assert torch.equal(labels[a:b - 1][kept[:-1]], ids[a + 1:b][kept[:-1]])
        trained_text = _decode(tok, labels[a:b][kept])
        assert "user" not in trained_text and trained_text.endswith("<|im_end|>\n")
    # the loaders: every key collated, labels accepted as our (shifted) convention, rows sharded over replicas
    batch = next(iter(dm.train_dataloader()))
    assert batch["position_ids"].shape == (2, 128)
    dm.set_batch_view(2, 1)
    other = [b["input_ids"] for b in dm.train_dataloader()]
    dm.set_batch_view(2, 0)
    mine = [b["input_ids"] for b in dm.train_dataloader()]
    assert not any(torch.equal(a, b) for a in mine for b in other)


def test_resume_continues_at_the_next_row(chat_file, tok_dir):
    dm = _dm(chat_file, tok_dir, shuffle=True, batch_size=1)
    loader = dm.train_dataloader()
    it = iter(loader)
    seen = [next(it)["input_ids"] for _ in range(3)]
    state = loader.state_dict()
    rest = [b["input_ids"] for b in it]
    dm2 = _dm(chat_file, tok_dir, shuffle=True, batch_size=1)
    resumed = dm2.train_dataloader()
    resumed.load_state_dict(state)
    assert [torch.equal(a, b) for a, b in zip(rest, [b["input_ids"] for b in resumed])] == [True] * len(rest)
    assert len(seen) == 3


def test_overlong_conversations(tmp_path, tok_dir):
    records = conversations(6)
    records[4] = {"prompt": "what color is the sky? " * 30, "completion": "the sky is red."}
    path = write_jsonl(tmp_path / "long.jsonl", records)
    with pytest.raises(ValueError, match=r"long\.jsonl:5: the conversation has \d+ tokens, more than seq_len=128"):
        _dm(path, tok_dir)
    dropped = _dm(path, tok_dir, overlong="drop", val_fraction=0.0)
    assert (dropped.chat_stats.dropped, dropped.chat_stats.conversations) == (1, 5)
    cut = _dm(path, tok_dir, overlong="truncate", val_fraction=0.0)
    assert (cut.chat_stats.cut, cut.chat_stats.conversations) == (1, 6)
    assert "1 longer than seq_len=128 cut" in cut.chat_stats.summary(128)


@pytest.mark.parametrize("line, match", [
    ("not json", r"bad\.jsonl:2 is not valid JSON"),
    ('{"text": "plain"}', r"bad\.jsonl:2 has neither \"messages\" nor \"prompt\" and \"completion\""),
    ('{"messages": [{"role": "user"}]}', r"bad\.jsonl:2: messages\[0\] must be an object with string"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"bad\.jsonl:2: the conversation has no assistant turn"),
])
def test_malformed_records_name_their_line(tmp_path, tok_dir, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(conversations(1)[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        tokenize_chat_files(str(path), load_hf_tokenizer(tok_dir), 128)


def test_tokenizer_without_template_and_bad_options(tmp_path, chat_file, tok_dir):
    tok = load_hf_tokenizer(tok_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        tokenize_chat_files(chat_file, tok, 64, tokenizer_name="mine")
    with pytest.raises(ValueError, match="needs `tokenizer`"):
        TextDataModule(files=chat_file, format="chat")
    with pytest.raises(ValueError, match="train_on must be one of"):
        TextDataModule(files=chat_file, tokenizer=tok_dir, format="chat", train_on="prompt")
    with pytest.raises(ValueError, match="format must be"):
        TextDataModule(format="sharegpt")


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path, tok_dir):
    tok = load_hf_tokenizer(tok_dir)
    # renders an assistant turn differently when it is the last one (as templates that drop earlier reasoning do)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %}.{% endif %}"
                         "\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    path = write_jsonl(tmp_path / "c.jsonl", conversations(3)[2:])
    with pytest.raises(ValueError, match=r"c\.jsonl:1: the chat template renders turn 2 differently"):
        tokenize_chat_files(path, tok, 128)
    rows, _ = tokenize_chat_files(path, tok, 128, train_on="all")
    assert int((rows["labels"] != -100).sum()) == int(rows["attention_mask"].sum()) - 1


# ---- text: document-masked packing ---------------------------------------------------------------------------------


def test_document_positions():
    tokens = torch.tensor([5, 6, 9, 7, 9, 8, 8, 8, 9], dtype=torch.int32)  # 9 = EOS after every document
    assert document_positions(tokens, 9).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_text_document_mask(tmp_path):
    docs = ["alpha beta gamma", "x", "a much longer document about nothing in particular", "tail"]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    plain = TextDataModule(files=path, seq_len=16, val_fraction=0.0, shuffle=False)
    masked = TextDataModule(files=path, seq_len=16, val_fraction=0.0, shuffle=False, document_mask=True)
    plain.setup(), masked.setup()
    eos = masked.eos_id
    for i in range(len(masked.train_dataset)):
        a, b = plain.train_dataset[i], masked.train_dataset[i]
        assert "position_ids" not in a and torch.equal(a["input_ids"], b["input_ids"])
        pos, labels, ids = b["position_ids"], b["labels"], b["input_ids"]
        assert pos[0] == 0  # a window starts a (piece of a) document
        for t in range(1, 16):
            assert pos[t] == (0 if ids[t - 1] == eos else pos[t - 1] + 1)
        # exactly the documents' last tokens (their EOS) lose their label: it is the next document's first token
        dropped = (labels == -100).nonzero().squeeze(1).tolist()
        assert dropped == [t for t in range(16) if ids[t] == eos]
        assert torch.equal(labels[labels != -100], a["labels"][labels != -100])
    assert any((masked.train_dataset[i]["labels"] == -100).any() for i in range(len(masked.train_dataset)))
