import os
import sys

# tests import the multi-rank launcher as a top-level module
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
