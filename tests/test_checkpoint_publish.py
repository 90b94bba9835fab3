"""Versions behind a link (lightning_moe.checkpoint.publish), on plain directories: what a load resolves to after a
publish, after leftovers of interrupted saves, in the middle of moving an old-style directory aside, and after a
removal interrupted at each of its filesystem steps (tests/test_checkpoint_kill.py kills real saves)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lightning_moe.checkpoint import VERSIONS_DIR, resolve
from lightning_moe.checkpoint.publish import current_version, new_staging_dir, prune, publish, remove


def _save(path: Path, text: str) -> Path:
    staging = new_staging_dir(path)
    (staging / "data").write_text(text)
    return publish(staging, path)


def _content(path: Path) -> str:
    return (resolve(path) / "data").read_text()


def test_publish_replaces_the_link_and_prunes_everything_else(tmp_path):
    path = tmp_path / "last.ckpt"
    first = _save(path, "one")
    assert path.is_symlink() and current_version(path) == first and resolve(path) == first.resolve()
    assert _content(path) == "one" and first.parent.name == VERSIONS_DIR
    # leftovers of interrupted saves of this path: a staging directory, a link, a complete version never linked,
    # half-deleted trash; and the versions of another checkpoint whose name extends this one's
    (new_staging_dir(path) / "data").write_text("partial")
    orphan = new_staging_dir(path)
    os.rename(orphan, orphan.with_name(orphan.name.removesuffix(".partial")))
    os.symlink("nowhere", first.with_name(first.name + ".link"))
    trash = new_staging_dir(path)  # a deletion interrupted after its rename
    os.rename(trash, trash.with_name(trash.name.removesuffix(".partial") + ".trash"))
    other = tmp_path / "last.ckpt.bak"
    _save(other, "other")
    second = _save(path, "two")
    assert _content(path) == "two" and _content(other) == "other"
    assert sorted(p.name for p in second.parent.iterdir()) == sorted([second.name, current_version(other).name])
    with pytest.raises(ValueError, match="not a staging directory"):
        publish(tmp_path, path)


def test_an_old_style_directory_is_moved_aside_and_found_meanwhile(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "data").write_text("old")
    staging = new_staging_dir(path)
    (staging / "data").write_text("new")
    real_symlink = os.symlink

    def stop(*args: Any, **kwargs: Any) -> None:  # interrupted right after the old directory was moved aside
        raise OSError("interrupted (injected)")

    monkeypatch.setattr(os, "symlink", stop)
    with pytest.raises(OSError, match="injected"):
        publish(staging, path)
    monkeypatch.setattr(os, "symlink", real_symlink)
    assert not path.exists() and _content(path) == "new"  # the newest complete version while the link is missing
    _save(path, "newer")
    assert _content(path) == "newer" and len(list((tmp_path / VERSIONS_DIR).iterdir())) == 1
    # a complete version without the moved-aside directory is not brought back once the link is gone
    version = current_version(path)
    path.unlink()
    assert version.exists() and resolve(path) == path and not path.exists()


@pytest.mark.parametrize("fail_at", range(1, 12))
def test_a_removal_interrupted_anywhere_leaves_the_checkpoint_whole_or_gone(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "ckpt"
    _save(path, "old")
    (new_staging_dir(path) / "data").write_text("partial")  # a leftover the removal deletes too
    _save(path, "kept")
    calls = [0]

    def failing(real: Any) -> Any:
        def step(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == fail_at:
                raise OSError("interrupted (injected)")
            return real(*args, **kwargs)
        return step

    for name in ("rename", "unlink", "rmdir", "fsync"):
        monkeypatch.setattr(os, name, failing(getattr(os, name)))
    try:
        remove(path)
        interrupted = False
    except OSError:
        interrupted = True
    monkeypatch.undo()
    if resolve(path).exists():
        assert interrupted and _content(path) == "kept"
    else:
        assert not any(p.name.count(".") == 1 for p in (tmp_path / VERSIONS_DIR).iterdir())  # no complete version
    if not interrupted:
        assert not path.exists() and not list((tmp_path / VERSIONS_DIR).iterdir())
    prune(path)  # what the next save does: nothing of the removed checkpoint is left
    assert not path.exists() or _content(path) == "kept"
