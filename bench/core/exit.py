"""How a benchmark process started by torchrun ends: flushed, then ``os._exit``, never interpreter finalization.

Why: a gloo worker thread drops its reference to a finished collective (and so to the collective's tensors, whose
Python objects it must then release under the GIL) a moment after the collective completed for Python. On a loaded
machine that moment can fall after the main thread has begun finalizing the interpreter; the worker's GIL acquire
then ends the thread inside C++ and the process aborts (SIGABRT, "terminate called without an active exception",
Py_FinalizeEx on the main thread: seen in CI on ``bench deepep_check --cpu`` after its results were written; torch's
pytorch/pytorch#190489). ``destroy_process_group`` does not stop those threads once a functional collective has run
(torch 2.13 keeps the gloo backend alive, and neither its ``shutdown`` nor ``abort`` joins them), so no teardown in
Python closes the window. A torchrun worker of a suite has written its results and destroyed its process group
when the suite returns; nothing is left for finalization to do, so it ends without it.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Callable, NoReturn


def launched_by_torchrun() -> bool:
    """torchrun (torch.distributed.run / elastic) sets TORCHELASTIC_RUN_ID in every worker it starts."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _exit_code(code: object) -> int:
    """``sys.exit``'s convention: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_then_exit(fn: Callable[[], object]) -> NoReturn:
    """Run ``fn``; exit with its return value (``sys.exit``'s convention). Under torchrun: an uncaught exception's
    traceback printed, logging and the standard streams flushed, then ``os._exit``; otherwise ``sys.exit``."""
    if not launched_by_torchrun():
        sys.exit(fn())
    try:
        rc = _exit_code(fn())
    except SystemExit as e:
        rc = _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - what the interpreter would print, then the same hard exit
        traceback.print_exc()
        rc = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(rc)
