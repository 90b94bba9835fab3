#!/usr/bin/env python
"""Where activation memory goes: the bytes autograd keeps for the backward, by the op that produced them.

One training forward (with the loss, as ``bench/train_step.py`` runs it) of the 8-layer Qwen3-30B-A3B-shaped bench
model in bf16 under saved-tensor hooks. Each saved tensor's storage is counted once (parameters and their views
excluded), attributed to the ATen op that created the storage (a dispatch mode records producers), and reported in
bytes per token per layer: the number to compare across layouts, batch sizes and memory options. The total is
printed next to ``torch.cuda.max_memory_allocated`` of the same forward, whose difference is what the forward holds
besides saved tensors (the loss's transients, allocator rounding).

Run (repository root):
    python -m bench saved_tensors --out bench/results/saved_tensors_h200.json     # H200: ~30 s
    python -m bench saved_tensors --device cpu --small                          # smoke test
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/saved_tensors.py ...` runs `python -m bench saved_tensors ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
from collections import defaultdict
from typing import Any, Optional

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

from bench import train_step as ts
from bench.core.schema import save as save_result


class _Producers(TorchDispatchMode):
    """Records the op that last allocated each storage (by data pointer: the caching allocator reuses addresses, so
    the latest allocation at an address is the live tensor's); views and in-place results (an output sharing an
    input's storage) do not count as producers."""

    def __init__(self) -> None:
        super().__init__()
        self.by_storage: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.device.type != "meta":
                ptr = o.untyped_storage().data_ptr()
                if ptr not in inputs:
                    self.by_storage[ptr] = func.overloadpacket.__name__
        return out


def account(model: torch.nn.Module, ids: torch.Tensor) -> tuple[dict[tuple[str, str, str], int], torch.Tensor]:
    """Saved bytes by (producer op, shape, dtype) for one forward with the loss; returns them and the loss."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    acct: dict[tuple[str, str, str], int] = defaultdict(int)
    rec = _Producers()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            return t
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            acct[(rec.by_storage.get(key, "(input)"), str(tuple(t.shape)), str(t.dtype).replace("torch.", ""))] += (
                t.untyped_storage().nbytes())
        return t

    with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels_BS=ids).loss_sum
    return dict(acct), loss


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="toy sizes (CPU smoke test)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--top", type=int, default=25, help="rows of the table")
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args(argv)
    if args.small:
        args.seq_len, args.batch_size = min(args.seq_len, 64), min(args.batch_size, 2)
    if min(args.layers, args.seq_len, args.batch_size, args.top) < 1:
        raise ValueError("--layers, --seq-len, --batch-size and --top must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = ts.pick_device(args.device)
    if device is None:
        print("--device cuda but CUDA is not available; use --device cpu")
        return 2
    from lightning_moe.models.transformer import MoETransformer

    cfg = ts.qwen_config(args)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    model.init_weights()
    model.train()
    tokens = args.batch_size * args.seq_len
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), device=device)
    ts.reset_memory(device)
    base = ts.allocated_gib(device)
    acct, loss = account(model, ids)
    peak = ts.peak_gib(device)
    loss.backward()  # the graph was real: it runs
    total = sum(acct.values())
    per = lambda b: b / tokens / cfg.num_layers  # noqa: E731
    rows = sorted(acct.items(), key=lambda kv: -kv[1])
    lines = [f"saved for the backward: {total / 2**30:.2f} GiB for {tokens} tokens x {cfg.num_layers} layers = "
             f"{per(total) / 1024:.1f} KiB per token per layer"
             + (f"; forward peak above the weights {peak - base:.2f} GiB" if peak is not None and base is not None else ""),
             "", "| producer | shape | dtype | KiB / token / layer | share |", "|---|---|---|---|---|"]
    for (op, shape, dt), b in rows[: args.top]:
        lines.append(f"| {op} | {shape} | {dt} | {per(b) / 1024:.2f} | {b / total:.1%} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = {"env": ts.environment(device), "args": vars(args), "tokens": tokens, "layers": cfg.num_layers,
               "saved_bytes": total, "forward_peak_gib": peak, "allocated_before_gib": base,
               "saved": [{"producer": op, "shape": shape, "dtype": dt, "bytes": b} for (op, shape, dt), b in rows],
               "table": table}
        save_result(args.out, out, "saved_tensors")
    return 0
