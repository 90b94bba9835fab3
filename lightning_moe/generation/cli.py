"""``lightning-moe generate --ckpt_path ... --prompt ...``: continue prompts with a trained checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

import torch

from lightning_moe.checkpoint.find import LAST, resolve_checkpoint_arg
from lightning_moe.checkpoint.offline import checkpoint_tokenizer, load_for_generation
from lightning_moe.generation.decode import generate_text
from lightning_moe.generation.sampling import _check_sampling


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line and exit code 2, instead of argparse's usage dump and exit
        raise _ArgError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lightning-moe generate",
        description="Continue prompts with a trained lightning_moe model (any checkpoint layout, one process).",
    )
    p.add_argument("--ckpt_path", required=True, help="a Lightning .ckpt file or a distributed checkpoint directory; "
                   "`last`: the newest checkpoint under --default_root_dir")
    p.add_argument("--default_root_dir", default=None,
                   help="with --ckpt_path last: the run's folder (default: the current directory), as "
                   "--trainer.default_root_dir of `lightning-moe test`")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch of prompts")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--tokenizer", default=None,
                   help="a local Hugging Face tokenizer directory (default: the built-in byte tokenizer)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="default: the checkpoint's")
    return p


def generate_main(argv: Optional[list[str]] = None) -> int:
    """``lightning-moe generate``: prints, for each prompt, the prompt followed by its continuation (a blank line
    between prompts). Bad paths or arguments print one line to stderr and return 2."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        if args.max_new_tokens < 0:
            raise ValueError(f"--max_new_tokens must be >= 0, got {args.max_new_tokens}")
        _check_sampling(args.temperature, args.top_p, args.top_k)
        try:
            device = torch.device(args.device)
        except RuntimeError as err:
            raise ValueError(f"--device {args.device!r}: {err}") from None
        ckpt_path = resolve_checkpoint_arg(args.ckpt_path, args.default_root_dir, "--ckpt_path")
        if args.ckpt_path == LAST:
            print(f"lightning-moe generate: --ckpt_path last -> {ckpt_path}", file=sys.stderr)
        name = args.tokenizer
        if name is None and (name := checkpoint_tokenizer(ckpt_path)) is not None:
            if not os.path.isdir(os.path.expanduser(name)):
                raise ValueError(f"{args.ckpt_path} was trained with the tokenizer {name!r}, which is not there: give "
                                 "--tokenizer DIR (a copy of that tokenizer)")
            print(f"lightning-moe generate: the checkpoint's tokenizer: {name}", file=sys.stderr)
        if name is None:
            from lightning_moe.data.tokenizer import ByteTokenizer

            tokenizer: Any = ByteTokenizer()
        else:
            from lightning_moe.data.tokenizer import load_hf_tokenizer

            tokenizer = load_hf_tokenizer(name)
        model, config = load_for_generation(ckpt_path, device=device, dtype=_DTYPES.get(args.dtype))
        if name is None and config.vocab_size != len(tokenizer):
            print(f"lightning-moe generate: warning: the model has {config.vocab_size} tokens, the byte tokenizer "
                  f"{len(tokenizer)}, and the checkpoint names no tokenizer: give --tokenizer DIR", file=sys.stderr)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        texts = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, generator=generator)
    except (_ArgError, ValueError, FileNotFoundError, ImportError) as err:
        print(f"lightning-moe generate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    for i, (prompt, text) in enumerate(zip(args.prompt, texts)):
        if i:
            print()
        print(prompt + text)
    return 0
