#!/usr/bin/env python
"""Multi-GPU scaling: per-GPU training throughput of lightning_moe layouts vs one GPU and vs transformers + FSDP2.

One piece (about 610 lines): the argument checks, the per-layout run and the gather over ranks share one run record
and one time budget; the trace analysis (bench/core/comm_trace.py) and the table (bench/scale_table.py) live apart.

Issues 12 (2 GPUs) and 15 (4 and 8 GPUs). One script for any world size: launched by ``torchrun`` it trains on every
process of the world; run by ``python`` it is the one-GPU reference. Each call writes one JSON file (rewritten after
every run, so a call cut short keeps what it measured); ``--compare`` merges JSON files of several calls into one
markdown table with the ratios.

What a call does (every run through the Lightning Trainer, one model alive at a time):

0. Measures the bf16 matmul rate (8192^3, ``bench/train_step.py``'s MFU denominator; rank 0's figure is used).
1. For each layout of ``--layouts`` and each routing of ``--routing``: ``MoELanguageModel`` under
   ``MoEParallelStrategy(**layout)`` on the 8-layer Qwen3-30B-A3B-shaped bench model (``--model qwen3``: vocab 151936,
   D 2048, 128 experts top-8, F 768) or the DeepSeek-V3-shaped one (``--model deepseek_v3``: the ``deepseek_v3``
   preset cut to 3 layers, the first dense, and 64 routed experts top-8 in 8 groups / top-4 groups, i.e. group-limited
   routing, one shared expert, MLA; ``bench/deepseek_v3_step.py``'s model), bf16-true, fused AdamW, ``--steps``
   optimizer steps on the embedded corpus. Routing ``learned`` is the router's own choice; ``forced`` is
   ``MoEConfig.force_balance`` (round-robin: every expert, hence every EP rank, gets the same number of tokens).
2. ``--peer``: the same Qwen3 model as ``transformers.Qwen3MoeForCausalLM`` (sdpa attention, the experts
   implementation transformers picks unless ``--hf-impl``) in a LightningModule under Lightning's
   ``ModelParallelStrategy`` (FSDP2 over all ranks, no expert parallelism: each decoder layer and then the root
   ``fully_shard``-ed over the data-parallel mesh, as Lightning documents), same batches and optimizer settings. It runs
   right after the first run of ours, so a time limit never drops it.
3. A table of this call's runs; the JSON (``--out``).

Per-GPU batch. ``--batch-per-gpu`` sequences of ``--seq-len`` tokens per GPU and step (default 4 x 4096 for Qwen3, 2 x
4096 for DeepSeek-V3, as the one-GPU benchmarks): the global batch is ``batch_per_gpu x W`` sequences, each data
shard (dp_replicate x dp_shard) reads ``batch_per_gpu x tp x cp`` of them (tp and cp peers share their samples).
Every figure is per GPU: tokens/s per GPU = global tokens per step / step time / W, where the step time of a step is
the slowest rank's (fwd + bwd + optimizer, ``torch.cuda.synchronize`` + ``perf_counter`` around each batch), averaged
over the steps after ``--warmup`` that are not profiled. TFLOP/s per GPU and MFU use the FLOP counts of
``bench/train_step.py`` (Qwen3: 6 N_active + 12 L H K S per token, attention non-causal) and
``bench/deepseek_v3_step.py`` (DeepSeek-V3: 3 x forward matmul FLOPs from MLA's shapes; the JSON's ``mfu`` uses its
non-causal count too, ``mfu_causal`` the causal one) against the measured matmul rate.

Ratios (``--compare``): ``vs 1 GPU`` = per-GPU tokens/s / tokens/s of our one-process run of the same model, routing,
per-GPU batch and precision (target >= 95% at 2 GPUs, issue 12; >= 90% at 8 GPUs with forced-balance routing, issue
15); ``vs transformers+FSDP2`` = per-GPU tokens/s / the peer's per-GPU tokens/s at the same world size and batch
(target >= 1.6x, issue 12; the peer routes as it learns, so the target is checked on learned routing). The table's
last column names the targets a row misses.

All-to-all exposure (``--profile``). torch.profiler (CPU + CUDA activities) records the last ``--profile-steps``
optimizer steps of each run (those steps are not timed); every rank writes a Chrome trace (rank 0's is kept next to
``--out``, the others are deleted after reading unless ``--keep-traces``). From the trace's GPU kernel events (``"cat":
"kernel"``): communication kernels are those whose name contains ``nccl`` (NCCL runs one kernel per collective:
``ncclDevKernel_AllGather_*``, ``_ReduceScatter_*``, ``_AllReduce_*``, ``_SendRecv``); the all-to-all kernels are the
communication kernels named ``SendRecv`` or ``AllToAll`` (NCCL runs ``all_to_all_single`` as grouped send/recv; FSDP2
and tensor parallel use no send/recv); compute kernels are all other kernels, which for any overlap with a
communication kernel means those on other streams (a kernel on the same stream cannot run beside it; NCCL may put a
synchronous collective on the compute stream, so streams are not classified). With A the union of the all-to-all
kernels' time intervals and C the union of the compute kernels' intervals, the exposed all-to-all time is |A| - |A n C|
(an all-to-all kernel runs and no compute kernel does). The JSON gives per rank and the table averages over ranks: |A|
per step, the exposed share (|A| - |A n C|) / |A| (issue 12's figure, target < 25%) and exposed time per step / timed
step time (issue 15's all-to-all share of step time). The same numbers for all NCCL kernels (FSDP's all-gathers and
reduce-scatters included) are in the JSON. Caveat: an NCCL kernel's duration includes waiting for its peers, so a rank
that arrives early counts that wait as all-to-all time. ``--analyse-trace FILE`` prints the analysis of any Chrome
trace. A CPU trace has no GPU kernels: the analysis then says so (its arithmetic is tested on a synthetic trace in
``tests/test_bench_scale.py``).

Time limit. ``--time-limit`` seconds for the whole call (imports included): a run starts only if the slowest run so far
still fits (rank 0 decides, every rank follows), a running one stops stepping at the deadline (every rank at the same
step; its timing then covers fewer steps, which the JSON says), ``TIME_RESERVE_S`` is kept for the last teardown and
the JSON. The process group is created by this script with ``--pg-timeout`` (a rank that fails alone makes the others
fail after that, not after NCCL's default 10 minutes). ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` are set first thing in every process (and so in
any child it starts).

Layouts: ``;``-separated; each a comma list of ``MoEParallelStrategy`` sizes (``dp_replicate``, ``dp_shard``, ``cp``,
``tp``, ``ep``, ``etp``; dp_shard takes what the world leaves) and optionally ``dispatcher=allgather``; ``none`` is
``MoEParallelStrategy()`` (on one process: the one-GPU reference). Every layout is checked against the world and the
model before anything runs (a ValueError naming the fix). ``ep=2,etp=2`` needs 4 ranks (ep x etp must divide the
ranks of a replica): on 2 GPUs the expert-tensor-parallel layout is ``etp=2``.

GPU commands (repository root). Each call is one device command: it prints a summary line per run and then the
table of its runs, writes its JSON, and ends within ``--time-limit`` (540 s, imports included; under 570 s of wall time
with torchrun's start). Estimates from the one-GPU benchmarks (a Qwen3 run ~50 s: build, 20 steps, teardown; a profile
adds ~20 s): a call that would still run past the limit skips its last runs (``skipped ...: --time-limit`` in the
table), to be run again with only those layouts. ``--compare`` needs no GPU (run it anywhere on the fetched JSON files).

  2 x H200 (issue 12), three calls:
    CUDA_VISIBLE_DEVICES=0 python -m bench scale --model qwen3 --routing learned,forced \\
        --out bench/results/scale_qwen3_w1.json                     # one-GPU reference: 2 runs, ~2-3 min
    torchrun --nproc_per_node 2 bench/scale.py --model qwen3 --layouts "ep=2" --routing learned,forced --peer \\
        --profile --out bench/results/scale_qwen3_w2_ep2.json       # ep=2 learned, the peer, ep=2 forced: ~4 min
    torchrun --nproc_per_node 2 bench/scale.py --model qwen3 --layouts "tp=2,ep=2;etp=2" --routing learned,forced \\
        --profile --out bench/results/scale_qwen3_w2_tp_etp.json    # 4 runs, ~5 min
    python -m bench scale --compare bench/results/scale_qwen3_w1.json bench/results/scale_qwen3_w2_*.json \\
        --table-out bench/results/scale_w2.md
  4 x H200 (issue 15), two calls (the one-GPU reference file serves every world size; measure it again on the same
  machine with the first command above when the session has the time):
    torchrun --nproc_per_node 4 bench/scale.py --model qwen3 --layouts "ep=4;tp=2,ep=2" --routing learned,forced \\
        --profile --out bench/results/scale_qwen3_w4.json           # 4 runs, ~5 min
    torchrun --nproc_per_node 4 bench/scale.py --model qwen3 --layouts "ep=2,etp=2" --routing learned,forced \\
        --profile --out bench/results/scale_qwen3_w4_etp.json       # 2 runs, ~3 min
  8 x H200 (issue 15), three calls:
    torchrun --nproc_per_node 8 bench/scale.py --model qwen3 --layouts "ep=8;tp=2,ep=8" --routing learned,forced \\
        --peer --profile --out bench/results/scale_qwen3_w8.json    # 4 runs + the peer, ~6 min; tp=2,ep=8 has
                                                                      # dp_shard=4 for attention, ep=8 for experts
    CUDA_VISIBLE_DEVICES=0 python -m bench scale --model deepseek_v3 --routing learned,forced \\
        --out bench/results/scale_dsv3_w1.json                      # one-GPU reference: 2 runs, ~3 min
    torchrun --nproc_per_node 8 bench/scale.py --model deepseek_v3 --layouts "ep=8" --routing learned,forced \\
        --profile --out bench/results/scale_dsv3_w8.json            # 2 runs, ~4 min
    python -m bench scale --compare bench/results/scale_*.json --table-out bench/results/scale.md

  What a call prints: per run ``### run i: <model> | ours <layout> | routing <r> | <W> GPU(s) ...``, Lightning's and
  train_step.py's lines (the top-kernel table of the profiled steps with ``--profile``), then ``[<model> | ours <layout>
  | <routing> | <W> GPU] tokens/s/GPU ... TFLOP/s/GPU ... peak ... GiB  a2a exposed ...%  loss a -> b  ok=True``; at the
  end the markdown table (columns: model, GPUs, layout, routing, tokens/s/GPU, TFLOP/s/GPU, MFU, peak GiB (max over
  ranks), vs 1 GPU, vs transformers+FSDP2, a2a ms/step, a2a exposed, exposed / step, loss first -> last, ok, missed
  targets) and ``total wall time``. The ratio columns are filled where the files given to ``--compare`` (or the call)
  hold the reference. Exit status 0 when every run that ran is ok (finite, falling loss, no error, profile read).

CPU smoke run (gloo, tiny configs of the presets' shapes, ~30 s on 2 cores; what ``tests/test_bench_scale.py`` runs):
    torchrun --standalone --nproc_per_node 2 bench/scale.py --device cpu --layouts "ep=2;tp=2,ep=2" --peer --profile \\
        --steps 3 --pg-timeout 60 --out /tmp/scale_w2.json
    python -m bench scale --device cpu --routing learned,forced --steps 3 --out /tmp/scale_w1.json
    python -m bench scale --compare /tmp/scale_w1.json /tmp/scale_w2.json
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/scale.py ...` runs `python -m bench scale ...`
    from _script import run_as_suite

    run_as_suite(__file__)

import time

_T_START = time.perf_counter()  # the time limit covers the whole call, imports included

import os  # noqa: E402

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import deepseek_v3_step as ds, train_step as ts  # noqa: E402
from bench.core.comm_trace import analyse_trace, profile_summary  # noqa: E402
from bench.core.schema import save as save_result  # noqa: E402
from bench.scale_table import PEER, load_runs, summary_line, table  # noqa: E402
from bench.parallel_check import layout_dims, parse_layout  # noqa: E402

MODELS = ("qwen3", "deepseek_v3")
ROUTINGS = ("learned", "forced")
LAYOUT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "ep", "etp", "dispatcher")
# kept after the deadline: the last run's teardown (ours moves its model and optimizer state to the host), its trace,
# the gather, the table and the JSON
TIME_RESERVE_S = 40.0
_RANK = int(os.environ.get("RANK", "0"))


def log(*a: Any) -> None:
    """Rank 0 prints; the other ranks' failures reach rank 0 through the gathered results."""
    if _RANK == 0:
        print(*a, flush=True)


