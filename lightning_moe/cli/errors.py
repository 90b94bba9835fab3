"""One-line user errors of the command line: :class:`UsageError` and the parser that raises it.

A mistake in the command line, a config file or the data it names ends the command with one line on stderr,
``lightning-moe <command>: error: ...``, and exit status 2 (``main`` prints it).
"""

from __future__ import annotations

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


class ParserError(UsageError):
    """jsonargparse rejected the command line; :meth:`MoECLI.parse_arguments` says what
    (:func:`lightning_moe.cli.explain.explain`)."""


class MoEArgumentParser(LightningArgumentParser):
    """Parser errors become a UsageError with one line of text (the CLI prints it and exits 2)."""

    def error(self, message: str, ex: Optional[Exception] = None) -> Any:
        if not self.exit_on_error:  # jsonargparse's inner parsers: it handles their errors itself
            return super().error(message, ex)
        found = _find_usage_error(ex)
        raise (UsageError(str(found)) if found is not None else ParserError(_one_line(message))) from ex
