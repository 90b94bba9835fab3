"""The one result schema of the suites.

A result file is a JSON object with
    schema  SCHEMA_VERSION
    suite   the suite's name (``python -m bench --list``)
    env     ``bench.core.env.environment()``: versions, GPU, date, command line
    args    the suite's arguments
    rows    [{suite, case, impl, metrics: {name: number or None}, status, note}]: what tables are made of
plus the suite's own detail (per-step losses and times, traces, comparisons) under its own keys. ``status`` is one of
STATUSES. Files written before this schema (no ``schema`` key) are read through the same per-suite conversion
(``bench.rows``), so every result file gives rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "error", "skipped", "unavailable")
ROW_KEYS = ("suite", "case", "impl", "metrics", "status", "note")


def make_row(suite: str, case: str, impl: str, metrics: Mapping[str, Any], status: str, note: str = "") -> dict:
    """One row; ValueError for a status outside STATUSES or a metric that is not a number (or None)."""
    if status not in STATUSES:
        raise ValueError(f"row {suite}/{case}/{impl}: status {status!r} is not one of {STATUSES}")
    bad = {k: v for k, v in metrics.items() if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))}
    if bad:
        raise ValueError(f"row {suite}/{case}/{impl}: metrics must be numbers or None, got {bad}")
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    return {"suite": suite, "case": str(case), "impl": str(impl), "metrics": clean, "status": status,
            "note": str(note)}


def numbers(d: Mapping[str, Any], keys: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    """The numeric (not bool) values of ``d``, all of them or those of ``keys``."""
    pick = d.keys() if keys is None else [k for k in keys if k in d]
    return {k: d[k] for k in pick if isinstance(d[k], (int, float)) and not isinstance(d[k], bool)}


def status_of(r: Mapping[str, Any]) -> tuple[str, str]:
    """(status, note) of a suite's run record: skipped / unavailable / error keys, else its ``ok`` flag."""
    for key in ("skipped", "unavailable", "error"):
        if r.get(key):
            return key, str(r[key]) if not isinstance(r[key], bool) else ""
    if r.get("ok") is False:
        return "failed", str(r.get("note", ""))
    return "ok", ""


def finish(report: dict[str, Any], suite: str) -> dict[str, Any]:
    """``report`` with the schema's keys (its rows made by ``bench.rows``); checks it."""
    from bench.rows import rows_for

    rows = rows_for(suite, {k: v for k, v in report.items() if k not in ("schema", "suite", "rows")} | (
        {"rows": report["rows"]} if "schema" not in report and "rows" in report else {}))  # a pre-schema "rows"
    report["schema"] = SCHEMA_VERSION
    report["suite"] = suite
    report["rows"] = rows
    validate(report)
    return report


def save(path: str | Path, report: dict[str, Any], suite: str) -> Path:
    """Write ``report`` as a result file of ``suite`` (folders made as needed)."""
    path = Path(path)
    finish(report, suite)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def validate(doc: Mapping[str, Any]) -> None:
    for key in ("schema", "suite", "env", "args", "rows"):
        if key not in doc:
            raise ValueError(f"result file has no {key!r}: not written by bench.core.schema.save")
    if doc["schema"] != SCHEMA_VERSION:
        raise ValueError(f"result schema {doc['schema']!r}, this code reads {SCHEMA_VERSION}")
    for r in doc["rows"]:
        if tuple(r) != ROW_KEYS:
            raise ValueError(f"row keys {tuple(r)}, expected {ROW_KEYS}")
        make_row(**r)  # the same checks as when it was made


def load(path: str | Path, suite: Optional[str] = None) -> dict[str, Any]:
    """A result file, checked; a file from before the schema (``suite`` names its suite) gets its rows made."""
    doc = json.loads(Path(path).read_text())
    if "schema" not in doc:
        if suite is None:
            raise ValueError(f"{path}: written before the result schema; name its suite to read it")
        doc.setdefault("env", {})
        doc.setdefault("args", {})
        return finish(doc, suite)
    if suite is not None and doc["suite"] != suite:
        raise ValueError(f"{path} holds suite {doc['suite']!r}, not {suite!r}")
    validate(doc)
    return doc
