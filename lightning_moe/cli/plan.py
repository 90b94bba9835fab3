"""``lightning-moe plan``: parameters and memory of a preset or a fit YAML, per GPU for a parallel layout."""

from __future__ import annotations

import argparse
from typing import Any

from lightning_moe.cli.errors import PROG
from lightning_moe.cli.values import STRATEGY_NAMES, model_config_from_value
from lightning_moe.config import ModelConfig, preset_names
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.layout import RECOMPUTE_KINDS
from lightning_moe.plan import PRECISION_BYTES, format_layout_plan, format_plan, layout_plan


def _int_or_auto(value: str):
    """--dp-shard: a positive int or 'auto' (ParallelDims checks the value)."""
    return value if value.strip().lower() == "auto" else int(value)


_int_or_auto.__name__ = "int or 'auto'"

_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "bf16-true": "bf16-true", "bf16-mixed": "bf16-mixed",
                      "32-true": "32-true"}


def _plan_settings_from_yaml(path: str) -> dict[str, Any]:
    """What ``plan`` needs from a ``lightning-moe fit`` YAML: model config, world, sizes, precision, data sizes.

    Read with ``yaml.safe_load`` (no code runs). Raises ValueError naming what to fix."""
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    model = doc.get("model") or {}
    cfg_spec = model.get("config", "tiny") if isinstance(model, dict) else "tiny"
    cfg = ModelConfig.from_dict(model_config_from_value(cfg_spec or "tiny"))
    name = cfg_spec if isinstance(cfg_spec, str) else f"{path} (model.config)"
    trainer = doc.get("trainer") or {}
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if isinstance(devices, list):
        devices = len(devices)
    elif isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    world = devices * nodes if isinstance(devices, int) and isinstance(nodes, int) else None
    strategy = trainer.get("strategy")
    sizes: dict[str, Any] = {}
    ac, recompute_num_layers = "none", None
    if isinstance(strategy, dict):
        if not str(strategy.get("class_path", "")).endswith("MoEParallelStrategy"):
            raise ValueError(f"plan knows MoEParallelStrategy layouts; {path} uses {strategy.get('class_path')!r}")
        init = dict(strategy.get("init_args") or {})
        ac = init.pop("activation_checkpointing", "none")
        recompute_num_layers = init.pop("recompute_num_layers", None)
        sizes = {k: init[k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "etp") if k in init}
    elif strategy not in (None, "auto") + STRATEGY_NAMES and (world or 1) > 1:
        raise ValueError(f"plan knows MoEParallelStrategy layouts; {path} uses strategy {strategy!r}")
    precision = _PRECISION_ALIASES.get(str(trainer.get("precision", "32-true")), str(trainer.get("precision")))
    if precision == "bf16-true" and isinstance(model, dict) and model.get("master_dtype") in ("fp32", "float32"):
        precision = "bf16-true+master"  # the optimizer's fp32 masters and moments (MoELanguageModel.master_dtype)
    data = doc.get("data") or {}
    return {"config": cfg, "name": name, "world": world, "sizes": sizes, "precision": precision,
            "seq_len": data.get("seq_len", 256), "micro_batch": data.get("batch_size", 8), "ac": ac,
            "recompute_num_layers": recompute_num_layers}


