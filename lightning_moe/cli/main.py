"""Command line: ``lightning-moe fit|validate|test|predict`` (LightningCLI), ``plan`` and ``generate``.

User errors (unknown keys, invalid values, unknown presets, missing files) end the command with one line on stderr,
``lightning-moe <command>: error: ...``, and exit status 2; set ``LIGHTNING_MOE_DEBUG=1`` for the traceback.

``model.config`` takes a preset name, a mapping of ModelConfig fields with an optional ``preset`` key, or a YAML file
holding such a mapping; every form resolves to the full set of fields at once, so ``--model.config.<field>`` overrides
given after it (on the command line or in a later config file) compose with the preset, and ``--print_config`` shows
the resulting fields.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerTypeTuple, instantiate_class
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

from lightning_moe.callbacks import LoadBalanceMonitor
from lightning_moe.callbacks.progress import MoEProgressBar
from lightning_moe.checkpoint import SafeCheckpointIO
from lightning_moe.checkpoint.find import newest_checkpoint
from lightning_moe.checkpoint.optimizer_state import accept_state_by_name
from lightning_moe.cli.argv import compose_args, compose_object, subcommand_index
from lightning_moe.cli.errors import PROG, MoEArgumentParser, ParserError, UsageError, _one_line
from lightning_moe.cli.explain import explain
from lightning_moe.cli.plan import plan_main
from lightning_moe.cli.resume import _checkpoint_meta, _load_directories_with_moe_parallel
from lightning_moe.cli.values import _as_plain, _bare_preset, _plain
from lightning_moe.data import TextDataModule
from lightning_moe.module import MoELanguageModel

TRAINER_COMMANDS = {
    "fit": "train a model (and validate it as configured)",
    "validate": "run one validation epoch",
    "test": "run one test epoch",
    "predict": "run prediction",
}
OTHER_COMMANDS = {
    "plan": "parameters and memory of a preset or a fit YAML, per GPU for a parallel layout",
    "generate": "sample text from a trained checkpoint",
    "export": "write a checkpoint of any layout as a Hugging Face folder (config.json + safetensors)",
}


class MoECLI(LightningCLI):
    """LightningCLI over MoELanguageModel and TextDataModule.

    ``fit`` adds a :class:`~lightning_moe.callbacks.LoadBalanceMonitor` with its defaults unless ``trainer.callbacks``
    already holds one (configure it there: ``class_path: lightning_moe.callbacks.LoadBalanceMonitor``).

    On top of LightningCLI: ``model.config`` resolves presets with field overrides (see the module docstring),
    ``--trainer.strategy moe_parallel`` selects MoEParallelStrategy, ``--optimizer X`` builds X when Lightning asks for
    the optimizers (the parameters exist only after ``configure_model``) with the model's warmup-cosine schedule unless
    ``--lr_scheduler`` is given, and data and model are checked against each other before a run starts. Only
    LightningCLI's public hooks are overridden (tests/test_code_rules.py checks that no private jsonargparse or
    LightningCLI step is).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", MoEArgumentParser)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # --optimizer / --lr_scheduler are built when Lightning asks for the optimizers (see
        # _optimizers_from_the_command_line); LightningCLI's automatic step would build them on a model that has no
        # parameters yet
        kwargs["auto_configure_optimizers"] = False
        self._parsers: list[LightningArgumentParser] = []  # those add_arguments_to_parser saw
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("prog", PROG)  # not the module file name under `python -m lightning_moe.cli`
        return super().init_parser(**kwargs)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                     subparser_kwargs: dict[str, Any]) -> None:
        self._with_subcommands = add_subcommands
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # LightningCLI warns when both `args` and sys.argv are given; main() passes sys.argv on purpose
        args = sys.argv[1:] if args is None else args
        subcommands = list(self.subcommands()) if self._with_subcommands else []
        composed = None
        try:
            if isinstance(args, dict):
                self.config = parser.parse_object(compose_object(args, subcommands))
            else:
                args = list(args)
                at = subcommand_index(args, subcommands)
                # the parser of the command's own options (jsonargparse names fit's `lightning-moe [options] fit`)
                own = parser if at is None else next(p for p in self._parsers if p.prog.split()[-1] == args[at])
                composed = compose_args(args, subcommands, own.get_defaults())
                self.config = parser.parse_args(composed)
        except ParserError as e:
            # jsonargparse's message is multi-line and nested, and its wording is no interface: say what is wrong
            # from the parser's keys and our classes' signatures, else its message on one line
            found = None
            if composed is not None:
                from lightning.pytorch.strategies import Strategy

                tokens = composed[composed.index(args[at]) + 1:] if at is not None else composed
                found = explain(tokens, own.get_defaults(), self._classes(),
                                {"optimizer": (Optimizer,), "lr_scheduler": LRSchedulerTypeTuple,
                                 "trainer.strategy": (Strategy,)}, own.prog.replace(" [options]", ""))
            raise UsageError(found or str(e)) from e
        except UsageError:
            raise
        except ValueError as e:  # a model.config that ModelConfig rejects (its message names the key and the fix)
            raise UsageError(_one_line(e)) from e
        self._apply_checkpoint()
        # LightningCLI's next (private) step re-parses the checkpoint's hyper-parameters over the values given now
        # and has no public switch; _apply_checkpoint did that step our way, so ckpt_path is kept out of its sight
        # until before_instantiate_classes puts it back
        sub = self.config.get("subcommand")
        self._given_ckpt_path = self.config[sub].get("ckpt_path") if sub else None
        if self._given_ckpt_path is not None:
            self.config[sub]["ckpt_path"] = None

    def _classes(self) -> dict[str, Any]:
        from lightning.pytorch import Trainer

        trainer = self.trainer_class if isinstance(self.trainer_class, type) else Trainer
        return {"model": self.model_class, "data": self.datamodule_class, "trainer": trainer}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self._parsers.append(parser)
        parser.add_argument("--resume_required", type=bool, default=False,
                            help="with --ckpt_path last: fail (exit 2) when there is no checkpoint to resume, instead "
                                 "of training from scratch")
        parser.add_optimizer_args((Optimizer,))
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple)

    def before_instantiate_classes(self) -> None:
        """With ``model.pretrained``, the model config comes from the folder: a bare preset next to it (tiny.yaml's
        ``config: tiny``, for training from scratch) gives way, with a note; fields that contradict the folder stay
        an error."""
        cfg = self.config[self.config["subcommand"]] if self.config.get("subcommand") else self.config
        if getattr(self, "_given_ckpt_path", None) is not None:
            cfg["ckpt_path"] = self._given_ckpt_path  # hidden from LightningCLI's own checkpoint step (parse_arguments)
        model = cfg["model"]
        given = _plain(model.get("config"))
        if model.get("pretrained"):
            preset = _bare_preset(given)
            if preset is not None:
                model["config"] = None
                print(f"{PROG}: model.config comes from {model['pretrained']}/config.json (model.pretrained), not "
                      f"the preset {preset!r}", file=sys.stderr)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except UsageError:
            raise
        except (ValueError, TypeError, OSError, MisconfigurationException) as e:
            raise UsageError(_one_line(e)) from e

    def _optimizers_from_the_command_line(self) -> None:
        """``--optimizer`` / ``--lr_scheduler``: built when Lightning calls ``configure_optimizers``, since
        MoELanguageModel has no parameters before ``configure_model`` (built now: "optimizer got an empty parameter
        list"). The model's own method stays the default (AdamW with its warmup-cosine schedule)."""
        optimizer_init = _section(self.config_init).get("optimizer")
        scheduler_init = _section(self.config_init).get("lr_scheduler")
        if not optimizer_init:
            if scheduler_init:
                raise UsageError(
                    "--lr_scheduler needs --optimizer; the default AdamW uses the model's own warmup-cosine schedule "
                    "(model.warmup_steps, model.min_lr_ratio, model.max_steps)")
            return
        optimizer_init = _as_plain(optimizer_init)
        scheduler_init = _as_plain(scheduler_init) if scheduler_init else None
        model = self.model

        def configure_optimizers() -> Any:
            return _build_optimizers(model, optimizer_init, scheduler_init)

        # the hook of this model object, as LightningCLI's automatic step sets it
        model.configure_optimizers = configure_optimizers

    def _check_data_and_model(self, stage: str) -> None:
        model, dm = self.model, self.datamodule
        if not isinstance(dm, TextDataModule):
            return
        cfg = model.config
        try:
            vocab = dm.vocab_size
            dm.set_model_limits(vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len)
            if vocab > cfg.vocab_size:
                raise UsageError(
                    f"the tokenizer has {vocab} tokens but model.config.vocab_size is {cfg.vocab_size}: "
                    f"set model.config.vocab_size >= {vocab}"
                )
            dm.setup(stage)  # read and check the data now: a bad file is a usage error, not a traceback mid-run
            dm.check_limits()
        except UsageError:
            raise
        except (ValueError, OSError, ImportError) as e:
            raise UsageError(_one_line(e)) from e

    def _announce_default_logger(self) -> None:
        """Lightning's default logger is TensorBoard when it is installed, else CSV (with a long warning, filtered by
        main); say in one line where the metrics go."""
        from lightning.pytorch.loggers import CSVLogger
        from lightning.pytorch.utilities import rank_zero_info

        trainer_cfg = _section(self.config).get("trainer") or {}
        logger = self.trainer.logger
        if trainer_cfg.get("logger") in (None, True) and type(logger) is CSVLogger:
            rank_zero_info(f"Metrics go to CSV files under {logger.root_dir} (`pip install tensorboard` for "
                           "TensorBoard logs, or choose one with --trainer.logger)")

    def _apply_checkpoint(self) -> None:
        # What --ckpt_path means for the values of the run (LightningCLI instead lets every hyper-parameter of
        # the checkpoint override what was given now). Here: values given now win (the module then continues the LR schedule with the new lr), the model shape
        # must match the checkpoint's, and `last` resolves to the newest checkpoint under default_root_dir.
        sub = self.config.get("subcommand")
        if not sub:
            return
        cfg = self.config[sub]
        ckpt_path = cfg.get("ckpt_path")
        if ckpt_path == "last":
            ckpt_path = cfg["ckpt_path"] = self._find_last(cfg, sub)
        if not ckpt_path:
            if sub != "fit" and not cfg["model"].get("pretrained"):
                print(f"{PROG}: no --ckpt_path: {sub} runs a freshly initialised model (give --ckpt_path PATH, or "
                      "--ckpt_path last for the newest checkpoint under --trainer.default_root_dir)", file=sys.stderr)
            return
        if Path(ckpt_path).expanduser().is_dir():
            _load_directories_with_moe_parallel(cfg, ckpt_path)
        ckpt = _checkpoint_meta(ckpt_path)
        tokenizer = (ckpt.get("datamodule_hyper_parameters") or {}).get("tokenizer")
        data = cfg.get("data")
        if tokenizer and data is not None and "tokenizer" in data and data["tokenizer"] is None:
            data["tokenizer"] = tokenizer  # the token ids of the checkpoint mean nothing in another vocabulary
            print(f"{PROG}: data.tokenizer comes from the checkpoint: {tokenizer}", file=sys.stderr)
        hp = ckpt.get("hyper_parameters")
        saved = hp.get("config") if hp else None
        if not isinstance(saved, dict):
            return
        model = cfg["model"]
        given = _plain(model.get("config"))
        if given is None or _bare_preset(given):
            # a preset without field overrides (tiny.yaml's `config: tiny`) gives way to the checkpoint's shape
            model["config"] = saved
            if given != saved:
                print(f"{PROG}: model.config comes from the checkpoint {ckpt_path}", file=sys.stderr)
        elif given != saved:
            diff = sorted(k for k in set(saved) | set(given) if saved.get(k) != given.get(k))
            raise UsageError(f"model.config differs from the checkpoint {ckpt_path} in {diff} (the checkpoint's "
                             f"weights have its shape): drop those settings to resume, or start a new run")
        others = {k: v for k, v in hp.items() if k != "config" and k in model and model[k] != v}
        if others:
            print(f"{PROG}: given now, replacing the checkpoint's: "
                  + ", ".join(f"{k}={model[k]!r} (checkpoint: {v!r})" for k, v in sorted(others.items())),
                  file=sys.stderr)

    def _find_last(self, cfg: Any, sub: str) -> Optional[str]:
        """The newest checkpoint (file or distributed directory) under the trainer's default_root_dir. None with a
        prominent message when ``fit`` finds none (an error with --resume_required); an error for the other
        commands, which would otherwise evaluate a freshly initialised model."""
        root = (cfg.get("trainer") or {}).get("default_root_dir") or os.getcwd()
        found = newest_checkpoint(root)
        if found:
            print(f"{PROG}: --ckpt_path last -> {found}", file=sys.stderr)
            return found
        msg = f"--ckpt_path last: no checkpoint under {root}"
        if sub != "fit":
            raise UsageError(f"{msg}: give the path of one (--ckpt_path PATH) or the run's folder "
                             "(--trainer.default_root_dir)")
        if cfg.get("resume_required"):
            raise UsageError(msg + " and --resume_required is set")
        bar = "!" * min(100, len(msg) + 40)
        print(f"{bar}\n{PROG}: {msg}: training starts FROM SCRATCH (--resume_required true makes this an error)"
              f"\n{bar}", file=sys.stderr)
        return None

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        # LightningCLI calls this right after building the model: the optimizers given are wired first, then data
        # and model are checked before the Trainer starts anything
        self._optimizers_from_the_command_line()
        if self.subcommand is not None:  # data and model are built: check them before the Trainer starts anything
            self._check_data_and_model(self.subcommand)
        plugins = (_section(self.config_init).get("trainer") or {}).get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if "plugins" not in kwargs and not any(isinstance(p, CheckpointIO) for p in plugins):
            # atomic, checksummed checkpoint files under every strategy (MoEParallelStrategy's default too)
            kwargs["plugins"] = plugins + [SafeCheckpointIO()]
        trainer_cfg = _section(self.config_init).get("trainer") or {}
        callbacks = trainer_cfg.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        if importlib.util.find_spec("rich") is not None and trainer_cfg.get("enable_progress_bar") is not False \
                and not any(isinstance(cb, ProgressBar) for cb in callbacks) and "callbacks" not in kwargs:
            kwargs["callbacks"] = callbacks + [MoEProgressBar()]  # Lightning's default bar, readable for step runs
        trainer = super().instantiate_trainer(**kwargs)
        if self.subcommand == "fit" and not any(isinstance(cb, LoadBalanceMonitor) for cb in trainer.callbacks):
            # routing health is on by default from the command line; a monitor in trainer.callbacks replaces it
            trainer.callbacks.append(LoadBalanceMonitor())
        return trainer

    def before_fit(self) -> None:
        self._announce_default_logger()

    def before_predict(self) -> None:
        if not getattr(self.datamodule, "predict_prompts", None):
            raise UsageError("nothing to predict: give the prompts with --data.predict_prompts '[\"def main(\"]'")


