"""Test tiers (markers registered in pyproject.toml, where ``strict_markers`` refuses unknown ones).

- ``dist``: the test, or a fixture or module-level helper it reaches, starts several processes that form a process
  group: ``run_distributed`` (tests/_dist.py) or torchrun (``torch.distributed.run``). Set here, from the module's
  source (``_reaches``): nothing to write in a new multi-rank test.
- ``slow``: over ~5 CPU seconds of the test process (setup included). Set here for tests that start a Python
  subprocess (a fresh interpreter imports torch + lightning for 6-13 s) or reach a job of the second lane
  (tests/_lane.py); written as ``@pytest.mark.slow`` on others.
- ``bench``: the tests of a ``bench/`` script (the modules named ``test_*bench*``). Set here.
- ``quick``: everything else; ``python -m pytest -m quick`` is the developer's quick tier, plain ``python -m pytest``
  the full suite (CI). A run's summary gives the quick tests' CPU time and lists those over ``QUICK_LIMIT_S``.

The tests that reach a job of the second lane (tests/_lane.py: subprocess work that runs beside the rest of the
suite) run after all the others, and the lane starts the selected tests' jobs before the first test.
"""

import ast
import functools
import os
import sys
import time

# tests import the multi-rank launcher as a top-level module
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton picks interpreter or compiled functions when it is first imported (its standard library is decorated then),
# and importing lightning_moe imports it through torch._dynamo: without a GPU, the fused-kernel tests
# (tests/test_moe_kernels.py) need the interpreter chosen before any test module is collected.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

import _lane  # noqa: E402

QUICK_LIMIT_S = 5.0
DIST_NAMES = {"run_distributed"}
DIST_STRINGS = ("torch.distributed.run",)
SUBPROCESS_NAMES = {"subprocess"}


@functools.lru_cache(maxsize=None)
def _module_refs(path: str) -> dict[str, frozenset]:
    """Top-level function name -> the names, attributes and strings its body mentions."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    refs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name):
                    found.add(sub.id)
                elif isinstance(sub, ast.Attribute):
                    found.add(sub.attr)
                elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    found.add(sub.value)
            refs[node.name] = frozenset(found)
    return refs


def _reaches(item: pytest.Item) -> set:
    """Everything the test function, its fixtures and the module-level functions they name (transitively) mention."""
    refs = _module_refs(str(item.path))
    todo = [item.originalname, *item.fixturenames]
    seen, mentioned = set(), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in refs:
            continue
        seen.add(name)
        mentioned |= refs[name]
        todo.extend(refs[name])
    return mentioned


_lane_jobs: dict[str, list] = {}  # node id -> the lane jobs the test reaches


def _jobs(item: pytest.Function, mentioned: set) -> list:
    return [getattr(item.module, n) for n in sorted(mentioned) if _lane.is_job(getattr(item.module, n, None))]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        mentioned = _reaches(item)
        jobs = _jobs(item, mentioned)
        if jobs:
            _lane_jobs[item.nodeid] = jobs
        if mentioned & DIST_NAMES or any(s in m for m in mentioned for s in DIST_STRINGS):
            item.add_marker(pytest.mark.dist)
        if mentioned & SUBPROCESS_NAMES or jobs:
            item.add_marker(pytest.mark.slow)
        if "bench" in item.path.stem:
            item.add_marker(pytest.mark.bench)
        if not any(item.get_closest_marker(m) for m in ("dist", "slow", "bench")):
            item.add_marker(pytest.mark.quick)
    # the tests that wait for the lane last (stable otherwise): the lane works while the others run
    items[:] = [i for i in items if i.nodeid not in _lane_jobs] + [i for i in items if i.nodeid in _lane_jobs]


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    jobs = []
    for item in session.items:
        jobs += [j for j in _lane_jobs.get(item.nodeid, ()) if j not in jobs]
    _lane.start(jobs, owner=session)


def pytest_sessionfinish(session):
    _lane.stop(owner=session)


_quick_cpu_s: dict[str, float] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # CPU seconds of this process (setup + call + teardown): unlike wall time, they do not grow with the machine's load
    start = time.process_time()
    try:
        return (yield)
    finally:
        if item.get_closest_marker("quick"):
            _quick_cpu_s[item.nodeid] = time.process_time() - start


def pytest_terminal_summary(terminalreporter):
    if not _quick_cpu_s:
        return
    over = sorted(((s, n) for n, s in _quick_cpu_s.items() if s > QUICK_LIMIT_S), reverse=True)
    terminalreporter.section("quick tier")
    terminalreporter.write_line(f"{len(_quick_cpu_s)} quick tests ran on {sum(_quick_cpu_s.values()):.0f} CPU s")
    if over:
        terminalreporter.write_line(f"over {QUICK_LIMIT_S:.0f} CPU s each: mark them @pytest.mark.slow, or make them "
                                    "faster")
        for s, n in over:
            terminalreporter.write_line(f"{s:6.1f} s  {n}")


@pytest.fixture(autouse=True)
def _restore_environ():
    """A Trainer run in the test process leaves Lightning's rank variables (LOCAL_RANK, WORLD_SIZE, MASTER_PORT, ...)
    in os.environ; a later test's subprocess would inherit them and take itself for an externally launched rank."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
