"""One-line user errors of the command line: :class:`UsageError` and the parser that raises it.

A mistake in the command line, a config file or the data it names ends the command with one line on stderr,
``lightning-moe <command>: error: ...``, and exit status 2 (``main`` prints it).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

from lightning.pytorch.cli import LightningArgumentParser

PROG = "lightning-moe"


class UsageError(ValueError):
    """A mistake in the command line, a config file or the data it names: reported as one line, exit status 2."""


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
    if get_origin(hint) is Union:
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


def explain(tokens: list[str], keys: Collection[str], classes: dict[str, Any], prog: str) -> Optional[str]:
    """What jsonargparse rejected in ``tokens`` (one command's options), from what the CLI knows itself: the first
    option that is none of the parser's ``keys``, with a close match, else the first value that the type of its
    parameter in ``classes`` (group name -> class, e.g. ``{"data": TextDataModule}``) rejects; None when
    neither is found."""
    keys = list(keys)
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
        try:
            hint = get_type_hints(classes[group].__init__).get(param)
        except (NameError, TypeError):  # an annotation that does not resolve here: nothing to say about it
            continue
        if hint is not None and _rejects(hint, value):
            return f"{name}: expected {_describe(hint)}, got {value!r}"
    return None


class ParserError(UsageError):
    """jsonargparse rejected the command line; :meth:`MoECLI.parse_arguments` says what, with :func:`explain`."""


class MoEArgumentParser(LightningArgumentParser):
    """Parser errors become a UsageError with one line of text (the CLI prints it and exits 2)."""

    def error(self, message: str, ex: Optional[Exception] = None) -> Any:
        if not self.exit_on_error:  # jsonargparse's inner parsers: it handles their errors itself
            return super().error(message, ex)
        found = _find_usage_error(ex)
        raise (UsageError(str(found)) if found is not None else ParserError(_one_line(message))) from ex
