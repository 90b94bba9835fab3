"""Which checkpoint a command means: ``last`` is the newest checkpoint of the run, whatever its name.

Every command that takes a checkpoint (``fit``/``validate``/``test``/``predict`` through ``--ckpt_path``,
``generate``, ``export``) resolves ``last`` with :func:`newest_checkpoint`, so they agree on which file that is.
"""

from __future__ import annotations

import glob
import os
from typing import Optional, Union

from lightning_moe.checkpoint.format import META_FILE

__all__ = ["LAST", "newest_checkpoint", "resolve_checkpoint_arg"]

LAST = "last"  # the value that asks for the newest checkpoint of the run


def newest_checkpoint(root: Union[str, os.PathLike]) -> Optional[str]:
    """The most recently written checkpoint under ``root``: a ``*.ckpt`` file or distributed checkpoint directory,
    whatever its name (the step's own ``epoch=0-step=300.ckpt`` when the last step was also a validation step,
    ``last.ckpt`` otherwise); None when there is none. Temporary files of a save in progress are not checkpoints."""
    found = [p for p in glob.glob(os.path.join(os.fspath(root), "**", "*.ckpt"), recursive=True)
             if os.path.isfile(p) or os.path.isfile(os.path.join(p, META_FILE))]
    return max(found, key=os.path.getmtime) if found else None


def resolve_checkpoint_arg(value: Union[str, os.PathLike], root: Optional[Union[str, os.PathLike]], flag: str) -> str:
    """``value`` as the path of an existing checkpoint: ``last`` -> the newest checkpoint under ``root`` (default:
    the current directory). A checkpoint that is not there raises FileNotFoundError naming ``flag`` and the fix:
    a command that needs trained weights never falls back to a freshly initialised model."""
    if os.fspath(value) == LAST:
        root = os.fspath(root) if root is not None else os.getcwd()
        found = newest_checkpoint(root)
        if found is None:
            raise FileNotFoundError(f"{flag} last: no checkpoint under {root}: give the path of one, or the run's "
                                    "folder (--default_root_dir)")
        return found
    path = os.path.expanduser(os.fspath(value))
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{flag} {value}: checkpoint {path} does not exist")
    return path
