import os
import sys

# tests import the multi-rank launcher as a top-level module
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton picks interpreter or compiled functions when it is first imported (its standard library is decorated then),
# and importing lightning_moe imports it through torch._dynamo: without a GPU, the fused-kernel tests
# (tests/test_moe_kernels.py) need the interpreter chosen before any test module is collected.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_environ():
    """A Trainer run in the test process leaves Lightning's rank variables (LOCAL_RANK, WORLD_SIZE, MASTER_PORT, ...)
    in os.environ; a later test's subprocess would inherit them and take itself for an externally launched rank."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
