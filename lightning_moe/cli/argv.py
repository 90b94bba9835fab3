"""The command line as jsonargparse is given it: ``model.config`` and ``--trainer.strategy`` composed first.

jsonargparse reads every value on its own: ``--model.config deepseek_v3 --model.config.num_layers 2`` would lose
the preset, and ``--model.config.moe.num_experts 4`` would replace the preset's ``moe`` block. So before parsing
(:meth:`MoECLI.parse_arguments`, LightningCLI's public hook), the sources of ``model.config`` (config files,
``--model.config V``, ``--model.config.<dotted key> V``) are composed here in command-line order, and each is
followed by (or replaced with) ``--model.config <the fields so far, as JSON>``: jsonargparse sees complete values
only, and ``--print_config`` shows them. In the same pass a name of MoEParallelStrategy given to
``--trainer.strategy`` (on the command line or in a config file) becomes its class spec, so that
``--trainer.strategy.<arg> V`` merges into it, and an unknown ``<arg>`` of it is named with a close match.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Collection
from typing import Any, Optional

from lightning_moe.cli.errors import UsageError
from lightning_moe.cli.values import (check_strategy_option, model_config_from_value, model_config_override,
                                      strategy_from_value)

MODEL_CONFIG = "model.config"
STRATEGY = "trainer.strategy"
#: options whose value is a config file (or inline YAML) of the whole command, of the model, of the trainer
_FILE_OPTIONS = {"config": (), "model": ("model",), "trainer": ("trainer",)}


def option(token: str) -> tuple[Optional[str], Optional[str]]:
    """``--a.b=V`` -> ("a.b", "V"); ``--a.b`` -> ("a.b", None); anything else (a value, ``-h``) -> (None, None)."""
    if not token.startswith("--") or token == "--":
        return None, None
    name, eq, value = token[2:].partition("=")
    return name, (value if eq else None)


class _Composer:
    """The values of ``model.config`` and ``trainer.strategy`` so far, while walking the command line."""

    def __init__(self, config: Any, strategy: Any) -> None:
        self.config = config
        self.strategy = strategy

    def config_tokens(self) -> list[str]:
        return [f"--{MODEL_CONFIG}", json.dumps(self.config)]

    def from_file(self, doc: dict[str, Any]) -> list[str]:
        """A config file's ``model.config`` and ``trainer.strategy``: the tokens that follow it."""
        out: list[str] = []
        model = doc.get("model")
        if isinstance(model, dict) and "config" in model:
            self.config = model_config_from_value(model["config"])
            out += self.config_tokens()
        trainer = doc.get("trainer")
        if isinstance(trainer, dict) and "strategy" in trainer:
            self.strategy = strategy_from_value(trainer["strategy"])
            if self.strategy is not trainer["strategy"]:  # a name of MoEParallelStrategy: its class spec follows
                out += [f"--{STRATEGY}", json.dumps(self.strategy)]
        return out

    def walk(self, tokens: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(tokens):
            name, value = option(tokens[i])
            ours = name is not None and (name in _FILE_OPTIONS or name.split(".")[:2] in (["model", "config"],
                                                                                         ["trainer", "strategy"]))
            if not ours:
                out.append(tokens[i])
                i += 1
                continue
            given = tokens[i:i + 1] if value is not None else tokens[i:i + 2]
            if value is None:
                if i + 1 >= len(tokens):  # no value: jsonargparse says so
                    out.append(tokens[i])
                    break
                value = tokens[i + 1]
            i += len(given)
            if name in _FILE_OPTIONS:
                doc = _load_mapping(value, must=name == "config")
                out += given
                if doc is not None:
                    for key in reversed(_FILE_OPTIONS[name]):
                        doc = {key: doc}
                    out += self.from_file(doc)
            elif name == MODEL_CONFIG:
                self.config = model_config_from_value(value)
                out += self.config_tokens()
            elif name.startswith(MODEL_CONFIG + "."):
                self.config = model_config_override(name[len(MODEL_CONFIG) + 1:], value, self.config)
                out += self.config_tokens()
            elif name == STRATEGY:
                self.strategy = strategy_from_value(value)
                out += given if self.strategy is value else [f"--{STRATEGY}", json.dumps(self.strategy)]
            else:  # --trainer.strategy.<arg> V: jsonargparse merges it into the strategy's spec
                check_strategy_option(name[len(STRATEGY) + 1:], self.strategy)
                out += given
        return out


def _load_mapping(value: str, must: bool) -> Optional[dict[str, Any]]:
    """The mapping a config option names (a YAML file, or inline YAML as jsonargparse accepts it); None when it
    holds none. ``must``: a value that is neither an existing file nor inline YAML of a mapping is a UsageError."""
    import yaml

    path = os.path.expanduser(value)
    try:
        if os.path.isfile(path):
            with open(path) as f:
                doc = yaml.safe_load(f)
        else:
            doc = yaml.safe_load(value)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        if must:
            raise UsageError(f"--config {value}: not a YAML file ({type(e).__name__})") from e
        return None
    if isinstance(doc, dict):
        return doc
    if must:
        raise UsageError(f"--config {value}: file does not exist" if not os.path.isfile(path) else
                         f"--config {value}: the file must hold a mapping of options")
    return None


def subcommand_index(args: list[str], subcommands: Collection[str]) -> Optional[int]:
    """Where the subcommand's name is in ``args`` (the root parser's only option with a value is ``--config``)."""
    return next((i for i, a in enumerate(args) if a in subcommands and (i == 0 or option(args[i - 1]) != ("config",
                                                                                                        None))), None)


def compose_args(args: list[str], subcommands: Collection[str], defaults: Any) -> list[str]:
    """``args`` with ``model.config`` and ``trainer.strategy`` composed (see the module docstring).

    ``subcommands``: the names of LightningCLI's subcommands (empty when it runs without); ``defaults``: the
    parser's defaults (a mapping of dotted keys), where the composition starts."""
    state = _Composer(defaults.get(MODEL_CONFIG), defaults.get(STRATEGY))
    at = subcommand_index(args, subcommands)
    if at is None:
        return state.walk(args)
    sub = args[at]
    head: list[str] = []
    for i, token in enumerate(args[:at]):  # the root parser's options: `--config FILE` holds `<sub>: {...}`
        name, value = option(token)
        if name == "config":
            value = value if value is not None else (args[i + 1] if i + 1 < at else None)
            doc = _load_mapping(value, must=True) if value is not None else None
            section = (doc or {}).get(sub)
            if isinstance(section, dict):
                head += state.from_file(section)
    return args[:at + 1] + head + state.walk(args[at + 1:])


def compose_object(obj: dict[str, Any], subcommands: Collection[str]) -> dict[str, Any]:
    """The same for a mapping given to LightningCLI as ``args``: ``model.config`` as its full fields and a name of
    MoEParallelStrategy as its class spec, in the mapping itself or in a subcommand's section."""
    obj = copy.deepcopy(obj)
    for section in [obj, *(obj[s] for s in subcommands if isinstance(obj.get(s), dict))]:
        model, trainer = section.get("model"), section.get("trainer")
        if isinstance(model, dict) and "config" in model:
            model["config"] = model_config_from_value(model["config"])
        if isinstance(trainer, dict) and "strategy" in trainer:
            trainer["strategy"] = strategy_from_value(trainer["strategy"])
    return obj
