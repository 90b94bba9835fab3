"""Load a ``bench/`` script as a module (bench/ is no package): ``load_bench("scale")`` is ``bench/scale.py``.

The scripts set the device machines' NCCL policy variables at import and put ``bench/`` on ``sys.path`` for their
sibling imports; both are undone here so that the test process and later tests see their own environment.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    saved = dict(os.environ)
    path = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(saved)
    return mod


def has_transformers(model_class: str) -> bool:
    """Whether ``transformers`` (with ``model_class``) imports: the benchmarks' peers need it."""
    try:
        import transformers

        getattr(transformers, model_class)
    except Exception:  # missing, or a lazy import that fails
        return False
    return True
