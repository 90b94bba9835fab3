"""No import cycle inside lightning_moe (issue 21 item 6): an AST-built graph of every import between its modules,
the ones inside functions too (a lazy import only hides a circle until it runs), has no cycle; and every module
imports on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import _lane as lane

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_moe"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body (``if TYPE_CHECKING:`` blocks excepted).
    ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``. The parent packages that
    Python runs first are not edges (every module would then lie on a circle through ``__init__``'s re-exports)."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}

    def known(name: str) -> Optional[str]:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in files:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                todo.extend(node.orelse)
                continue
            if isinstance(node, ast.Import):
                graph[module].update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                graph[module].update(filter(None, (known(f"{base}.{a.name}") or known(base) for a in node.names)))
            todo.extend(ast.iter_child_nodes(node))
        graph[module].discard(module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> Optional[list[str]]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_lightning_moe_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 40 and "lightning_moe.moe.layer" in graph["lightning_moe.models.transformer"]  # real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # the registry is a leaf: it knows names and factories, no model module
    assert graph["lightning_moe.models.registry"] == set()
    assert not graph["lightning_moe.config"], graph["lightning_moe.config"]


def test_the_graph_finds_a_circle_closed_by_a_lazy_or_relative_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nfrom pkg.sub import b\nA = 1\n"
                              "if TYPE_CHECKING:\n    from pkg import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..c import C\n")
    (pkg / "c.py").write_text("C = 1\n\ndef f():\n    import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}  # TYPE_CHECKING: no edge
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("C = 1\n")
    assert find_cycle(import_graph(pkg)) is None


_IMPORT_EACH = """
import importlib, sys
from lightning.pytorch.strategies import StrategyRegistry
failed = []
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "lightning_moe" or m.startswith("lightning_moe.")]:
        del sys.modules[m]  # torch and lightning stay loaded: only our modules start fresh
    StrategyRegistry.pop("moe_parallel", None)  # and the strategy's registration, which its import redoes
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("lightning_moe"):
            print("optional dependency missing:", name, e.name)
            continue
        failed.append(f"{name}: {e!r}")
    except Exception as e:
        failed.append(f"{name}: {e!r}")
print("FAILED", failed)
sys.exit(1 if failed else 0)
"""


@lane.job
def _import_each(tmp: Path, env: dict) -> subprocess.CompletedProcess:
    # the module names only: no ast.parse here, a lane thread (CPython 3.11's parser is not thread-safe: "AST
    # constructor recursion depth mismatch" when another thread parses at the same time)
    modules = sorted(_module_name(p, PACKAGE) for p in PACKAGE.rglob("*.py"))
    env = {**env, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), env.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return lane.run([sys.executable, "-c", _IMPORT_EACH, *modules], env=env, timeout=600)


def test_each_module_imports_first_in_a_fresh_interpreter():
    """Each module imported first in one fresh interpreter (lightning_moe's modules dropped before each: one
    interpreter per module would take minutes on this machine), so that no module works only when another happened
    to be imported before it."""
    out = lane.result(_import_each)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
