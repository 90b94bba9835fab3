"""The names that make up a lightning_moe checkpoint on disk, in one place.

A checkpoint is either one file (``torch.save`` of Lightning's checkpoint dict, with a ``PATH.crc32`` sidecar) or a
distributed checkpoint directory: the torch.distributed.checkpoint shards and their ``.metadata``, :data:`META_FILE`
(the non-tensor part: hyper-parameters, loops, callbacks) and :data:`CHECKSUMS_FILE` (a CRC32 of every file). A
directory saved by :class:`~lightning_moe.MoEParallelStrategy` lives in :data:`VERSIONS_DIR` next to its path, and
the path itself is a symbolic link to the current version (see :mod:`lightning_moe.checkpoint.publish`).
"""

from __future__ import annotations

__all__ = ["META_FILE", "CHECKSUMS_FILE", "DCP_METADATA_FILE", "CRC_SUFFIX", "TMP_SUFFIX", "VERSIONS_DIR", "PARTIAL_SUFFIX",
           "TRASH_SUFFIX", "LINK_SUFFIX", "clean_param_name"]

META_FILE = "meta.pt"  # as Lightning's ModelParallelStrategy names it
CHECKSUMS_FILE = "checksums.json"
DCP_METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's index of the shards
CRC_SUFFIX = ".crc32"  # the sidecar of a single-file checkpoint
TMP_SUFFIX = ".tmp"  # a single file (or its sidecar) being written, renamed over its path once complete
# the versions of every directory checkpoint of a folder; the name holds no "last" so that Lightning's
# ckpt_path="last" lookup (any entry of the folder whose name contains "last") never sees a version
VERSIONS_DIR = ".checkpoint_versions"
PARTIAL_SUFFIX = ".partial"  # a version being written (not yet published)
TRASH_SUFFIX = ".trash"  # a version being deleted (renamed first, so a half-deleted one is never read)
LINK_SUFFIX = ".link"  # the new symbolic link, renamed over the checkpoint's path to publish a version

# module wrappers that insert a component into parameter names (activation checkpointing, torch.compile, FSDP1)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean_param_name(name: str) -> str:
    """A parameter name with wrapper components removed: the name the model's state dict uses."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