# ---------------------------------------------------------------------------------------------------- config
def model_config(model: str, tiny: bool, layers: int, seq_len: int) -> Any:
    """The bench model of ``model`` (``--device cpu``: a tiny config of the same preset and features)."""
    from lightning_moe.config import ModelConfig

    if model == "deepseek_v3":
        return ds.model_config(tiny)
    if not tiny:
        return ModelConfig.from_preset("qwen3_moe_30b_a3b", num_layers=layers)
    # qk-norm, GQA, 8 experts top-2; sizes multiples of 16 bytes (torch._grouped_mm), heads divisible by tp=2
    return ModelConfig.from_preset(
        "qwen3_moe_30b_a3b", num_layers=layers, vocab_size=512, hidden_size=64, num_heads=4, num_kv_heads=2,
        head_dim=16, dense_hidden_size=128, max_seq_len=max(seq_len, 128),
        moe={"num_experts": 8, "top_k": 2, "expert_hidden_size": 32},
    )


def model_label(args: argparse.Namespace, cfg: Any) -> str:
    base = f"qwen3-30b-a3b-{cfg.num_layers}L" if args.model == "qwen3" else ds.LABEL
    return base + ("-tiny" if args.device == "cpu" else "")


def model_flops(model: str, cfg: Any, seq_len: int) -> dict[str, Any]:
    """FLOPs per token (``flops_per_token`` non-causal, ``flops_per_token_causal``) of the one-GPU benchmarks."""
    return ts.flops_per_token(cfg, seq_len) if model == "qwen3" else ds.step_flops(cfg, seq_len)


