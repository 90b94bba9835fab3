"""bench/core/exit.py: how ``python -m bench`` ends. Under torchrun: the suite's exit code, its output flushed, no
interpreter finalization (no atexit handler runs: the gloo race at finalization it avoids is described there);
elsewhere: ``sys.exit`` as before. Each case is a fresh interpreter that imports only the module (no torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

PROGRAM = textwrap.dedent("""
    import atexit, logging, sys
    from bench.core.exit import run_then_exit

    atexit.register(lambda: print("ATEXIT", flush=True))
    logging.basicConfig(filename=sys.argv[2], level=logging.INFO)

    def fn():
        print("partial line without a newline", end="")  # stays in the pipe's buffer unless flushed
        sys.stderr.write("to stderr")
        logging.getLogger("suite").info("logged")
        what = sys.argv[1]
        if what == "raise":
            raise RuntimeError("boom in the suite")
        if what == "exit-msg":
            sys.exit("a message for sys.exit")
        if what == "exit-0":
            raise SystemExit(0)
        if what == "none":
            return None
        return int(what)

    run_then_exit(fn)
""")


def _run(what: str, tmp_path: Path, torchrun: bool) -> tuple[subprocess.CompletedProcess, str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    env["PYTHONPATH"] = str(REPO)
    if torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    log = tmp_path / f"{what}.log"
    proc = subprocess.run([sys.executable, "-c", PROGRAM, what, str(log)], env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("what, rc", [("3", 3), ("0", 0), ("none", 0), ("exit-0", 0), ("exit-msg", 1), ("raise", 1)])
def test_under_torchrun_exit_code_output_and_no_finalization(tmp_path, what, rc):
    proc, log = _run(what, tmp_path, torchrun=True)
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    assert proc.stdout.startswith("partial line without a newline"), proc.stdout  # flushed before os._exit
    assert "to stderr" in proc.stderr and "logged" in log, (proc.stderr, log)
    assert "ATEXIT" not in proc.stdout, "the interpreter was finalized (atexit ran): the hard exit did not happen"
    if what == "raise":
        assert "RuntimeError: boom in the suite" in proc.stderr and "Traceback" in proc.stderr, proc.stderr
    if what == "exit-msg":
        assert "a message for sys.exit" in proc.stderr, proc.stderr


@pytest.mark.parametrize("what, rc", [("3", 3), ("none", 0), ("raise", 1)])
def test_elsewhere_a_normal_exit(tmp_path, what, rc):
    proc, log = _run(what, tmp_path, torchrun=False)
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    assert "ATEXIT" in proc.stdout and "partial line without a newline" in proc.stdout, proc.stdout
    assert "logged" in log


@pytest.mark.parametrize("torchrun", [True, False])
def test_the_runner_ends_through_it(torchrun):
    """``python -m bench`` (the entry every torchrun-started suite goes through, bench/_script.py's re-exec
    included): ``--list`` exits 0 with its output, finalized only outside torchrun."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    env["PYTHONPATH"] = str(REPO)
    if torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    code = ("import atexit, runpy; atexit.register(lambda: print('ATEXIT', flush=True)); "
            "runpy.run_module('bench', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, "--list"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "deepep_check" in proc.stdout, proc.stdout
    assert ("ATEXIT" in proc.stdout) is not torchrun, proc.stdout