def _section(config: Any) -> Any:
    """The values of the command that runs (a subcommand's section, or the whole config without one)."""
    sub = config.get("subcommand")
    return config[sub] if sub else config


def _build_optimizers(model: Any, optimizer_init: dict[str, Any], scheduler_init: Optional[dict[str, Any]]) -> Any:
    """The user's optimizer over the model's own parameter groups (no weight decay on norms, biases and embeddings;
    the others take the optimizer's ``weight_decay``), with ``--lr_scheduler`` or else the model's warmup-cosine
    schedule (model.warmup_steps, model.min_lr_ratio, model.max_steps)."""
    import torch

    default = type(model).configure_optimizers(model)  # the groups and the schedule of the default AdamW
    base = default["optimizer"] if isinstance(default, dict) else default
    base_schedule = default.get("lr_scheduler") if isinstance(default, dict) else None
    groups = [{"params": g["params"], **({"weight_decay": 0.0} if g.get("weight_decay") == 0.0 else {})}
              for g in base.param_groups]
    optimizer = instantiate_class(groups, optimizer_init)
    accept_state_by_name(optimizer, model)  # resumes from optimizer states saved by parameter name, as AdamW does
    if scheduler_init:
        scheduler = instantiate_class(optimizer, scheduler_init)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
    schedule = base_schedule.get("scheduler") if isinstance(base_schedule, dict) else base_schedule
    if isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
    return optimizer