def with_routing(cfg: Any, routing: str) -> Any:
    if routing == "learned":
        return cfg
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, force_balance=True))


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: Optional[list[str]] = None, world: Optional[int] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="qwen3")
    p.add_argument("--layouts", default=None,
                   help="';'-separated layouts, e.g. 'ep=2;tp=2,ep=2;etp=2'; 'none' = MoEParallelStrategy() "
                        "(default: 'none' on one process, 'ep=W' under torchrun)")
    p.add_argument("--routing", default=None, help="comma list of learned, forced (default learned)")
    p.add_argument("--forced-balance", action="store_true", help="the same as --routing forced")
    p.add_argument("--peer", action="store_true", help=f"also the {PEER} peer (Qwen3 only)")
    p.add_argument("--skip-ours", action="store_true", help="only the peer")
    p.add_argument("--hf-impl", default="default",
                   help="experts implementation of the peer ('default': transformers' choice)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 20; 4 on cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps at the start (default 5; 1 on cpu)")
    p.add_argument("--batch-per-gpu", type=int, default=None,
                   help="sequences per GPU and step (default 4 for qwen3, 2 for deepseek_v3; 2 on cpu)")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (64 on cpu)")
    p.add_argument("--layers", type=int, default=None, help="Qwen3 decoder layers (default 8; 2 on cpu)")
    p.add_argument("--lr", type=float, default=None, help="default 3e-4 (3e-3 on cpu)")
    p.add_argument("--precision", default=None, help="Lightning precision; default bf16-true (cuda), 32-true (cpu)")
    p.add_argument("--loss-impl", default="auto", help="MoELanguageModel(loss_impl=...)")
    p.add_argument("--compile", action="store_true", help="MoEParallelStrategy(compile=True) for every run of ours")
    p.add_argument("--no-shared-overlap", action="store_true",
                   help="MoELayer.overlap_shared_experts = False: the shared experts (DeepSeek-V3) run after the "
                   "combine instead of while the tokens travel; run with and without to measure the overlap")
    p.add_argument("--profile", action="store_true", help="all-to-all exposure from a trace of the last steps")
    p.add_argument("--profile-steps", type=int, default=None, help="profiled (untimed) steps (default 2; 1 on cpu)")
    p.add_argument("--keep-traces", action="store_true", help="keep every rank's trace (default: rank 0's)")
    p.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole call (0 = none)")
    p.add_argument("--pg-timeout", type=float, default=180.0, help="process-group timeout in seconds")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo and tiny configs (a smoke test of every code path)")
    p.add_argument("--out", default="bench/results/scale.json")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="merge these result files into the table and exit")
    p.add_argument("--table-out", default=None, help="with --compare: also write the markdown table here")
    p.add_argument("--analyse-trace", metavar="TRACE", help="print the all-to-all analysis of a Chrome trace and exit")
    args = p.parse_args(argv)
    if args.compare or args.analyse_trace:
        return args
    fill_defaults(args, int(os.environ.get("WORLD_SIZE", "1")) if world is None else world)
    check_args(args)
    return args


