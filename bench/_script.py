"""``python bench/<suite>.py ...`` (the command lines from before the runner) = ``python -m bench <suite> ...``.

Imported only when a suite file is run as a script (its folder is then ``sys.path[0]``); the repository root goes on
PYTHONPATH of the re-executed interpreter, so the package imports as it does under ``python -m bench``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def run_as_suite(file: str) -> None:
    path = Path(file).resolve()
    root = str(path.parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.execv(sys.executable, [sys.executable, "-m", "bench", path.stem, *sys.argv[1:]])
