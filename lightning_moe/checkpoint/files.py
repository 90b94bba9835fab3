"""Checkpoint files that survive failures and tell you when they are damaged.

* :class:`SafeCheckpointIO`: Lightning ``CheckpointIO`` for single-file checkpoints. A save writes ``PATH.tmp``,
  flushes it to disk and renames it over ``PATH`` (atomic), so an exception or a kill during a save leaves the
  previous checkpoint complete. A sidecar ``PATH.crc32`` holds the file's CRC32; a load verifies it and names the
  file when it does not match (random bytes in a checkpoint otherwise load silently). Loads use
  ``weights_only=True``. ``MoEParallelStrategy`` uses it for its single-file checkpoints; with Lightning's default
  strategy pass it as ``L.Trainer(plugins=[SafeCheckpointIO()])`` (``lightning-moe fit`` does).
* Distributed checkpoints (directories) are published by ``MoEParallelStrategy`` as versions behind a link
  (:mod:`lightning_moe.checkpoint.publish`); :func:`write_dir_checksums` / :func:`verify_dir_checksums` keep a
  ``checksums.json`` manifest of every file, each rank hashing the files it wrote (or, on load, a share of them).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_moe.checkpoint.format import CHECKSUMS_FILE, CRC_SUFFIX, TMP_SUFFIX
from lightning_moe.checkpoint.publish import fsync_dir, prune

__all__ = ["SafeCheckpointIO", "CorruptCheckpointError", "file_crc32", "write_dir_checksums", "verify_dir_checksums",
           "save_fsynced"]

_CHUNK = 16 * 2**20


class CorruptCheckpointError(ValueError):
    """A checkpoint file does not match the checksum written with it."""


def file_crc32(path: Union[str, Path]) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def save_fsynced(obj: Any, path: Union[str, Path]) -> None:
    """``torch.save`` that returns once the bytes are on disk."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + CRC_SUFFIX)


class SafeCheckpointIO(TorchCheckpointIO):
    """Atomic single-file checkpoints with a CRC32 sidecar (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Union[str, Path],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        try:
            save_fsynced(checkpoint, tmp)
            new = file_crc32(tmp)
            sidecar = _sidecar(path)
            old = [sidecar.read_text().split()[0]] if sidecar.exists() and path.exists() else []
            # the sidecar accepts the old and the new file while the rename happens, then only the new one: a
            # kill at any point leaves a file that matches its sidecar
            _write_text_atomic(sidecar, " ".join([new] + old) + "\n")
            os.replace(tmp, path)  # over a file, or over the link of a directory checkpoint saved here before
            fsync_dir(path.parent)
            _write_text_atomic(sidecar, new + "\n")
            prune(path)  # versions of a directory checkpoint this file replaced
        finally:
            if tmp.exists():
                tmp.unlink()

    def load_checkpoint(self, path: Union[str, Path], map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        if path.is_dir():
            raise IsADirectoryError(
                f"{path} is a distributed checkpoint (a directory): load it with MoEParallelStrategy (any number of "
                "devices, one included), or convert it with `lightning-moe export`")
        sidecar = _sidecar(path)
        if sidecar.exists():
            want = sidecar.read_text().split()
            got = file_crc32(path)
            if got not in want:
                raise CorruptCheckpointError(
                    f"{path} is damaged: its CRC32 is {got}, the checksum written with it is {want[0]} "
                    f"({sidecar.name}). Restore it from a copy or use an earlier checkpoint")
        try:
            return torch.load(path, map_location=map_location or "cpu", weights_only=True)
        except Exception as e:  # a truncated or damaged file without a sidecar
            raise CorruptCheckpointError(f"{path} cannot be read as a checkpoint ({type(e).__name__}: {e})") from e

    def remove_checkpoint(self, path: Union[str, Path]) -> None:
        super().remove_checkpoint(path)
        sidecar = _sidecar(Path(path))
        if sidecar.exists():
            sidecar.unlink()


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != CHECKSUMS_FILE)


def write_dir_checksums(directory: Union[str, Path], rank: int = 0, world_size: int = 1,
                        all_gather_object: Any = None) -> None:
    """Write ``checksums.json`` for every file of ``directory``; file i is hashed by rank ``i % world_size``
    (``all_gather_object`` gathers the pieces; None on one process). Rank 0 writes the manifest."""
    directory = Path(directory)
    names = _files(directory)
    mine = {n: file_crc32(directory / n) for i, n in enumerate(names) if i % world_size == rank}
    parts = [mine] if all_gather_object is None else all_gather_object(mine)
    if rank == 0:
        manifest = {k: v for part in parts for k, v in part.items()}
        _write_text_atomic(directory / CHECKSUMS_FILE, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def verify_dir_checksums(directory: Union[str, Path], rank: int = 0, world_size: int = 1,
                         all_gather_object: Any = None) -> None:
    """Check every file of ``directory`` against ``checksums.json`` (file i on rank ``i % world_size``); raise
    :class:`CorruptCheckpointError` naming every bad, missing or unexpected file, on every rank."""
    directory = Path(directory)
    manifest_path = directory / CHECKSUMS_FILE
    if not manifest_path.exists():
        return  # written before checksums existed
    manifest = json.loads(manifest_path.read_text())
    names = sorted(set(manifest) | set(_files(directory)))
    bad = []
    for i, n in enumerate(names):
        if i % world_size != rank:
            continue
        if n not in manifest:
            bad.append(f"{n} (not in {CHECKSUMS_FILE})")
        elif not (directory / n).exists():
            bad.append(f"{n} (missing)")
        elif file_crc32(directory / n) != manifest[n]:
            bad.append(f"{n} (CRC32 {file_crc32(directory / n)}, expected {manifest[n]})")
    parts = [bad] if all_gather_object is None else all_gather_object(bad)
    bad = sorted(b for part in parts for b in part)
    if bad:
        raise CorruptCheckpointError(f"the checkpoint {directory} is damaged: {', '.join(bad)}. Restore it from a "
                                     "copy or use an earlier checkpoint")
