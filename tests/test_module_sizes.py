"""Module size rule (issue 21): no module of the package, the benchmarks or the tests over 700 lines, and one over 500
says in its first lines why it is one piece (the words "One piece" and the reason)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("lightning_moe", "bench", "tests")


def _modules() -> list[tuple[Path, int]]:
    out = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out.append((path, len(path.read_text(encoding="utf-8").splitlines())))
    return out


def test_no_module_over_700_lines_and_long_ones_say_why():
    modules = _modules()
    assert len(modules) > 100  # the walk found the project
    too_long = [f"{p.relative_to(REPO)} ({n} lines): split it into modules named for what they do"
                for p, n in modules if n > 700]
    assert not too_long, too_long
    unexplained = [f"{p.relative_to(REPO)} ({n} lines): say in its first 15 lines why it is one piece ('One piece "
                   "(about N lines): ...'), or split it" for p, n in modules
                   if n > 500 and "One piece" not in "\n".join(p.read_text(encoding="utf-8").splitlines()[:15])]
    assert not unexplained, unexplained
