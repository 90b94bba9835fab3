"""Multi-GPU check: a layout trains like one GPU on the same global batch.

    python -m bench parallel_check --layout none --out single.json                    # one GPU
    torchrun --nproc_per_node 2 -m bench parallel_check --layout ep=2 --out ep2.json
    torchrun --nproc_per_node 2 -m bench parallel_check --layout tp=2,ep=2,dp_shard=1 --out tp2ep2.json
    python -m bench parallel_check --compare single.json ep2.json tp2ep2.json         # table, 2% rule

Tiny preset, fp32 ("32-true", so layout differences are rounding only), AdamW, the embedded corpus read in
order (shuffle off): every layout sees the same global batch of ``--global-batch`` sequences per step.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/parallel_check.py ...` runs `python -m bench parallel_check ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import argparse
import json
import os
import time
from typing import Optional

from bench.core.env import environment
from bench.core.schema import save as save_result


def parse_layout(text: str) -> dict:
    if text in ("", "none"):
        return {}
    out: dict = {}
    for item in text.split(","):
        k, v = item.split("=")
        out[k.strip()] = v.strip() if k.strip() == "dispatcher" else int(v)
    return out


def layout_dims(layout: dict, world: int):
    """The ParallelDims of a parsed layout (``dispatcher`` aside; dp_shard takes what the world leaves unless given);
    a ValueError naming the fix when the layout cannot fit ``world`` ranks."""
    from lightning_moe.parallel.dims import ParallelDims

    sizes = {k: v for k, v in layout.items() if k != "dispatcher"}
    sizes.setdefault("dp_shard", -1)
    return ParallelDims(world_size=world, **sizes)


def run(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from lightning_moe import MoELanguageModel, MoEParallelStrategy, ModelConfig
    from lightning_moe.data import TextDataModule

    layout = parse_layout(args.layout)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if layout:
        dp = layout_dims(layout, world).num_data_shards
        strategy = MoEParallelStrategy(**layout)
    else:
        dp, strategy = 1, "auto"
    if args.global_batch % dp:
        raise ValueError(f"--global-batch {args.global_batch} must be divisible by the data-parallel size {dp}")

    class Record(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not args.cpu:
                torch.cuda.synchronize()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not args.cpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t)
            self.losses.append(float(pl_module.last_train_loss))

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lightning_moe.models.transformer import MoETransformer

    # identical starting weights in every run: a seeded unsharded init, loaded into the (sharded) model;
    # seeded init of sharded DTensors would differ from it
    torch.manual_seed(0)
    model_config = ModelConfig.from_preset("tiny")
    ref = MoETransformer(model_config)
    ref.init_weights()
    weights = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    del ref

    class SameInit(MoELanguageModel):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            dev = self.trainer.strategy.root_device
            set_model_state_dict(self.model, {k: v.to(dev) for k, v in weights.items()},
                                 options=StateDictOptions(full_state_dict=True))

    rec = Record()
    model = SameInit(model_config, lr=3e-3, warmup_steps=5)
    data = TextDataModule(seq_len=256, batch_size=args.global_batch // dp, shuffle=False, val_fraction=0.0)
    trainer = L.Trainer(
        accelerator="cpu" if args.cpu else "gpu", devices=world, strategy=strategy, precision=args.precision, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[rec],
    )
    trainer.fit(model, datamodule=data)
    if trainer.global_rank == 0:
        timed = rec.times[3:] or rec.times
        tokens = args.global_batch * 256
        res = {"layout": args.layout + ("" if args.precision == "32-true" else f" {args.precision}"),
               "world": world, "losses": rec.losses,
               "tokens_per_s": tokens / (sum(timed) / len(timed)), "torch": torch.__version__}
        save_result(args.out, {**res, "env": environment(), "args": vars(args)}, "parallel_check")
        print(json.dumps({k: v for k, v in res.items() if k != "losses"}), flush=True)


def compare(paths: list[str], tol: float) -> int:
    runs = [json.load(open(p)) for p in paths]
    ref = runs[0]
    print(f"reference: layout={ref['layout']} world={ref['world']}")
    print(f"{'step':>4} " + " ".join(f"{r['layout'] + ' W=' + str(r['world']):>22}" for r in runs))
    worst = {}
    for i, base in enumerate(ref["losses"]):
        row = []
        for r in runs:
            v = r["losses"][i]
            rel = abs(v - base) / abs(base)
            worst[r["layout"]] = max(worst.get(r["layout"], 0.0), rel)
            row.append(f"{v:>14.6f} ({rel:6.2e})")
        print(f"{i:>4} " + " ".join(row))
    ok = True
    for r in runs[1:]:
        good = len(r["losses"]) == len(ref["losses"]) and worst[r["layout"]] <= tol
        ok &= good
        print(f"{r['layout']:>20}: max rel diff {worst[r['layout']]:.2e} (limit {tol:.0%}) "
              f"{'OK' if good else 'FAIL'}; {r['tokens_per_s']:.0f} tokens/s vs {ref['tokens_per_s']:.0f} on one GPU")
    return 0 if ok else 1


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="none", help="e.g. 'ep=2' or 'tp=2,ep=2,dp_shard=1'; 'none' = one GPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--out", default="bench/results/parallel_check.json")
    p.add_argument("--compare", nargs="+", help="JSON files, the first is the reference")
    p.add_argument("--tol", type=float, default=0.02)
    p.add_argument("--precision", default="32-true", help="Lightning precision (32-true compares rounding only)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (a smoke test of this script)")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare, args.tol)
    run(args)
    return 0