def fill_defaults(args: argparse.Namespace, world: int) -> None:
    cpu = args.device == "cpu"
    batch = 2 if cpu or args.model == "deepseek_v3" else 4
    for name, full, small in (("steps", 20, 4), ("warmup", 5, 1), ("seq_len", 4096, 64), ("lr", 3e-4, 3e-3),
                              ("layers", 8, 2), ("profile_steps", 2, 1), ("batch_per_gpu", batch, batch)):
        if getattr(args, name) is None:
            setattr(args, name, small if cpu else full)
    if args.precision is None:
        args.precision = "32-true" if cpu else "bf16-true"
    if args.routing is None:
        args.routing = "forced" if args.forced_balance else "learned"
    elif args.forced_balance:
        raise ValueError("--forced-balance is --routing forced: give one of them")
    if args.layouts is None:
        args.layouts = "none" if world == 1 else f"ep={world}"
    args.world = world


def layouts(args: argparse.Namespace) -> list[str]:
    return [t.strip() for t in args.layouts.split(";") if t.strip()]


def routings(args: argparse.Namespace) -> list[str]:
    return [t.strip() for t in args.routing.split(",") if t.strip()]


def layout_kwargs(text: str) -> dict[str, Any]:
    """``MoEParallelStrategy`` keyword arguments of one layout ('none' = none)."""
    try:
        out = parse_layout(text)
    except ValueError as e:
        raise ValueError(f"layout {text!r}: expected 'key=value,...' of {LAYOUT_KEYS} or 'none' ({e})") from None
    unknown = sorted(set(out) - set(LAYOUT_KEYS))
    if unknown:
        raise ValueError(f"layout {text!r}: unknown keys {unknown}; use {LAYOUT_KEYS}")
    return out


