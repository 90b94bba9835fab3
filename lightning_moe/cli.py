"""Command line: ``lightning-moe fit|validate|test|predict`` (LightningCLI), ``plan`` and ``generate``.

User errors (unknown keys, invalid values, unknown presets, missing files) end the command with one line on stderr,
``lightning-moe <command>: error: ...``, and exit status 2; set ``LIGHTNING_MOE_DEBUG=1`` for the traceback.

``model.config`` takes a preset name, a mapping of ModelConfig fields with an optional ``preset`` key, or a YAML file
holding such a mapping; every form resolves to the full set of fields at once, so ``--model.config.<field>`` overrides
given after it (on the command line or in a later config file) compose with the preset, and ``--print_config`` shows
the resulting fields.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import importlib.util
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Union

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, instantiate_class
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe.callbacks import LoadBalanceMonitor
from lightning_moe.callbacks.progress import MoEProgressBar
from lightning_moe.checkpoint import META_FILE, SafeCheckpointIO
from lightning_moe.checkpoint.find import newest_checkpoint
from lightning_moe.checkpoint.optimizer_state import accept_state_by_name
from lightning_moe.config import ModelConfig, preset_names, resolve_model_config
from lightning_moe.data import TextDataModule
from lightning_moe.module import MoELanguageModel
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.layout import RECOMPUTE_KINDS
from lightning_moe.plan import PRECISION_BYTES, format_layout_plan, format_plan, layout_plan

PROG = "lightning-moe"
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
#: names under which ``--trainer.strategy`` selects MoEParallelStrategy
STRATEGY_NAMES = ("moe_parallel", "MoEParallelStrategy")
_STRATEGY_CLASS_PATH = "lightning_moe.MoEParallelStrategy"


class UsageError(ValueError):
    """A mistake in the command line, a config file or the data it names: reported as one line, exit status 2."""


# ---- parsing -----------------------------------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _find_usage_error(ex: Optional[BaseException]) -> Optional[UsageError]:
    seen = set()
    while ex is not None and id(ex) not in seen:
        if isinstance(ex, UsageError):
            return ex
        seen.add(id(ex))
        ex = ex.__cause__ or ex.__context__
    return None


def _option_names(parser: Any) -> list[str]:
    names = []
    for action in parser._actions:
        names.extend(s for s in action.option_strings if s.startswith("--"))
    return names


def _pretty_types(text: str) -> str:
    """``[typing.Literal['a', 'b'], <class 'int'>, <class 'NoneType'>]`` -> ``'a', 'b', int, null``."""
    text = text.strip().removeprefix("[").removesuffix("]")
    text = re.sub(r"typing\.Literal\[([^\]]*)\]", r"\1", text)
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text)
    text = text.replace("NoneType", "null")
    return re.sub(r"Expected an? (.+?)\. Got value: (.*)$", r"expected \1, got '\2'", text)


def _distill(message: str, parser: Any) -> str:
    """jsonargparse's (often multi-line, nested) message as one line that names the key and what to change."""
    msg = str(message)
    if msg.lower().startswith("unrecognized arguments:"):
        unknown = msg.split(":", 1)[1].split()
        flag = next((u for u in unknown if u.startswith("--")), unknown[0] if unknown else "")
        key = flag.split("=", 1)[0]
        hint = difflib.get_close_matches(key, _option_names(parser), n=1, cutoff=0.6)
        return f"unknown option {key}" + (f" (did you mean {hint[0]}?)" if hint else "") + \
            f"; see `{parser.prog.replace(' [options]', '')} --help`"
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    key = next((line.split('"')[1] for line in lines if line.startswith('Parser key "')), None)
    given = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Given value:")), None)
    nested = re.match(r"NestedArg\(key='([^']*)', val=(.*)\)$", given or "")
    if nested:  # --key.sub VALUE
        key, given = f"{key}.{nested.group(1)}", nested.group(2).strip("'\"")
    if "Does not validate against any of the Union subtypes" in msg:
        errors: list[list[str]] = []  # one entry per subtype: its lines, the deepest (most specific) last
        block = lines[lines.index("Errors:") + 1:] if "Errors:" in lines else []
        for line in block:
            if line.startswith("Given value"):
                break
            if line.startswith("- "):
                errors.append([line[2:]])
            elif errors:
                errors[-1].append(line)
        specific = [e for e in errors if not re.match(r"Expected a (<class '(str|NoneType)'>)$", e[0])]
        if nested and len(specific) == 1:
            inner = re.sub(r'^Parser key "[^"]*":\s*', "", specific[0][-1])
            return f"{key}: {_pretty_types(inner)}"
        subtypes = next((line.split(":", 1)[1] for line in lines if line.startswith("Subtypes:")), "")
        return f"{key}: invalid value {given!r}; allowed: {_pretty_types(subtypes)}"
    single = re.match(r'Parser key "([^"]*)":\s*(.*)$', " ".join(lines))
    if single:
        return f"{single.group(1)}: {_pretty_types(single.group(2))}"
    return _one_line(msg)


