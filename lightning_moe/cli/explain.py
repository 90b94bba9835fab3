"""What jsonargparse rejected in a command line, said in one line from what the CLI knows itself (the parser's keys,
the signatures of our classes), not from jsonargparse's message: that is multi-line and nested, and its wording is
no interface. :meth:`MoECLI.parse_arguments` asks here when parsing fails."""

from __future__ import annotations

import difflib
import types
from collections.abc import Collection
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

from lightning_moe.cli.values import init_params


def _known(name: str, keys: Collection[str]) -> bool:
    """Whether ``--name`` is an option of a parser whose values have ``keys`` (dotted): a key itself (``+``
    appends to a list), a key's nested argument (``--optimizer.lr``), a group's config (``--model FILE``), or one
    of jsonargparse's own options."""
    name = name.removesuffix("+")
    if name in ("config", "print_config", "help") or name.endswith(".help") or name in keys:
        return True
    return any(name.startswith(k + ".") or k.startswith(name + ".") for k in keys)


def _describe(hint: Any) -> str:
    """``Optional[int]`` -> ``int or null``, ``Literal['a', 'b']`` -> ``'a', 'b'``."""
    if hint is type(None):
        return "null"
    if get_origin(hint) is Literal:
        return ", ".join(repr(a) for a in get_args(hint))
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(hint))
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def _rejects(hint: Any, value: str) -> bool:
    """Whether jsonargparse rejects ``value`` for a parameter typed ``hint`` (parsed on its own)."""
    from jsonargparse import ArgumentError, ArgumentParser

    probe = ArgumentParser(exit_on_error=False)
    probe.add_argument("--value", type=hint)
    try:
        probe.parse_args(["--value", value])
    except ArgumentError:
        return True
    return False


def explain(tokens: list[str], defaults: Any, classes: dict[str, Any], bases: dict[str, Any],
            prog: str) -> Optional[str]:
    """What jsonargparse rejected in ``tokens`` (one command's options), from what the CLI knows itself: the first
    option that is none of the keys of the parser's ``defaults``, with a close match, else the first value that the
    type of its parameter in ``classes`` (group name -> class, e.g. ``{"data": TextDataModule}``) rejects, else a
    nested option of a key that nothing set before it or that the class given to it (``bases``: key -> the base
    classes of its values, e.g. ``{"optimizer": (Optimizer,)}``) does not take or whose type rejects the value;
    None when none of these is found."""
    keys = list(defaults.keys())
    options = []  # (name, value) of every option in command-line order
    for i, token in enumerate(tokens):
        if not token.startswith("--") or token == "--":
            continue
        name, eq, value = token[2:].partition("=")
        options.append((name, value if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)))
    for name, _ in options:
        if not _known(name, keys):
            hint = difflib.get_close_matches(name, list(keys), n=1, cutoff=0.6)
            return f"unknown option --{name}" + (f" (did you mean --{hint[0]}?)" if hint else "") + \
                f"; see `{prog} --help`"
    for name, value in options:
        group, _, param = name.partition(".")
        if name not in keys or value is None or group not in classes or "." in param:
            continue
        if (found := _wrong_type(name, classes[group], param, value)) is not None:
            return found
    for n, (name, _) in enumerate(options):  # --optimizer.lr V: no --optimizer CLASS before it, or no such option
        key = next((k for k in bases if name.startswith(k + ".")), None)
        if key is None:
            continue
        given = [value for k, value in options[:n] if k == key] or [defaults.get(key)]
        if given[-1] is None:
            return f"--{name} needs --{key} first (e.g. --{key} CLASS_NAME; `{prog} --{key}.help CLASS_NAME` " \
                   "lists its options)"
        klass = _class_of(bases[key], given[-1])
        option = name[len(key) + 1:].removeprefix("init_args.").split(".")[0]
        if klass is None:
            continue
        if option not in (params := init_params(klass)):
            hint = difflib.get_close_matches(option, params, n=1)
            return f"unknown option --{name}" + (f" (did you mean {hint[0]!r}?)" if hint else "") + \
                f"; {klass.__name__} options: {', '.join(params)}"
        if (found := _wrong_type(name, klass, option, options[n][1])) is not None:
            return found
    return None


def _wrong_type(name: str, klass: type, param: str, value: Optional[str]) -> Optional[str]:
    """``--name value`` for the parameter ``param`` of ``klass``: the message when its type rejects the value."""
    try:
        hint = get_type_hints(klass.__init__).get(param)
    except (NameError, TypeError):  # an annotation that does not resolve here: nothing to say about it
        return None
    if hint is None or value is None or not _rejects(hint, value):
        return None
    return f"{name}: expected {_describe(hint)}, got {value!r}"


def _class_of(bases: Optional[tuple[type, ...]], value: Optional[str]) -> Optional[type]:
    """The class that ``--key value`` names for a key whose classes derive from ``bases``: a class path, a class
    name (among the loaded subclasses, as jsonargparse resolves it) or a spec with a ``class_path``; None when it
    names none."""
    import importlib

    import yaml

    if not bases or not isinstance(value, str):
        return None
    try:
        spec = yaml.safe_load(value)
    except yaml.YAMLError:
        return None
    path = spec.get("class_path") if isinstance(spec, dict) else spec
    if not isinstance(path, str):
        return None
    if "." in path:
        module, _, name = path.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None
        return found if isinstance(found, type) and issubclass(found, bases) else None
    seen, todo, matches = set(), list(bases), []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        matches += [cls] if cls.__name__ == path else []
        todo += cls.__subclasses__()
    return matches[0] if len(matches) == 1 else None
