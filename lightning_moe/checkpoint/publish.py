"""Directory checkpoints replaced atomically: complete versions and a symbolic link that is swapped.

A directory cannot be renamed over a non-empty directory, so a save never writes at ``PATH`` itself. In
``DIR/.checkpoint_versions/`` (:data:`~lightning_moe.checkpoint.format.VERSIONS_DIR`, next to ``PATH = DIR/NAME``):

1. the ranks write ``NAME.vTOKEN.partial/`` (shards, meta.pt, checksums.json; each writer fsyncs its files);
2. :func:`publish` fsyncs it and renames it to ``NAME.vTOKEN``: a version without a suffix is always complete;
3. a symbolic link to it, made in the versions folder, is moved over ``PATH`` with ``os.replace``, which is atomic:
   at every instant ``PATH`` is the previous checkpoint or the new one. ``DIR`` is fsynced (the link is durable);
4. only then are the other versions of ``NAME`` deleted, each first renamed to ``….trash``, so that a kill during
   a deletion never leaves a damaged directory under a complete version's name.

Readers open ``PATH`` as a directory (the link is followed); :func:`resolve` pins the version a load reads. Versions
sort by ``TOKEN`` (the time of the save). ``PATH`` that is a directory (written before versions existed) is first
moved into the versions folder; in the short moment before the link replaces it :func:`resolve` finds the newest
complete version. :func:`remove` deletes a checkpoint so that a kill leaves it whole or gone.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Optional, Union

from lightning_moe.checkpoint.format import LINK_SUFFIX, PARTIAL_SUFFIX, TRASH_SUFFIX, VERSIONS_DIR

__all__ = ["new_staging_dir", "publish", "resolve", "remove", "prune", "current_version", "fsync_dir"]

_TOKEN = re.compile(r"v[0-9a-f]{22}")
_MIGRATED = "v" + "0" * 22  # the token of a directory moved here from PATH (always older than any save)
_KINDS = ("", "partial", "trash", "link")


def _token() -> str:
    return f"v{time.time_ns():016x}{secrets.token_hex(3)}"


def fsync_dir(directory: Union[str, Path]) -> None:
    """Make the entries of ``directory`` (creations, renames) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _versions(path: Path) -> list[tuple[str, str, Path]]:
    """``(token, kind, entry)`` of every entry of ``path``'s versions folder that belongs to it, oldest first."""
    folder = path.parent / VERSIONS_DIR
    if not folder.is_dir():
        return []
    out = []
    for entry in folder.iterdir():
        token, _, kind = entry.name[len(path.name) + 1:].partition(".")
        if entry.name.startswith(path.name + ".") and _TOKEN.fullmatch(token) and kind in _KINDS:
            out.append((token, kind, entry))
    return sorted(out)


def current_version(path: Union[str, Path]) -> Optional[Path]:
    """The version directory ``path`` links to, or None when ``path`` is not such a link."""
    path = Path(path)
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path))
    if target.parent != Path(VERSIONS_DIR):
        return None
    return path.parent / target


def new_staging_dir(path: Union[str, Path]) -> Path:
    """A new, empty ``NAME.vTOKEN.partial`` directory for the next version of ``path`` (created by one rank)."""
    path = Path(path)
    folder = path.parent / VERSIONS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f"{path.name}.{_token()}{PARTIAL_SUFFIX}"
    staging.mkdir()
    return staging


def publish(staging: Union[str, Path], path: Union[str, Path]) -> Path:
    """Make the complete checkpoint written in ``staging`` (from :func:`new_staging_dir`) the one at ``path``;
    returns its version directory. Deletes the previous version once the new link is durable."""
    staging, path = Path(staging), Path(path)
    if staging.parent != path.parent / VERSIONS_DIR or not staging.name.endswith(PARTIAL_SUFFIX):
        raise ValueError(f"{staging} is not a staging directory of {path} (see new_staging_dir)")
    fsync_dir(staging)
    version = staging.with_name(staging.name.removesuffix(PARTIAL_SUFFIX))
    os.rename(staging, version)
    fsync_dir(version.parent)
    if path.is_dir() and not path.is_symlink():
        # a directory from before versions existed: out of the way (until the link is in place, resolve() finds
        # the newest complete version)
        os.rename(path, version.parent / f"{path.name}.{_MIGRATED}")
    link = version.with_name(version.name + LINK_SUFFIX)
    os.symlink(os.path.join(VERSIONS_DIR, version.name), link)
    os.replace(link, path)
    fsync_dir(path.parent)
    prune(path)
    return version


def prune(path: Union[str, Path]) -> None:
    """Delete every version of ``path`` that ``path`` does not link to (leftovers of interrupted saves, the
    previous version); a no-op without a versions folder."""
    path = Path(path)
    keep = current_version(path)
    _delete([entry for _, _, entry in _versions(path) if entry != keep])


def _delete(entries: list[Path]) -> None:
    trash = []
    for entry in entries:
        if entry.is_symlink():  # a link left by an interrupted save: never read, removed at once
            entry.unlink()
            continue
        if not entry.name.endswith(TRASH_SUFFIX):  # renamed first: a complete version's name never holds a
            moved = entry.with_name(entry.name.removesuffix(PARTIAL_SUFFIX) + TRASH_SUFFIX)  # half-deleted directory
            os.rename(entry, moved)
            entry = moved
        trash.append(entry)
    for entry in dict.fromkeys(trash):
        if entry.exists():
            shutil.rmtree(entry)
    if entries:
        fsync_dir(entries[0].parent)


def resolve(path: Union[str, Path]) -> Path:
    """The checkpoint a load of ``path`` reads, every link followed (a load reads one version throughout). When
    ``path`` is missing in the middle of a save that moved an old-style directory aside, the newest complete
    version; otherwise a missing ``path`` is returned as it is (the caller reports it)."""
    path = Path(path)
    if path.exists():
        return Path(os.path.realpath(path))
    versions = _versions(path)
    if any(token == _MIGRATED for token, kind, _ in versions if kind == ""):
        return max(entry for _, kind, entry in versions if kind == "")
    return path


def remove(path: Union[str, Path]) -> bool:
    """Delete the versioned checkpoint at ``path`` (the link and every version); False when ``path`` is not one.
    The versions go before the link, the linked one last: a kill leaves the checkpoint whole or gone."""
    path = Path(path)
    keep = current_version(path)
    if keep is None:
        return False
    others = [entry for _, _, entry in _versions(path) if entry != keep]
    _delete(others + [keep] if keep.exists() else others)
    path.unlink()
    fsync_dir(path.parent)
    return True
