"""``lightning-moe export CHECKPOINT OUT_DIR``: a checkpoint of any layout -> a Hugging Face folder.

Loads the checkpoint in one process (a ``.ckpt`` file or a distributed checkpoint directory; nothing in them is
executed) and writes ``config.json`` + sharded safetensors with ``model.safetensors.index.json`` that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (families qwen3_moe, mixtral, deepseek_v3, olmoe).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

__all__ = ["export_main"]

_DTYPES = ("bf16", "fp16", "fp32")


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "B": 1}
    t = text.strip().upper()
    for u, mult in units.items():
        if t.endswith(u) and t[: -len(u)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(u)]) * mult)
    if t.isdigit():
        return int(t)
    raise argparse.ArgumentTypeError(f"expected a size such as 5GB or 500MB, got {text!r}")


def export_main(argv: Optional[list[str]] = None) -> int:
    import torch

    from lightning_moe.checkpoint.find import LAST, resolve_checkpoint_arg
    from lightning_moe.checkpoint.offline import load_for_generation
    from lightning_moe.models.hf import EXPORT_MODEL_TYPES, save_hf
    from lightning_moe.module import infer_model_type

    p = argparse.ArgumentParser(prog="lightning-moe export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a .ckpt file or a distributed checkpoint directory (any layout); `last`: the "
                   "newest checkpoint under --default_root_dir")
    p.add_argument("out_dir", help="the Hugging Face folder to write (replaced only once complete)")
    p.add_argument("--model_type", choices=EXPORT_MODEL_TYPES, default=None,
                   help="the transformers family (default: inferred from the model config)")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="cast the weights (default: as stored; the fp32 master weights when the checkpoint holds them)")
    p.add_argument("--default_root_dir", default=None,
                   help="with `last`: the run's folder (default: the current directory)")
    p.add_argument("--max_shard_size", type=_size, default=5 * 2**30, help="largest safetensors shard (default 5GB)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype or "")
    try:
        checkpoint = resolve_checkpoint_arg(args.checkpoint, args.default_root_dir, "checkpoint")
        if args.checkpoint == LAST:
            print(f"lightning-moe export: last -> {checkpoint}", file=sys.stderr)
        model, cfg = load_for_generation(checkpoint)
        model_type = args.model_type or infer_model_type(cfg)
        files = save_hf(model, args.out_dir, cfg, model_type=model_type, max_shard_bytes=args.max_shard_size,
                        dtype=dtype)
    except (OSError, ValueError) as e:
        print(f"lightning-moe export: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir} ({model_type}, {len(files or [])} files): "
          f"transformers.AutoModelForCausalLM.from_pretrained({args.out_dir!r})")
    return 0


if __name__ == "__main__":
    sys.exit(export_main())
