"""Offline chat fixtures: a small byte-level BPE tokenizer with a ChatML chat template, and chat JSON Lines."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLORS = ["red", "blue", "green", "black", "white", "yellow", "purple", "orange"]
THINGS = ["sky", "grass", "snow", "coal", "sun", "plum", "carrot", "rose", "sea", "leaf", "milk", "ink"]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` records: question / answer pairs about made-up fixed facts (learnable), in both record formats."""
    rng = random.Random(seed)
    facts = {t: COLORS[(i * 5) % len(COLORS)] for i, t in enumerate(THINGS)}
    out = []
    for i in range(n):
        thing = rng.choice(THINGS)
        q, a = f"what color is the {thing}?", f"the {thing} is {facts[thing]}."
        if i % 3 == 0:
            out.append({"prompt": q, "completion": a})
        elif i % 3 == 1:
            out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        else:
            other = rng.choice(THINGS)
            out.append({"messages": [
                {"role": "system", "content": "answer briefly."},
                {"role": "user", "content": q}, {"role": "assistant", "content": a},
                {"role": "user", "content": f"and the {other}?"},
                {"role": "assistant", "content": f"the {other} is {facts[other]}."}]})
    return out


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def build_tokenizer(out_dir: Path, vocab_size: int = 320) -> str:
    """Train a byte-level BPE on the fixture text, wrap it in PreTrainedTokenizerFast with the chat template, save."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [json.dumps(r) for r in conversations(200, seed=1)] + ["system user assistant answer briefly."]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return str(out_dir)
