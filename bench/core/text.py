"""Console output of the suites: the log line, error strings, number formats and markdown tables."""

from __future__ import annotations

from typing import Any, Sequence


def log(*a: Any) -> None:
    print(*a, flush=True)


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def fmt_cell(v: Any, spec: str) -> str:
    """``format(v, spec)``, or "-" right-aligned to the spec's width when ``v`` is None / NaN (table columns)."""
    if v is None or (isinstance(v, float) and v != v):
        width = "".join(c for c in spec.split(".")[0] if c.isdigit())
        return "-".rjust(int(width) if width else 1)
    return format(v, spec)


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table with padded columns."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])
