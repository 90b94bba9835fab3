"""``python -m bench results``: the tables of bench/RESULTS.md, regenerated from the result files.

A generated table sits between two marker comments; everything outside them is prose and stays as written:

    <!-- bench:train_step results/train_step_h200_final.json tokens_per_s:,.0f mfu:.1% peak_gib:.1f -->
    (the table: one line per row of the file: case, impl, the named metrics, status)
    <!-- /bench -->

The opening marker names the suite, the result file (relative to the markdown file's folder) and the metric columns, each optionally
with a format spec after ``:`` (default ``.4g``). ``--check`` changes nothing and exits 1 when a table is stale.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Optional

from bench.core.schema import load
from bench.core.text import md_table

BENCH = Path(__file__).resolve().parent
BLOCK = re.compile(r"(?P<open><!-- bench:(?P<spec>[^\n]*?) -->)\n(?P<body>.*?)(?P<close><!-- /bench -->)", re.S)


def parse_spec(spec: str) -> tuple[str, str, list[tuple[str, str]]]:
    """``suite file col[:fmt] ...`` -> (suite, file, [(metric, format)])."""
    parts = spec.split()
    if len(parts) < 2:
        raise ValueError(f"marker 'bench:{spec}': expected 'bench:<suite> <result file> [metric[:format] ...]'")
    cols = [(c.split(":", 1)[0], c.split(":", 1)[1] if ":" in c else ".4g") for c in parts[2:]]
    return parts[0], parts[1], cols


def _cell(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    try:
        return format(v, spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"format {spec!r} does not fit the value {v!r}: {e}") from e


def table(doc: dict[str, Any], cols: list[tuple[str, str]]) -> str:
    rows = []
    for r in doc["rows"]:
        status = r["status"] if not r["note"] or r["status"] == "ok" else f"{r['status']}: {r['note'][:80]}"
        rows.append([r["case"], r["impl"], *(_cell(r["metrics"].get(m), f) for m, f in cols), status])
    return md_table(["case", "impl", *(m for m, _ in cols), "status"], rows)


def render(text: str, base: Path) -> str:
    """``text`` with every marked table regenerated from its result file (paths relative to ``base``)."""

    def one(m: re.Match) -> str:
        suite, file, cols = parse_spec(m["spec"])
        path = base / file
        if not path.exists():
            raise ValueError(f"marker 'bench:{m['spec']}': no result file {path}")
        return f"{m['open']}\n{table(load(path, suite), cols)}\n{m['close']}"

    return BLOCK.sub(one, text)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench results", description=__doc__.split("\n\n")[0])
    p.add_argument("--file", default=str(BENCH / "RESULTS.md"), help="the markdown file (default bench/RESULTS.md)")
    p.add_argument("--check", action="store_true", help="exit 1 if a table is not what its result file gives")
    args = p.parse_args(argv)
    path = Path(args.file)
    old = path.read_text()
    new = render(old, path.parent)
    n = len(BLOCK.findall(old))
    if args.check:
        stale = new != old
        print(f"{path}: {n} generated tables, {'STALE (run python -m bench results)' if stale else 'up to date'}")
        return 1 if stale else 0
    path.write_text(new)
    print(f"{path}: {n} generated tables written")
    return 0