def check_args(args: argparse.Namespace) -> None:
    """User errors as ValueError, before any process group or model exists: the numbers, the routing, every layout
    against the world and the model."""
    from lightning_moe.models.lm_loss import LOSS_IMPLS

    if min(args.steps, args.batch_per_gpu, args.seq_len, args.layers, args.profile_steps) < 1:
        raise ValueError("--steps, --batch-per-gpu, --seq-len, --layers and --profile-steps must be positive")
    last_timed = args.steps - (args.profile_steps if args.profile else 0)
    if not 0 <= args.warmup < last_timed:
        profiled = f" minus {args.profile_steps} profiled" if args.profile else ""
        raise ValueError(f"--warmup {args.warmup} must be in [0, {last_timed}) (--steps {args.steps}{profiled}): "
                         "no step would be timed")
    if args.time_limit < 0 or args.pg_timeout <= 0:
        raise ValueError("--time-limit must be >= 0 (0 = none) and --pg-timeout > 0")
    if args.loss_impl not in LOSS_IMPLS:
        raise ValueError(f"--loss-impl must be one of {LOSS_IMPLS}, got {args.loss_impl!r}")
    bad = [r for r in routings(args) if r not in ROUTINGS]
    if bad or not routings(args):
        raise ValueError(f"--routing: a comma list of {ROUTINGS}, got {args.routing!r}")
    if args.peer and args.model != "qwen3":
        raise ValueError(f"the {PEER} peer is Qwen3MoeForCausalLM: use --model qwen3 or leave out --peer")
    if args.skip_ours and not args.peer:
        raise ValueError("--skip-ours without --peer leaves nothing to run")
    cfg = model_config(args.model, args.device == "cpu", args.layers, args.seq_len)
    if args.seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    for text in layouts(args) if not args.skip_ours else []:
        layout_dims(layout_kwargs(text), args.world).validate(cfg, seq_len=args.seq_len)


