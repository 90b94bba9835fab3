"""``--ckpt_path`` on the command line: which checkpoint, read how, and what it says about the run."""

from __future__ import annotations

import sys
from typing import Any

from lightning_moe.checkpoint import META_FILE, SafeCheckpointIO
from lightning_moe.cli.errors import PROG, UsageError
from lightning_moe.cli.values import STRATEGY_NAMES, _as_plain


def _load_directories_with_moe_parallel(cfg: Any, path: str) -> None:
    """A distributed checkpoint (a directory) loads under MoEParallelStrategy only, at any layout: the plain
    configs (Lightning's default strategy) get it, with a note; another strategy is an error naming the flag."""
    from lightning_moe.strategies import MoEParallelStrategy

    trainer = cfg["trainer"]
    value = trainer.get("strategy")
    plain = _as_plain(value)
    name = plain.get("class_path") if isinstance(plain, dict) else plain
    if isinstance(value, MoEParallelStrategy) or (isinstance(name, str) and (
            name.strip() in STRATEGY_NAMES or name.endswith("MoEParallelStrategy"))):
        return
    if name not in (None, "auto"):
        raise UsageError(f"--ckpt_path {path} is a distributed checkpoint (a directory): it loads under "
                         f"MoEParallelStrategy (--trainer.strategy moe_parallel, any number of devices), not {name!r}")
    trainer["strategy"] = "moe_parallel"
    print(f"{PROG}: --ckpt_path {path} is a distributed checkpoint (a directory): loading it with "
          "MoEParallelStrategy (--trainer.strategy moe_parallel)", file=sys.stderr)


def _checkpoint_meta(path: str) -> dict[str, Any]:
    """A checkpoint file (its checksum verified) or a distributed checkpoint directory's metadata, read
    weights_only; a damaged or unreadable file is a UsageError naming it."""
    import torch

    from lightning_moe.checkpoint import CorruptCheckpointError, resolve

    p = resolve(path)
    meta = p / META_FILE if p.is_dir() else p
    if not meta.exists():
        raise UsageError(f"--ckpt_path {path}: no such checkpoint")
    try:
        ckpt = torch.load(meta, weights_only=True, map_location="cpu") if p.is_dir() else \
            SafeCheckpointIO().load_checkpoint(meta)
    except CorruptCheckpointError as e:
        raise UsageError(f"--ckpt_path {path}: {e}") from e
    except Exception as e:
        raise UsageError(f"--ckpt_path {path}: cannot be read as a checkpoint ({type(e).__name__}: {e})") from e
    return ckpt if isinstance(ckpt, dict) else {}
