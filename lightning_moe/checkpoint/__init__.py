"""The checkpoint format of lightning_moe and what keeps it safe.

* :mod:`~lightning_moe.checkpoint.format`: the file and folder names of a checkpoint; parameter-name cleaning.
* :mod:`~lightning_moe.checkpoint.files`: :class:`SafeCheckpointIO` (atomic, checksummed single files) and the
  checksum manifest of directory checkpoints.
* :mod:`~lightning_moe.checkpoint.publish`: directory checkpoints replaced atomically (versions behind a link);
  :func:`resolve` is what every reader opens.
* :mod:`~lightning_moe.checkpoint.optimizer_state`: optimizer state by parameter name (any layout).
* :mod:`~lightning_moe.checkpoint.loop_state`: a checkpoint saved at an epoch end resumes at the next epoch's start.
"""

from lightning_moe.checkpoint.files import CorruptCheckpointError, SafeCheckpointIO
from lightning_moe.checkpoint.format import CHECKSUMS_FILE, META_FILE, VERSIONS_DIR
from lightning_moe.checkpoint.publish import resolve

__all__ = ["CHECKSUMS_FILE", "META_FILE", "VERSIONS_DIR", "CorruptCheckpointError", "SafeCheckpointIO", "resolve"]
