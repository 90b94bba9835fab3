"""One-line user errors of the command line: :class:`UsageError` and the parser that raises it.

A mistake in the command line, a config file or the data it names ends the command with one line on stderr,
``lightning-moe <command>: error: ...``, and exit status 2 (``main`` prints it).
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Optional

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
