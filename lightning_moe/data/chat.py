"""Chat and instruction data: JSON Lines conversations rendered with a tokenizer's chat template, loss on the
assistant's tokens, packed several to a row with per-document ``position_ids`` (attention never crosses two).

Records (one JSON object per line of a ``.jsonl`` file, or the elements of a ``.json`` array)::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}          # = a user turn and an assistant turn

``prompt`` and ``completion`` may also be lists of messages. Each conversation is rendered with
``tokenizer.apply_chat_template`` of a local Hugging Face tokenizer and tokenized once (a fast tokenizer's offsets
say which tokens each turn produced). ``train_on="assistant"`` trains on the tokens of the assistant turns as the
template renders them (content and end-of-turn marker; never the prompt the template adds before them);
``train_on="all"`` on every token. An assistant turn's tokens are found by rendering the conversation up to the turn
with the generation prompt and up to its end: the template must render earlier turns the same whatever follows.

Labels are pre-shifted as everywhere in lightning_moe (``labels[t]`` is the token after ``input_ids[t]``, -100 where
that token is not trained on), so every conversation's last position is -100 and nothing predicts across two.

A conversation longer than ``seq_len`` is an error naming its line (``overlong="error"``), or is cut to ``seq_len``
(``"truncate"``) or left out (``"drop"``); cut and dropped ones are counted and reported. Conversations are packed in
file order: each goes into the current row if it fits, else starts a new one; the rest of a row is padding
(``attention_mask`` 0, labels -100, position 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from lightning_moe.data.collate import IGNORE_INDEX
from lightning_moe.data.corpus import _format_of, expand_files, read_text_file

__all__ = ["CHAT_OVERLONG", "CHAT_TRAIN_ON", "ChatStats", "pack_conversations", "read_chat_records",
           "render_conversation", "tokenize_chat_files"]

CHAT_TRAIN_ON = ("assistant", "all")
CHAT_OVERLONG = ("error", "truncate", "drop")


@dataclass
class ChatStats:
    """What building the chat rows did (reported once, kept on the data module as ``chat_stats``)."""

    conversations: int = 0
    cut: int = 0
    dropped: int = 0
    rows: int = 0
    real_tokens: int = 0
    trained_labels: int = 0
    cut_where: list[str] = field(default_factory=list)

    def summary(self, seq_len: int) -> str:
        total = max(1, self.rows * seq_len)
        parts = [f"{self.conversations} conversations packed into {self.rows} rows of {seq_len} tokens "
                 f"({100 * self.real_tokens / total:.0f}% real tokens, {self.trained_labels} labels trained on)"]
        if self.cut:
            parts.append(f"{self.cut} longer than seq_len={seq_len} cut to it (first: {self.cut_where[0]})")
        if self.dropped:
            parts.append(f"{self.dropped} longer than seq_len={seq_len} dropped (first: {self.cut_where[0]})")
        return "chat data: " + "; ".join(parts)


def _messages(value: Any, where: str, name: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {name} must be a non-empty list of {{\"role\": ..., \"content\": ...}} turns")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: {name}[{i}] must be an object with string \"role\" and \"content\", got "
                             f"{json.dumps(m)[:120]}")
    return [dict(m) for m in value]


def _record_messages(record: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}; each record must be an object with "
                         "\"messages\", or \"prompt\" and \"completion\"")
    if "messages" in record:
        return _messages(record["messages"], where, "messages")
    if "prompt" in record and "completion" in record:
        turns = []
        for name, role in (("prompt", "user"), ("completion", "assistant")):
            value = record[name]
            if isinstance(value, str):
                turns.append({"role": role, "content": value})
            else:
                turns += _messages(value, where, name)
        return turns
    raise ValueError(f"{where} has neither \"messages\" nor \"prompt\" and \"completion\" (its keys: "
                     f"{', '.join(map(str, record))}); chat data needs one of them")


def read_chat_records(files: Union[str, list[str]]) -> list[tuple[str, list[dict[str, str]]]]:
    """``(where, messages)`` of every record in ``files`` (``where`` = ``path:line`` or ``path[index]``), in order."""
    out = []
    for path in expand_files(files):
        text = read_text_file(path)
        fmt, _ = _format_of(path)
        if fmt == "json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                if err.msg != "Extra data":
                    raise ValueError(f"{path} is not valid JSON ({err}).") from err
                fmt = "jsonl"  # JSON Lines under a .json name
            else:
                if not isinstance(data, list):
                    raise ValueError(f"{path} holds a JSON {type(data).__name__}; chat .json files hold an array of "
                                     "records (or use .jsonl, one record per line)")
                out += [(f"{path}[{i}]", _record_messages(r, f"{path}[{i}]")) for i, r in enumerate(data)]
                continue
        if fmt != "jsonl":
            raise ValueError(f"{path}: chat data comes in .jsonl (or .json) files of records, not plain text")
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where} is not valid JSON ({err}); each line must be one JSON object") from err
            out.append((where, _record_messages(record, where)))
    return out


def check_chat_tokenizer(tokenizer: Any, name: Any) -> None:
    """ValueError unless ``tokenizer`` can render and locate chat turns: a chat template and token offsets."""
    if not hasattr(tokenizer, "apply_chat_template") or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer {name!r} has no chat template: chat data is rendered with "
                         "tokenizer.apply_chat_template; use a tokenizer whose tokenizer_config.json has a "
                         "\"chat_template\" (set tokenizer.chat_template and save_pretrained it)")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer {name!r} is not a fast tokenizer: finding the assistant's tokens needs its "
                         "character offsets; save it with a tokenizer.json (transformers' *TokenizerFast)")


def render_conversation(messages: list[dict[str, str]], tokenizer: Any, where: str,
                        train_on: str = "assistant") -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is trained on."""
    def render(turns: list[dict[str, str]], generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as err:  # the template's own error (jinja, raise_exception in the template)
            raise ValueError(f"{where}: the chat template cannot render this conversation: {err}") from err

    text = render(messages)
    spans = []
    if train_on == "assistant":
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, through = render(messages[:i], True), render(messages[: i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"{where}: the chat template renders turn {i} differently once later turns follow, so the "
                    "assistant's tokens cannot be located; set `train_on: all` or use a template that renders "
                    "earlier turns unchanged")
            spans.append((len(before), len(through)))
        if not spans:
            raise ValueError(f"{where}: the conversation has no assistant turn to learn from; add one or set "
                             "`train_on: all`")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if train_on == "all":
        return ids, [True] * len(ids)
    trained = [any(a <= start < b for a, b in spans) and end > start for start, end in enc["offset_mapping"]]
    return ids, trained


def conversation_labels(ids: list[int], trained: list[bool]) -> list[int]:
    """Pre-shifted labels: the next token where it is trained on, else -100 (the last position always)."""
    return [nxt if keep else IGNORE_INDEX for nxt, keep in zip(ids[1:], trained[1:])] + [IGNORE_INDEX]


def pack_conversations(conversations: list[tuple[list[int], list[bool]]], seq_len: int,
                       pad_id: int) -> dict[str, torch.Tensor]:
    """Rows [N, seq_len] of ``input_ids``, ``labels``, ``position_ids`` and ``attention_mask``: conversations in order,
    each in the current row if it fits, else in a new one; the rest padding. Every conversation must fit a row."""
    rows: list[list[tuple[list[int], list[bool]]]] = []
    used = seq_len
    for ids, trained in conversations:
        if len(ids) > seq_len:
            raise ValueError(f"a conversation of {len(ids)} tokens does not fit a row of seq_len={seq_len}")
        if used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, trained))
        used += len(ids)
    N = len(rows)
    out = {"input_ids": torch.full((N, seq_len), pad_id, dtype=torch.long),
           "labels": torch.full((N, seq_len), IGNORE_INDEX, dtype=torch.long),
           "position_ids": torch.zeros(N, seq_len, dtype=torch.long),
           "attention_mask": torch.zeros(N, seq_len, dtype=torch.long)}
    for r, row in enumerate(rows):
        start = 0
        for ids, trained in row:
            n = len(ids)
            out["input_ids"][r, start:start + n] = torch.tensor(ids)
            out["labels"][r, start:start + n] = torch.tensor(conversation_labels(ids, trained))
            out["position_ids"][r, start:start + n] = torch.arange(n)
            out["attention_mask"][r, start:start + n] = 1
            start += n
    return out


