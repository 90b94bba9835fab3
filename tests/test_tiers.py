"""The tier markers of tests/conftest.py on a synthetic test module: a multi-rank launcher reached through a fixture
and a helper is ``dist``, a torchrun command line is ``dist``, a subprocess is ``slow``, a ``test_*bench*`` module is
``bench``, and only the rest is ``quick``; an unknown marker is refused (``strict_markers``)."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MODULE = '''
import subprocess
import sys

import pytest


def run_distributed(fn, world_size):  # stands in for tests/_dist.py's launcher: only the name matters
    return fn(0, world_size)


def _worker(rank, world_size):
    return rank


def _launch():
    return run_distributed(_worker, 2)


@pytest.fixture(scope="module")
def two_ranks():
    return _launch()


def test_through_a_fixture(two_ranks):
    assert two_ranks == 0


def test_direct():
    assert run_distributed(_worker, 2) == 0


def test_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "x.py"]
    assert cmd


def test_subprocess():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


@pytest.mark.slow
def test_marked_slow():
    pass


@pytest.mark.parametrize("x", [1, 2])
def test_plain(x):
    assert _worker(x, 1) == x
'''


@pytest.fixture
def project(pytester, monkeypatch):
    """A test directory with this suite's conftest.py and pytest settings."""
    # the installed plugins are not needed; re-importing them in every in-process run (hypothesis's) takes seconds
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest((HERE / "conftest.py").read_text())
    pyproject = (REPO / "pyproject.toml").read_text()
    pytester.makefile(".toml", pyproject=pyproject[pyproject.index("[tool.pytest.ini_options]"):])
    return pytester


@pytest.fixture
def suite(project):
    project.makepyfile(test_tiers_example=MODULE, test_x_bench=MODULE.replace("test_", "test_b_"))
    return project


def _selected(pytester, marker: str) -> set[str]:
    result = pytester.runpytest_inprocess("--collect-only", "-m", marker, "-p", "no:cacheprovider")
    return {line.split("::", 1)[1] for line in result.outlines if "::" in line and "bench" not in line.split("::")[0]}


def test_markers_follow_what_a_test_reaches(suite):
    assert _selected(suite, "dist") == {"test_through_a_fixture", "test_direct", "test_torchrun"}
    assert _selected(suite, "slow") == {"test_subprocess", "test_marked_slow"}
    assert _selected(suite, "quick") == {"test_plain[1]", "test_plain[2]"}
    bench = suite.runpytest_inprocess("--collect-only", "-m", "bench", "-p", "no:cacheprovider").outlines
    bench = [line for line in bench if "::" in line]
    assert len(bench) == 7 and all(line.startswith("test_x_bench.py::") for line in bench), bench


def test_unknown_marker_is_refused(project):
    project.makepyfile("import pytest\n\n@pytest.mark.slwo\ndef test_typo():\n    pass\n")
    result = project.runpytest_inprocess("--collect-only", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'slwo' not found in `markers` configuration option*"])