def plan_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog=f"{PROG} plan",
        description="Parameter and memory plan for a preset (or a fit YAML). Without a layout: the whole model on one "
        "device. With --world (or --config): validates the layout and prints the PER-GPU bytes of weights, gradients "
        "and optimizer state per layer type, and the all-to-all volume per GPU.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    src.add_argument("--config", help="a `lightning-moe fit` YAML: its model.config, trainer devices x num_nodes and "
                     "precision, strategy sizes and data seq_len / batch_size (flags below override them)")
    p.add_argument("--precision", default=None, choices=sorted(PRECISION_BYTES),
                   help="default bf16-mixed (with --config: trainer.precision)")
    g = p.add_argument_group("layout (MoEParallelStrategy arguments; see docs/multi_gpu.md)")
    g.add_argument("--world", type=int, help="W: number of GPUs (devices x num_nodes)")
    g.add_argument("--dp-replicate", type=int, help="HSDP replicas (default 1)")
    g.add_argument("--dp-shard", type=_int_or_auto, help="FSDP shards of dense parameters (default auto: the rest)")
    g.add_argument("--cp", type=int, help="context parallel (default 1)")
    g.add_argument("--tp", type=int, help="tensor parallel with sequence parallel (default 1)")
    g.add_argument("--ep", type=int, help="expert parallel, folded over dp_shard x cp x tp (default 1)")
    g.add_argument("--etp", type=int, help="expert tensor parallel (default 1)")
    g.add_argument("--seq-len", type=int,
                   help="tokens per sequence (default min(4096, max_seq_len); with --config: data.seq_len)")
    g.add_argument("--micro-batch", type=int,
                   help="sequences per data-parallel rank per micro-batch (default 1; with --config: data.batch_size)")
    g.add_argument("--activation-checkpointing",
                   help="none (default), full (the forward all-to-alls run twice) or a comma-separated list of "
                   f"kinds to recompute among {', '.join(RECOMPUTE_KINDS)} (no all-to-all re-runs)")
    g.add_argument("--recompute-num-layers", type=int,
                   help="with full: only the first n blocks are recomputed (MoEParallelStrategy's recompute_num_layers)")
    args = p.parse_args(argv)
    flag_sizes = {k: getattr(args, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")
                  if getattr(args, k) is not None}
    layout_flags = bool(flag_sizes) or any(
        v is not None for v in (args.seq_len, args.micro_batch, args.activation_checkpointing, args.recompute_num_layers))
    if args.preset is not None:
        try:
            cfg = ModelConfig.from_preset(args.preset)
        except ValueError as e:
            p.error(str(e))
        name = args.preset
        if args.world is None:
            if layout_flags:
                p.error("layout options need --world W (the number of GPUs, devices x num_nodes)")
            print(format_plan(name, cfg, args.precision or "bf16-mixed"))
            return 0
        world, sizes, precision = args.world, flag_sizes, args.precision or "bf16-mixed"
        micro_batch = args.micro_batch if args.micro_batch is not None else 1
        seq_len, ac = args.seq_len, args.activation_checkpointing or "none"
        recompute_num_layers = args.recompute_num_layers
    else:
        import yaml

        try:
            y = _plan_settings_from_yaml(args.config)
        except (OSError, ValueError, TypeError, yaml.YAMLError) as e:
            p.error(f"--config {args.config}: {e}")
        cfg, name = y["config"], y["name"]
        world = args.world if args.world is not None else y["world"]
        if world is None:
            p.error(f"{args.config}: trainer.devices / num_nodes are not plain numbers: give --world W")
        sizes = {**y["sizes"], **flag_sizes}
        precision = args.precision or y["precision"]
        if precision not in PRECISION_BYTES:
            p.error(f"{args.config}: trainer.precision {precision!r} is not planned; give --precision, one of "
                    f"{sorted(PRECISION_BYTES)}")
        seq_len = args.seq_len if args.seq_len is not None else y["seq_len"]
        micro_batch = args.micro_batch if args.micro_batch is not None else y["micro_batch"]
        ac = args.activation_checkpointing or y["ac"]
        recompute_num_layers = (args.recompute_num_layers if args.recompute_num_layers is not None
                                else y["recompute_num_layers"])
    sizes.setdefault("dp_shard", "auto")
    try:
        dims = ParallelDims(world_size=world, **sizes)
        plan = layout_plan(cfg, dims, precision, seq_len, micro_batch, ac, recompute_num_layers)
    except ValueError as e:
        p.error(str(e))
    print(format_layout_plan(name, cfg, plan))
    return 0
