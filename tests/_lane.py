"""A second lane for the suite's subprocess work (bench smoke runs, fresh interpreters, the checkpoint kill writer):
it runs beside the rest of the suite, which keeps one core busy most of the time on a 2-core machine.

A test module declares such work as a job: a module-level function decorated with :func:`job`, called with a fresh
directory and the environment of the session's start, that runs its subprocesses through :func:`run` and returns
what the test checks::

    @lane.job
    def _smoke(out: Path, env: dict) -> subprocess.CompletedProcess:
        return lane.run([sys.executable, SCRIPT, "--out", str(out / "r.json")], env=env, timeout=300)

    def test_smoke():
        proc = lane.result(_smoke)          # waits for the job (or runs it here if no lane started it)
        assert proc.returncode == 0, proc.stderr

tests/conftest.py runs the tests that reach a job after all the others and starts one thread that runs the selected
tests' jobs, one at a time, in the order those tests come: by the time the first of them runs, most jobs are done.
A job runs once a session (its directory lives until the session ends) and raises in every test that asks for it
if it raised. Jobs never read ``os.environ`` or the current directory: the tests running meanwhile change both (a
Trainer leaves rank variables behind, ``monkeypatch.chdir``), so :func:`run` defaults to the session's start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

_lock = threading.Lock()
_futures: dict[str, Future] = {}
_procs: set[subprocess.Popen] = set()
_stopping = threading.Event()
_state: dict[str, Any] = {"root": None, "env": None, "cwd": None, "owner": None}


def job(fn: Callable[[Path, dict], Any]) -> Callable[[Path, dict], Any]:
    fn.lane_job = True
    return fn


def is_job(obj: Any) -> bool:
    return callable(obj) and getattr(obj, "lane_job", False) is True


def _key(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _session() -> tuple[Path, dict, str]:
    with _lock:
        if _state["root"] is None:  # no lane started (a test module run by another runner): start now
            _state.update(root=Path(tempfile.mkdtemp(prefix="lane_")), env=dict(os.environ), cwd=os.getcwd())
        return _state["root"], _state["env"], _state["cwd"]


def _execute(fn: Callable, future: Future) -> None:
    root, env, _ = _session()
    out = root / _key(fn).replace("<", "_").replace(">", "_")
    out.mkdir()
    try:
        future.set_result(fn(out, dict(env)))
    except BaseException as e:  # the test that asks re-raises it
        future.set_exception(e)


def _claim(fn: Callable) -> Optional[Future]:
    """A new future for ``fn`` if nobody started it yet, else None."""
    with _lock:
        if _key(fn) in _futures:
            return None
        future = _futures[_key(fn)] = Future()
        return future


def result(fn: Callable) -> Any:
    """The job's return value: waits for the lane, or runs the job here if the lane has not started it."""
    future = _claim(fn)
    if future is not None:
        _execute(fn, future)
    with _lock:
        future = _futures[_key(fn)]
    return future.result()


def start(jobs: Iterable[Callable], owner: Any) -> None:
    """Run ``jobs`` (in this order, each once) on a background thread; called once, before the first test, by the
    pytest session ``owner`` (a session run inside a test, by pytester, shares this module: it neither starts nor
    stops the lane)."""
    with _lock:
        if _state["owner"] is not None:
            return
        _state["owner"] = owner
    _session()
    todo = list(jobs)

    def lane() -> None:
        for fn in todo:
            if _stopping.is_set():
                return
            future = _claim(fn)
            if future is not None:
                _execute(fn, future)

    if todo:
        threading.Thread(target=lane, name="test-lane", daemon=True).start()


def run(cmd: list[str], *, env: dict, cwd: Optional[str | Path] = None, timeout: float,
        **popen_kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` that :func:`stop` can kill; ``cwd`` defaults to
    the session's start directory; raises subprocess.TimeoutExpired after ``timeout`` s (the process killed)."""
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kw.update(popen_kw)
    with subprocess.Popen(cmd, env=env, cwd=cwd or _session()[2], **kw) as proc:
        with _lock:
            _procs.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
        finally:
            with _lock:
                _procs.discard(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop(owner: Any) -> None:
    """At the end of the session ``owner``: start no more jobs, kill the running subprocesses, remove the jobs'
    directories."""
    with _lock:
        if _state["owner"] is not owner:
            return
    _stopping.set()
    with _lock:
        for proc in list(_procs):
            proc.kill()
        root = _state["root"]
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