class MoEArgumentParser(LightningArgumentParser):
    """Parser errors become a UsageError with one line of text (the CLI prints it and exits 2)."""

    def error(self, message: str, ex: Optional[Exception] = None) -> Any:
        if not self.exit_on_error:  # jsonargparse's inner parsers: it handles their errors itself
            return super().error(message, ex)
        found = _find_usage_error(ex)
        raise UsageError(str(found) if found is not None else _distill(message, self)) from ex


def _is_nested_arg(value: Any) -> bool:
    """jsonargparse passes ``--a.b.c VALUE`` for an action ``a.b`` as a namedtuple (key='c', val=VALUE)."""
    return isinstance(value, tuple) and hasattr(value, "key") and hasattr(value, "val")


def _as_plain(value: Any) -> Any:
    """Namespaces (jsonargparse) to nested dicts, without jsonargparse's bookkeeping keys."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _as_plain(v) for k, v in value.items() if k != "__path__"}
    return value


def _dataclass_fields(value: Any) -> Any:
    """A parsed dataclass value as a plain dict of its fields (jsonargparse keeps a dataclass inside a Union as
    ``{class_path: ..., init_args: {...}}``)."""
    value = _as_plain(value)
    if isinstance(value, dict):
        if "class_path" in value:
            value = value.get("init_args") or {}
        return {k: _dataclass_fields(v) for k, v in value.items()}
    return value


_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _parse_scalar(text: Any) -> Any:
    """A command-line value as YAML would read it (numbers, true/false, null, mappings); strings stay strings."""
    if not isinstance(text, str):
        return text
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-3 as a string
    return value


def _model_config_from_value(value: Any, previous: Any, where: str = "model.config") -> Optional[dict[str, Any]]:
    """The full, validated ModelConfig fields (a plain dict) for one value given to ``model.config``:

    - ``--model.config.<dotted key> V`` (a nested argument): the previous fields with that key replaced
      (``preset`` starts again from the named preset);
    - a preset name, an existing YAML file holding a mapping, or inline YAML/JSON of a mapping;
    - a mapping of fields with an optional ``preset`` key (fields absent take the preset's values, or the
      dataclass defaults without one), as in ``ModelConfig.from_dict``.
    """
    if _is_nested_arg(value):
        key, raw = str(value.key), value.val
        if key == "preset":
            return resolve_model_config(str(raw), where).to_dict()
        fields = _dataclass_fields(previous)
        if not isinstance(fields, dict):  # a preset name, or None: MoELanguageModel's default preset
            fields = resolve_model_config(previous if previous is not None else "tiny", where).to_dict()
        parts = key.split(".")
        overrides: dict[str, Any] = {}
        node = overrides
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_scalar(raw)
        # fields is complete and carries no preset key: the overrides apply to it, then everything is validated
        merged = _deep_update(fields, overrides)
        return resolve_model_config(merged, where).to_dict()
    if value is None or (isinstance(value, str) and _parse_scalar(value) is None):  # null, ~, "" (YAML nulls)
        return None  # MoELanguageModel's default: the tiny preset, or the config of `pretrained`
    if isinstance(value, ModelConfig):
        return value.to_dict()
    if isinstance(value, str):
        text = value.strip()
        if text in preset_names():
            return resolve_model_config(text, where).to_dict()
        looks_like_path = os.sep in text or text.endswith((".yaml", ".yml", ".json"))
        if looks_like_path and not os.path.isfile(os.path.expanduser(text)):
            raise UsageError(f"{where}: file {text!r} does not exist (give a preset name, one of "
                             f"{', '.join(preset_names())}, or the path of a YAML file of ModelConfig fields)")
        if os.path.isfile(os.path.expanduser(text)):
            import yaml

            with open(os.path.expanduser(text)) as f:
                loaded = yaml.safe_load(f)
            if not isinstance(loaded, dict):
                raise UsageError(f"{where}: the file {text!r} must hold a mapping of ModelConfig fields "
                                 "(optionally with a 'preset' key)")
            return resolve_model_config(loaded, where).to_dict()
        parsed = _parse_scalar(text)
        if isinstance(parsed, dict):
            return resolve_model_config(parsed, where).to_dict()
        return resolve_model_config(text, where).to_dict()  # an unknown preset name: the error lists them
    return resolve_model_config(_dataclass_fields(value), where).to_dict()


def _deep_update(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_update(out[k], v)
        else:
            out[k] = v
    return out


def _find_action(parser: Any, dest: str) -> Any:
    for action in parser._actions:
        if getattr(action, "dest", None) == dest:
            return action
    return None


def _wrap_check_type(action: Any, normalize: Callable[[Any, Any], Any]) -> None:
    """Make a jsonargparse action normalise every value it receives (command line, config files, defaults) before
    its own type check; errors from ``normalize`` surface as UsageError."""
    import inspect

    original = action._check_type
    accepted = set(inspect.signature(original).parameters)  # `mode` is newer than jsonargparse 4.39

    def _check_type(value, append=False, cfg=None, mode=None):
        previous = cfg.get(action.dest) if cfg is not None else None
        if previous is None:
            previous = action.default
        try:
            value = normalize(value, previous)
        except UsageError:
            raise
        except ValueError as e:
            raise UsageError(str(e)) from e
        kwargs = {"append": append, "cfg": cfg if _is_nested_arg(value) else None, "mode": mode}
        return original(value, **{k: v for k, v in kwargs.items() if k in accepted})

    action._check_type = _check_type


def _normalize_strategy(value: Any, previous: Any) -> Any:
    """``moe_parallel`` / ``MoEParallelStrategy`` given as a string become the class spec, so that
    ``--trainer.strategy.<arg> V`` can follow and ``--print_config`` shows the strategy's arguments; an unknown
    ``<arg>`` of MoEParallelStrategy is named with a close match."""
    if isinstance(value, str) and value.strip() in STRATEGY_NAMES + (_STRATEGY_CLASS_PATH,):
        return {"class_path": _STRATEGY_CLASS_PATH}
    prev = _as_plain(previous)
    if _is_nested_arg(value) and isinstance(prev, dict) and str(prev.get("class_path", "")).endswith(
            "MoEParallelStrategy"):
        import inspect

        from lightning_moe.strategies import MoEParallelStrategy

        params: list[str] = []
        for klass in MoEParallelStrategy.__mro__:  # **kwargs pass on to the base classes' arguments
            signature = inspect.signature(klass.__init__).parameters.values()
            params += [p.name for p in signature if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                       and p.name != "self" and p.name not in params]
            if not any(p.kind == p.VAR_KEYWORD for p in signature):
                break
        key = str(value.key).removeprefix("init_args.")
        if key not in params:
            hint = difflib.get_close_matches(key, params, n=1)
            raise UsageError(f"unknown option --trainer.strategy.{key}" + (f" (did you mean {hint[0]!r}?)" if hint
                             else "") + f"; MoEParallelStrategy options: {', '.join(params)}")
    return value


# ---- the LightningCLI ----------------------------------------------------------------------------------------------


class MoECLI(LightningCLI):
    """LightningCLI over MoELanguageModel and TextDataModule.

    ``fit`` adds a :class:`~lightning_moe.callbacks.LoadBalanceMonitor` with its defaults unless ``trainer.callbacks``
    already holds one (configure it there: ``class_path: lightning_moe.callbacks.LoadBalanceMonitor``).

    On top of LightningCLI: ``model.config`` resolves presets with field overrides (see the module docstring),
    ``--trainer.strategy moe_parallel`` selects MoEParallelStrategy, ``--optimizer X`` builds X when Lightning asks for
    the optimizers (the parameters exist only after ``configure_model``) with the model's warmup-cosine schedule unless
    ``--lr_scheduler`` is given, and data and model are checked against each other before a run starts.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", MoEArgumentParser)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("prog", PROG)  # not the module file name under `python -m lightning_moe.cli`
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # LightningCLI warns when both `args` and sys.argv are given; main() passes sys.argv on purpose
        self.config = parser.parse_object(args) if isinstance(args, dict) else parser.parse_args(args)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--resume_required", type=bool, default=False,
                            help="with --ckpt_path last: fail (exit 2) when there is no checkpoint to resume, instead "
                                 "of training from scratch")
        model_config = _find_action(parser, "model.config")
        if model_config is not None:
            _wrap_check_type(model_config, _model_config_from_value)
            model_config.default = model_config._check_type_(model_config.default)
            self._model_config_default = model_config.default
        strategy = _find_action(parser, "trainer.strategy")
        if strategy is not None:
            _wrap_check_type(strategy, _normalize_strategy)

    def before_instantiate_classes(self) -> None:
        """With ``model.pretrained``, the model config comes from the folder: a bare preset next to it (tiny.yaml's
        ``config: tiny``, for training from scratch) gives way, with a note; fields that contradict the folder stay
        an error."""
        cfg = self.config[self.config["subcommand"]] if self.config.get("subcommand") else self.config
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

    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        """``--optimizer`` / ``--lr_scheduler``: LightningCLI would build them here, on the parameters the model has
        now, and MoELanguageModel has none before ``configure_model`` ("optimizer got an empty parameter list").
        Build them when Lightning calls ``configure_optimizers`` instead."""
        optimizer_init = self._get(self.config_init, "optimizer")
        scheduler_init = self._get(self.config_init, "lr_scheduler")
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

        trainer_cfg = self._get(self.config, "trainer") or {}
        logger = self.trainer.logger
        if trainer_cfg.get("logger") in (None, True) and type(logger) is CSVLogger:
            rank_zero_info(f"Metrics go to CSV files under {logger.root_dir} (`pip install tensorboard` for "
                           "TensorBoard logs, or choose one with --trainer.logger)")

    def _parse_ckpt_path(self) -> None:
        # Replaces LightningCLI's step of the same name (private; no public hook sits between parsing and
        # instantiation), which lets every hyper-parameter of the checkpoint override what was given now.
        # Here: values given now win (the module then continues the LR schedule with the new lr), the model shape
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
        if given is None or given == _plain(getattr(self, "_model_config_default", None)) or _bare_preset(given):
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
        if self.subcommand is not None:  # data and model are built: check them before the Trainer starts anything
            self._check_data_and_model(self.subcommand)
        plugins = (self._get(self.config_init, "trainer", default={}) or {}).get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if "plugins" not in kwargs and not any(isinstance(p, CheckpointIO) for p in plugins):
            # atomic, checksummed checkpoint files under every strategy (MoEParallelStrategy's default too)
            kwargs["plugins"] = plugins + [SafeCheckpointIO()]
        trainer_cfg = self._get(self.config_init, "trainer", default={}) or {}
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


def _plain(value: Any) -> Any:
    """A jsonargparse Namespace as a plain dict (other values unchanged)."""
    return value.as_dict() if hasattr(value, "as_dict") else value


def _bare_preset(fields: Any) -> Optional[str]:
    """The name of the preset whose fields ``fields`` are exactly (a preset given without overrides), else None."""
    if not isinstance(fields, dict):
        return None
    return next((n for n in preset_names() if resolve_model_config(n).to_dict() == fields), None)


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


# ---- plan ----------------------------------------------------------------------------------------------------------


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
    cfg = ModelConfig.from_dict(_model_config_from_value(cfg_spec or "tiny", None))
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


# ---- entry point ---------------------------------------------------------------------------------------------------


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


if __name__ == "__main__":
    main()
