"""The example a user copies: examples/configs/finetune_chat.yaml, offline on CPU. A tiny random Hugging Face MoE
folder and a small BPE tokenizer with a chat template; a few dozen fine-tuning steps on chat JSON Lines (the
validation loss, on assistant tokens only, falls); export; reload with transformers; generate."""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path

import torch

from _chat_data import build_tokenizer, conversations, write_jsonl

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "configs" / "finetune_chat.yaml"


def _hf_moe_folder(path: Path, vocab_size: int, eos_id: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=256, norm_topk_prob=True, eos_token_id=eos_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def test_finetune_chat_example_end_to_end(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_moe import MoELanguageModel
    from lightning_moe.cli import MoECLI
    from lightning_moe.data import TextDataModule
    from lightning_moe.export import export_main
    from lightning_moe.generation import generate

    tok_dir = build_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    hf_dir = _hf_moe_folder(tmp_path / "hf", len(tok), tok.eos_token_id)
    chat = write_jsonl(tmp_path / "chat.jsonl", conversations(120))
    monkeypatch.setattr(sys, "argv", ["lightning-moe"])
    cli = MoECLI(MoELanguageModel, TextDataModule, args=[
        "fit", "--config", str(EXAMPLE),
        f"--model.pretrained={hf_dir}", f"--data.tokenizer={tok_dir}", f"--data.files={chat}",
        "--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.max_steps=40",
        "--trainer.val_check_interval=20", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path / 'runs'}", "--model.lr=3e-3", "--model.warmup_steps=5",
        "--data.seq_len=128", "--data.batch_size=4", "--data.val_fraction=0.1"])
    module, dm = cli.model, cli.datamodule
    assert dm.chat_stats.conversations == 120 and dm.chat_stats.trained_labels > 0
    first, last = module.initial_val_loss, module.last_val_loss
    assert first is not None and last is not None and last < 0.7 * first, (first, last)

    ckpt = glob.glob(str(tmp_path / "runs" / "**" / "*.ckpt"), recursive=True)
    assert len(ckpt) == 1, ckpt  # the final checkpoint (fit prints its path)
    out = tmp_path / "exported"
    assert export_main([ckpt[0], str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()

    prompt = tok.apply_chat_template([{"role": "user", "content": "what color is the sky?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        ours = generate(module.model.eval(), ids, max_new_tokens=12, eos_token_id=tok.eos_token_id)
    n = min(theirs.shape[1], ours.shape[1])
    assert torch.equal(theirs[:, :n], ours[:, :n]) and n > ids.shape[1]
    answer = tok.decode(theirs[0, ids.shape[1]:], skip_special_tokens=True)
    assert re.match(r"the \w+ is \w+\.", answer), answer  # the answers' form, learned from the assistant turns
    assert os.path.isfile(out / "config.json")
