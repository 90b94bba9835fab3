"""What the command line's values mean: ``model.config`` (presets, YAML files and mappings, composed with
``--model.config.<field>`` overrides into the full set of fields) and ``--trainer.strategy moe_parallel``."""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Optional

from lightning_moe.cli.errors import UsageError
from lightning_moe.config import ModelConfig, preset_names, resolve_model_config

#: names under which ``--trainer.strategy`` selects MoEParallelStrategy
STRATEGY_NAMES = ("moe_parallel", "MoEParallelStrategy")
_STRATEGY_CLASS_PATH = "lightning_moe.MoEParallelStrategy"


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


def model_config_override(key: str, raw: Any, previous: Any, where: str = "model.config") -> dict[str, Any]:
    """``--model.config.<dotted key> V``: the previous fields (a preset name, fields, or None for
    MoELanguageModel's default preset) with that key replaced, validated; ``preset`` starts again from the named
    preset."""
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
    return resolve_model_config(_deep_update(fields, overrides), where).to_dict()


def model_config_from_value(value: Any, where: str = "model.config") -> Optional[dict[str, Any]]:
    """The full, validated ModelConfig fields (a plain dict) for one value given to ``model.config``: a preset
    name, an existing YAML file holding a mapping, inline YAML/JSON of a mapping, or a mapping of fields with an
    optional ``preset`` key (fields absent take the preset's values, or the dataclass defaults without one), as in
    ``ModelConfig.from_dict``. None (or a YAML null) stays None: MoELanguageModel's default."""
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


def strategy_from_value(value: Any) -> Any:
    """``moe_parallel`` / ``MoEParallelStrategy`` given as a string become the class spec, so that
    ``--trainer.strategy.<arg> V`` can follow and ``--print_config`` shows the strategy's arguments; other values
    stay as they are."""
    if isinstance(value, str) and value.strip() in STRATEGY_NAMES + (_STRATEGY_CLASS_PATH,):
        return {"class_path": _STRATEGY_CLASS_PATH}
    return value


def init_params(klass: type) -> list[str]:
    """The names ``klass(...)`` accepts, those of its base classes included where ``**kwargs`` passes them on."""
    import inspect

    params: list[str] = []
    for cls in klass.__mro__:
        signature = inspect.signature(cls.__init__).parameters.values()
        params += [p.name for p in signature if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p.name != "self" and p.name not in params]
        if not any(p.kind == p.VAR_KEYWORD for p in signature):
            break
    return params


def check_strategy_option(key: str, strategy: Any) -> None:
    """``--trainer.strategy.<key> V`` over ``strategy`` (the value so far): an unknown ``<key>`` of
    MoEParallelStrategy is a UsageError with a close match (other strategies are jsonargparse's to check)."""
    plain = _as_plain(strategy_from_value(strategy))
    if not (isinstance(plain, dict) and str(plain.get("class_path", "")).endswith("MoEParallelStrategy")):
        return
    from lightning_moe.strategies import MoEParallelStrategy

    params = init_params(MoEParallelStrategy)
    key = key.removeprefix("init_args.")
    if key.split(".")[0] not in params:
        hint = difflib.get_close_matches(key, params, n=1)
        raise UsageError(f"unknown option --trainer.strategy.{key}" + (f" (did you mean {hint[0]!r}?)" if hint
                         else "") + f"; MoEParallelStrategy options: {', '.join(params)}")


def _plain(value: Any) -> Any:
    """A jsonargparse Namespace as a plain dict (other values unchanged)."""
    return value.as_dict() if hasattr(value, "as_dict") else value


def _bare_preset(fields: Any) -> Optional[str]:
    """The name of the preset whose fields ``fields`` are exactly (a preset given without overrides), else None."""
    if not isinstance(fields, dict):
        return None
    return next((n for n in preset_names() if resolve_model_config(n).to_dict() == fields), None)