def _top_level_help() -> str:
    width = max(map(len, [*TRAINER_COMMANDS, *OTHER_COMMANDS]))
    rows = [f"  {name:<{width}}  {text}" for name, text in {**TRAINER_COMMANDS, **OTHER_COMMANDS}.items()]
    return "\n".join([
        f"usage: {PROG} <command> [options]",
        "",
        "Mixture-of-Experts training with PyTorch Lightning.",
        "",
        "commands:",
        *rows,
        "",
        f"Run `{PROG} <command> --help` for the options of a command, e.g.",
        f"  {PROG} fit --config examples/configs/tiny.yaml",
        f"  {PROG} fit --config examples/configs/tiny.yaml --model.config.num_layers 2 --print_config",
        f"  {PROG} plan --preset deepseek_v3",
    ])


def generate_command(argv: list[str]) -> int:
    """``lightning-moe generate``: lightning_moe.generation.generate_main, imported when asked for."""
    try:
        from lightning_moe.generation import generate_main
    except ModuleNotFoundError as e:
        if e.name not in ("lightning_moe.generation",):
            raise
        raise UsageError("`generate` is not available in this installation of lightning_moe "
                         "(lightning_moe.generation is missing); update the package") from e
    return int(generate_main(list(argv)) or 0)


class _DropTips(logging.Filter):
    """Lightning's advertising lines ('💡 Tip: ... try installing litlogger / litmodels') carry no information about
    the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("💡 Tip:")


def _quiet_third_party_noise() -> None:
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
    # LightningCLI's own calls of jsonargparse functions deprecated in 4.49 (skip_none, add_instantiator,
    # instantiate_classes): nothing a user of the command line can change
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"lightning\.pytorch\.cli")
    # counts batches per epoch while logging counts steps across epochs: wrong for step-based runs on small data
    warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging")
    # the module initialises CPU-sharded models from an unsharded copy: the DTensor RNG is not relied on
    warnings.filterwarnings("ignore", message=r"DTensor random operators may not have complete support on cpu")
    # Lightning's own use of a torch pytree API deprecated in torch 2.13
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    # the default logger is chosen and announced by the CLI itself (see _announce_default_logger)
    warnings.filterwarnings("ignore", message=r"Starting from v1\.9\.0, `tensorboardX` has been removed")


def main(argv: Optional[list[str]] = None) -> None:
    """``lightning-moe <command> ...``; exits with the command's status (2 for usage errors)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    if command in (None, "-h", "--help", "help"):
        print(_top_level_help(), file=sys.stdout if command else sys.stderr)
        sys.exit(0 if command else 2)
    debug = os.environ.get("LIGHTNING_MOE_DEBUG", "") not in ("", "0")
    try:
        if command == "plan":
            sys.exit(plan_main(argv[1:]))
        if command == "generate":
            sys.exit(generate_command(argv[1:]))
        if command == "export":
            from lightning_moe.export import export_main

            sys.exit(export_main(argv[1:]))
        if not command.startswith("-") and command not in TRAINER_COMMANDS:
            known = [*TRAINER_COMMANDS, *OTHER_COMMANDS]
            hint = difflib.get_close_matches(command, known, n=1)
            raise UsageError(f"unknown command {command!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                             + f"; commands: {', '.join(known)}")
        _quiet_third_party_noise()
        MoECLI(MoELanguageModel, TextDataModule, args=argv)
    except UsageError as e:
        if debug:
            raise
        where = f"{PROG} {command}" if command and not command.startswith("-") else PROG
        print(f"{where}: error: {e}", file=sys.stderr)
        sys.exit(2)