def plan(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(kind, layout, routing) in run order; the peer right after the first run of ours."""
    ours = [] if args.skip_ours else [("ours", lay, r) for lay in layouts(args) for r in routings(args)]
    peer = [("peer", f"FSDP2 dp={args.world}", "learned")] if args.peer else []
    return ours[:1] + peer + ours[1:]


# --------------------------------------------------------------------------------------- all-to-all exposure
# --------------------------------------------------------------------------------------------- distributed
def agree(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (decisions that must be the same everywhere)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def deadline_stop(deadline: Optional[float], stats: dict[str, Any]) -> Any:
    """A callback stopping fit at the deadline, on every rank at the same step (any rank past it stops all)."""
    import lightning as L

    class DeadlineStop(L.Callback):
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if deadline is None:
                return
            if trainer.strategy.reduce_boolean_decision(ds._past(deadline), all=False) and not trainer.should_stop:
                stats["stopped_by_time_limit_after_steps"] = trainer.global_step
                log(f"  --time-limit: stopping after {trainer.global_step} steps")
                trainer.should_stop = True

    return DeadlineStop()


# ------------------------------------------------------------------------------------------------ the peer
def peer_module(cfg: Any, args: argparse.Namespace, info: dict[str, Any]) -> Callable[[], Any]:
    """A factory of the transformers peer: ``Qwen3MoeForCausalLM`` of ``cfg`` (``bench/train_step.py``'s config
    mapping), built from the same seed on every rank on its device, then FSDP2 over the data-parallel mesh of
    Lightning's ``ModelParallelStrategy`` (each decoder layer, then the root); AdamW and schedule of train_step.py's
    transformers loop. The step's loss is transformers' (LM + aux); ``train_loss`` is logged without the aux term."""
    import lightning as L
    import transformers
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeForCausalLM

    dtype = torch.bfloat16 if "bf16" in args.precision else torch.float32

    class TransformersFSDP2(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.aux_coef = 0.0

        def configure_model(self) -> None:
            if self.model is not None:
                return
            hcfg = ts.hf_config(cfg, args.hf_impl)
            self.aux_coef = hcfg.router_aux_loss_coef
            model = ts.build_on(Qwen3MoeForCausalLM, hcfg, self.trainer.strategy.root_device, dtype)
            info.update(transformers=transformers.__version__,
                        experts_impl=str(getattr(model.config, "_experts_implementation", "?")),
                        attn_impl=str(getattr(model.config, "_attn_implementation", "?")),
                        params=sum(p.numel() for p in model.parameters()))
            mesh = self.device_mesh["data_parallel"]
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model.train()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            ids = batch["input_ids"]
            out = self.model(input_ids=ids, labels=ids, use_cache=False)
            aux = getattr(out, "aux_loss", None)
            self.log("train_loss", out.loss.detach() - (self.aux_coef * aux.detach() if aux is not None else 0.0))
            return out.loss

        def configure_optimizers(self) -> Any:
            opt, sched = ts.hf_optimizer(self.model, args.lr, args.steps, self.trainer.strategy.root_device)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TransformersFSDP2


# ---------------------------------------------------------------------------------------------------- one run
def run_one(index: int, kind: str, layout: str, routing: str, cfg: Any, args: argparse.Namespace,
            device: torch.device, peak: Optional[dict], fpt: dict, budget: Any) -> dict[str, Any]:
    """One run on every rank; the result (identical on every rank) merges all ranks' step times, peaks, errors and
    profiles."""
    world = args.world
    label = model_label(args, cfg)
    head = {"model": label, "kind": kind, "layout": layout, "routing": routing, "world": world,
            "batch_per_gpu": args.batch_per_gpu, "seq_len": args.seq_len, "precision": args.precision,
            "steps": args.steps, "warmup": args.warmup}
    stats: dict[str, Any] = {}
    callbacks: list[Any] = [deadline_stop(budget.deadline(), stats)]
    timed_end, prof = args.steps, None
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.profile:
        timed_end = args.steps - args.profile_steps
        trace = Path(args.out).with_name(f"{Path(args.out).stem}.run{index}.rank{rank}.trace.json")
        prof = ts.step_profiler(timed_end, args.profile_steps, trace, on_trace=analyse_trace)
        callbacks.append(prof)
    ns = argparse.Namespace(steps=args.steps, warmup=args.warmup, precision=args.precision, out=args.out,
                            profile=False, loss_impl=args.loss_impl)  # profiling is placed here (the last steps)
    info: dict[str, Any] = {}
    module = None
    try:
        if kind == "peer":
            try:
                import transformers  # noqa: F401
            except ImportError as e:
                return skipped_run(kind, layout, routing, args, label,
                                   f"skipped {PEER}: transformers cannot be imported ({ts._err(e)})")
            from lightning.pytorch.strategies import ModelParallelStrategy

            micro = args.batch_per_gpu
            head["dims"] = {"dp_shard": world}
            strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
            module = peer_module(cfg, args, info)
        else:
            from lightning_moe import MoEParallelStrategy

            lay = layout_kwargs(layout)
            dims = layout_dims(lay, world)
            head["dims"] = {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "etp",
                                                          "edp_shard")}
            micro = args.batch_per_gpu * world // dims.num_data_shards
            strategy = MoEParallelStrategy(**lay, compile=args.compile)
            from lightning_moe.moe.layer import MoELayer

            MoELayer.overlap_shared_experts = not args.no_shared_overlap  # this process's runs of ours
            head["overlap_shared_experts"] = MoELayer.overlap_shared_experts
    except Exception as e:  # e.g. transformers missing: this run fails, the others still go
        return {**head, "error": ts._err(e), "traceback": traceback.format_exc(), "ok": False}
    head["micro_batch_per_data_shard"] = micro
    log(f"\n### run {index}: {label} | {kind} {layout} | routing {routing} | {world} GPU(s), "
        f"{args.batch_per_gpu} x {args.seq_len} tokens per GPU")
    res = ts.run_ours(label, with_routing(cfg, routing), args.seq_len, micro, ns, args.lr, device, peak, timed=False,
                      strategy=strategy, extra_callbacks=tuple(callbacks), trainer_kwargs={"devices": world},
                      module=module)
    del strategy, module  # the strategy holds the trained module: free it before the next run
    ts.reset_memory(device)
    res["allocated_after_free_gib"] = ts.allocated_gib(device)
    if prof is not None:
        prof.finish()  # a window the time limit cut short
    if kind == "peer":
        res["impl"] = (f"transformers {info.get('transformers', '?')} Qwen3MoeForCausalLM "
                       f"({info.get('experts_impl', '?')} experts, {info.get('attn_impl', '?')}) + FSDP2 "
                       "(Lightning ModelParallelStrategy)")
        res["params"] = info.get("params")
    mine = {"times": res.get("step_times_s", []), "peak_gib": res.get("peak_gib"), "error": res.get("error"),
            "traceback": res.get("traceback"), "profile": prof.analysis if prof is not None else None}
    ranks = gather(mine)
    if prof is not None and rank != 0 and not args.keep_traces:
        trace.unlink(missing_ok=True)
    out = {**head, **{k: v for k, v in res.items() if k not in ("step_times_s", "traceback", "model", "steps")},
           **stats}
    return summarise(out, ranks, timed_end, fpt, peak)


def summarise(out: dict[str, Any], ranks: list[dict[str, Any]], timed_end: int, fpt: dict,
              peak: Optional[dict]) -> dict[str, Any]:
    """Per-GPU figures from every rank's step times (each step's slowest rank), peaks, errors and profiles."""
    world = out["world"]
    n = min(len(r["times"]) for r in ranks)
    slowest = [max(r["times"][i] for r in ranks) for i in range(n)]
    out["step_times_s"] = slowest
    errors = {i: r["error"] for i, r in enumerate(ranks) if r.get("error")}
    if errors:
        out["errors_by_rank"] = errors
        out["error"] = next(iter(errors.values()))
        out["traceback"] = next(r["traceback"] for r in ranks if r.get("error"))
        out["ok"] = False
        for i, r in enumerate(ranks):
            if r.get("error"):
                log(f"rank {i} failed:\n{r['traceback']}")
    peaks = [r["peak_gib"] for r in ranks if r.get("peak_gib") is not None]
    out["peak_gib"] = max(peaks) if peaks else None
    out["peak_gib_by_rank"] = [r.get("peak_gib") for r in ranks]
    # tokens per GPU and step: the per-GPU rate, TFLOP/s and MFU follow (train_step.timing_summary's "tokens_per_s")
    summary = ts.timing_summary(slowest[:timed_end], out["warmup"], out["batch_per_gpu"] * out["seq_len"], fpt, peak)
    out["timed_steps"] = summary.get("timed_steps", 0)
    out["step_time_mean_s"] = summary.get("step_time_mean_s")
    out["step_time_median_s"] = summary.get("step_time_median_s")
    out["tokens_per_s_per_gpu"] = summary.get("tokens_per_s")
    out["tokens_per_s"] = None if summary.get("tokens_per_s") is None else summary["tokens_per_s"] * world
    tps = out["tokens_per_s_per_gpu"]
    out["tflops_per_gpu"] = None if tps is None else tps * fpt["flops_per_token"] / 1e12  # also without a peak
    out["mfu"] = summary.get("mfu")
    out["mfu_causal"] = summary.get("mfu_causal")
    profiles = [r["profile"] for r in ranks if r.get("profile")]
    if profiles:
        out["profile"] = profile_summary(profiles, out["step_time_mean_s"])
        out.update({k: out["profile"].get(k) for k in ("a2a_ms_per_step", "a2a_exposed_share",
                                                        "a2a_exposed_step_share")})
        if out["profile"].get("error"):
            out["profile_error"] = out["profile"]["error"]
    return out


def skipped_run(kind: str, layout: str, routing: str, args: argparse.Namespace, label: str,
                reason: str) -> dict[str, Any]:
    log(f"\n{reason}")
    return {"model": label, "kind": kind, "layout": layout, "routing": routing, "world": args.world,
            "batch_per_gpu": args.batch_per_gpu, "seq_len": args.seq_len, "precision": args.precision,
            "skipped": reason}


# ------------------------------------------------------------------------------------------------------ main
def run_all(args: argparse.Namespace, device: torch.device) -> int:
    cfg = model_config(args.model, args.device == "cpu", args.layers, args.seq_len)
    fpt = model_flops(args.model, cfg, args.seq_len)
    budget = ds.Budget(args.time_limit, start=_T_START, reserve_s=TIME_RESERVE_S)
    env = ts.environment(device)
    if device.type == "cuda":
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001  (informational only)
            env["nccl"] = f"unknown ({ts._err(e)})"
    report: dict[str, Any] = {"script": "bench/scale.py", "args": vars(args), "env": env, "world": args.world,
                              "config": dataclasses.asdict(cfg), "flops": fpt, "runs": []}
    log(json.dumps(env))
    log(f"{model_label(args, cfg)}: {cfg.count_params()['total'] / 1e9:.3f}B parameters, "
        f"{fpt['flops_per_token'] / 1e9:.2f} GFLOP/token; {args.world} GPU(s); plan: {plan(args)}")
    try:
        peak = ts.measure_matmul_peak(device)
    except Exception as e:
        peak = None
        report["matmul_peak_error"] = ts._err(e)
    peak = agree(peak)  # rank 0's figure everywhere
    report["matmul_peak"] = peak
    if peak:
        log(f"matmul peak: {peak['n']}^3 {peak['dtype']}: {peak['flops_per_s'] / 1e12:.1f} TFLOP/s")
    runs: list[dict[str, Any]] = report["runs"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # on every rank: each writes its trace next to it

    def save() -> None:
        report["total_wall_s"] = budget.elapsed()
        if _RANK == 0:
            save_result(out, report, "scale")

    label = model_label(args, cfg)
    for index, (kind, layout, routing) in enumerate(plan(args)):
        what = f"{kind} {layout} ({routing})"
        reason = agree(budget.refusal(what))
        if reason:
            runs.append(skipped_run(kind, layout, routing, args, label, reason))
            continue
        t0 = time.perf_counter()
        r = run_one(index, kind, layout, routing, cfg, args, device, peak, fpt, budget)
        budget.ran(time.perf_counter() - t0)
        runs.append(r)
        log(summary_line(r))
        save()
    save()
    log("\n" + "=" * 100 + f"\n{label}, {args.world} GPU(s), {args.batch_per_gpu} x {args.seq_len} tokens per GPU, "
        f"{args.precision}\n" + table([dict(r) for r in runs]))
    log(f"total wall time {budget.elapsed():.0f}s (--time-limit {args.time_limit:.0f}s); JSON {args.out}")
    ran = [r for r in runs if not r.get("skipped")]
    return 0 if ran and all(r.get("ok") and not r.get("profile_error") for r in ran) else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.analyse_trace:
        print(json.dumps(analyse_trace(Path(args.analyse_trace), args.profile_steps or 1), indent=2))
        return 0
    if args.compare:
        text = table(load_runs(args.compare))
        print(text)
        if args.table_out:
            Path(args.table_out).write_text(text + "\n")
        return 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda but CUDA is not available; use --device cpu", file=sys.stderr)
            return 2
        torch.cuda.set_device(local_rank)
        torch.set_float32_matmul_precision("high")
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if args.world > 1:  # ours, so that its timeout holds for every strategy of the call
        kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=args.pg_timeout), **kw)
    ts.log = log  # train_step's messages from rank 0 only
    try:
        return run_all(args, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