def tokenize_chat_files(files: Union[str, list[str]], tokenizer: Any, seq_len: int, train_on: str = "assistant",
                        overlong: str = "error", pad_id: Optional[int] = None,
                        tokenizer_name: Any = None) -> tuple[dict[str, torch.Tensor], ChatStats]:
    """Read, render, check the length of and pack every conversation of ``files`` (see the module docstring)."""
    if train_on not in CHAT_TRAIN_ON:
        raise ValueError(f"train_on must be one of {CHAT_TRAIN_ON}, got {train_on!r}")
    if overlong not in CHAT_OVERLONG:
        raise ValueError(f"overlong must be one of {CHAT_OVERLONG}, got {overlong!r}")
    check_chat_tokenizer(tokenizer, tokenizer_name)
    stats = ChatStats()
    conversations = []
    for where, messages in read_chat_records(files):
        ids, trained = render_conversation(messages, tokenizer, where, train_on)
        if len(ids) > seq_len:
            if overlong == "error":
                raise ValueError(f"{where}: the conversation has {len(ids)} tokens, more than seq_len={seq_len}: "
                                 "raise seq_len, or set `overlong: truncate` (cut it) or `overlong: drop`")
            stats.cut_where.append(where)
            if overlong == "drop":
                stats.dropped += 1
                continue
            stats.cut += 1
            ids, trained = ids[:seq_len], trained[:seq_len]
        conversations.append((ids, trained))
    if not conversations:
        raise ValueError(f"no conversation left in {files!r} (every one dropped or the files are empty)")
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = pack_conversations(conversations, seq_len, 0 if pad_id is None else int(pad_id))
    stats.conversations = len(conversations)
    stats.rows = rows["input_ids"].shape[0]
    stats.real_tokens = int(rows["attention_mask"].sum())
    stats.trained_labels = int((rows["labels"] != IGNORE_INDEX).sum())
    return rows, stats
