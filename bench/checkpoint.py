"""Checkpoint save / resume on the GPU: save time (the training stall), load time, and that the resumed run
continues like the uninterrupted one.

    python -m bench checkpoint --dir /tmp/ck --layers 8 --out save1.json                       # 1 GPU: train, save, go on
    python -m bench checkpoint --dir /tmp/ck --layers 8 --resume --out resume1.json            # 1 GPU: resume, go on
    torchrun --nproc_per_node 2 -m bench checkpoint --dir /tmp/ck2 --layout ep=2 --out save2.json
    python -m bench checkpoint --dir /tmp/ck2 --resume --out resume21.json                     # 2 GPUs -> 1 GPU
    python -m bench checkpoint --compare save1.json resume1.json                               # 2% rule (bf16)

The model is the Qwen3-30B-A3B shape with ``--layers`` layers (bf16-true, fused AdamW) on a FIXED batch (the
same global batch every step, so the data position plays no part): the save run trains ``--steps`` steps, saves,
then trains ``--after`` more and records their losses; the resume run loads the checkpoint and trains the same
``--after`` steps. Each step's loss must match the save run's within 2% (bf16, other kernels' reduction order
under another layout).
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/checkpoint.py ...` runs `python -m bench checkpoint ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import json
import os
import time
from typing import Optional

from bench.core.env import environment
from bench.core.schema import save as save_result


def _layout(text: str) -> dict:
    return {} if text in ("", "none") else {k: int(v) for k, v in (i.split("=") for i in text.split(","))}


def run(args: argparse.Namespace) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_moe import MoELanguageModel, MoEParallelStrategy, ModelConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = _layout(args.layout)
    dp = world // (layout.get("tp", 1) * layout.get("cp", 1))
    cuda = not args.cpu
    if args.small:
        cfg = ModelConfig.from_preset("tiny", num_layers=args.layers or 2)
    else:
        cfg = ModelConfig.from_preset("qwen3_moe_30b_a3b", num_layers=args.layers or 8, max_seq_len=args.seq_len)
    g = torch.Generator().manual_seed(0)
    global_batch = torch.randint(0, 255, (args.global_batch, args.seq_len), generator=g)
    rank = int(os.environ.get("RANK", "0"))
    local = global_batch.chunk(dp)[rank // (world // dp)]

    class Fixed(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            n = (args.steps + args.after + 1) * len(local)
            rows = [{"input_ids": local[i % len(local)]} for i in range(n)]
            return DataLoader(rows, batch_size=len(local), shuffle=False)

    path = os.path.join(args.dir, "ckpt")
    out: dict = {"layout": args.layout, "world": world, "layers": cfg.num_layers, "async_save": args.async_save,
                 "params": cfg.count_params()["total"], "resume": args.resume}

    class Record(L.Callback):
        """Losses of every step; in the save run, a save after step ``--steps`` (timed: the training stall)."""

        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.losses.append(float(pl_module.step_result.loss))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if args.resume or trainer.global_step != args.steps:
                return
            if os.path.lexists(path):  # a previous run's checkpoint (a link to its version, or a directory)
                trainer.strategy.remove_checkpoint(path)
            if cuda:
                torch.cuda.synchronize()
            trainer.strategy.barrier()
            t0 = time.perf_counter()
            trainer.save_checkpoint(path)
            out["save_s"] = time.perf_counter() - t0
            if not args.async_save:  # an asynchronous checkpoint appears at its path at the end of fit
                out["checkpoint_gib"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**30

    torch.manual_seed(0)
    model = MoELanguageModel(cfg, lr=3e-4, warmup_steps=2, max_steps=100)
    rec = Record()
    total = args.steps + args.after
    trainer = L.Trainer(accelerator="cpu" if args.cpu else "gpu", devices=world,
                        strategy=MoEParallelStrategy(**layout, async_save=args.async_save), precision="32-true" if args.cpu else "bf16-true",
                        max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        use_distributed_sampler=False, callbacks=[rec])
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=Fixed(), ckpt_path=path if args.resume else None)
    out["fit_s"] = time.perf_counter() - t0
    if not args.resume and "checkpoint_gib" not in out:
        out["checkpoint_gib"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**30
    out["after_losses"] = rec.losses[-args.after:]
    out["losses"] = rec.losses
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def compare(files: list[str]) -> int:
    runs = [json.load(open(f)) for f in files]
    ref = runs[0]["after_losses"]
    worst = 0.0
    for f, r in zip(files, runs):
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["after_losses"], ref)]
        worst = max(worst, max(diffs or [0.0]))
        print(f"{f}: layout={r['layout']} world={r['world']} after_losses={[round(x, 4) for x in r['after_losses']]}"
              f" max rel diff {max(diffs or [0.0]):.2e}" + (f" save {r['save_s']:.1f}s ({r['checkpoint_gib']:.1f} GiB)"
                                                             if "save_s" in r else "")
              + f" fit {r['fit_s']:.1f}s")
    ok = worst < 0.02 and all(len(r["after_losses"]) == len(ref) for r in runs)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/lightning_moe_ckpt_bench")
    p.add_argument("--layout", default="none")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--after", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--async-save", action="store_true", help="DCP async_save: the stall is the state copy only")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--small", action="store_true", help="the tiny preset (CPU smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument("--compare", nargs="+", default=None)
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    out = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out, indent=1))
        if args.out:
            save_result(args.out, {**out, "env": environment(), "args": vars(args)}, "checkpoint")
    return 0
