"""Reading documents: the embedded corpus and local ``.txt`` / ``.jsonl`` files.

The embedded corpus
-------------------
Training examples must run offline on every machine, so the default corpus is text that every Python
installation carries: the source of Python's own standard library, read at run time from
``sysconfig.get_paths()["stdlib"]``. Every ``*.py`` file is one document; files are taken in order of
their relative POSIX path (so the corpus is deterministic for a given Python version), skipping
``site-packages``, ``dist-packages``, ``test``/``tests`` and ``__pycache__`` directories, until about
``EMBEDDED_CORPUS_MAX_BYTES`` (8 MB) of UTF-8 text has been read. On CPython 3.11 that is ~610 files (8.0 MB);
byte-tokenising it takes well under a second.
"""

from __future__ import annotations

import json
import os
import sysconfig
from typing import Optional

__all__ = ["EMBEDDED_CORPUS_MAX_BYTES", "embedded_corpus_documents", "read_documents", "expand_files"]

#: default cap of the embedded corpus, in bytes of UTF-8 text
EMBEDDED_CORPUS_MAX_BYTES = 8_000_000

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
_DATA_SUFFIXES = (".txt", ".jsonl")


def embedded_corpus_documents(max_bytes: int = EMBEDDED_CORPUS_MAX_BYTES) -> list[str]:
    """The standard-library sources as a list of documents (see the module docstring)."""
    root = sysconfig.get_paths().get("stdlib")
    if not root or not os.path.isdir(root):
        raise ValueError(
            f"the embedded corpus (Python's standard library sources) was not found at {root!r}; "
            "pass `files` with local .txt/.jsonl files or directories instead."
        )
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                rel_paths.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    rel_paths.sort()
    docs: list[str] = []
    total = 0
    for rel in rel_paths:
        if total >= max_bytes:
            break
        try:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if text:
            docs.append(text)
            total += len(text.encode("utf-8"))
    if not docs:
        raise ValueError(
            f"the embedded corpus at {root!r} holds no Python sources; pass `files` with local .txt/.jsonl "
            "files or directories instead."
        )
    return docs


def expand_files(files: list[str]) -> list[str]:
    """Expand directories (recursively, ``*.txt`` and ``*.jsonl``, sorted) and check that every path exists."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    out: list[str] = []
    for entry in files:
        path = os.path.expanduser(os.fspath(entry))
        if os.path.isdir(path):
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if d != "__pycache__"]
                found.extend(os.path.join(dirpath, n) for n in filenames if n.endswith(_DATA_SUFFIXES))
            if not found:
                raise ValueError(
                    f"data directory {path!r} holds no .txt or .jsonl files; add some or change `files`."
                )
            out.extend(sorted(found, key=lambda p: os.path.relpath(p, path).replace(os.sep, "/")))
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise ValueError(f"data file or directory {path!r} does not exist; fix the path in `files`.")
    return out


def _read_jsonl(path: str, text_field: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{lineno} is not valid JSON ({err}); each line must be one JSON object."
                ) from err
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(
                    f"{path}:{lineno} has no field {text_field!r}; set `text_field` to the key holding the text."
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not a string.")
            if text:
                docs.append(text)
    return docs


def read_documents(files: list[str], text_field: str = "text") -> list[str]:
    """Documents of local files: a ``.jsonl`` file gives one document per line (``record[text_field]``),
    any other file (``.txt``) is one document."""
    docs: list[str] = []
    for path in expand_files(files):
        if path.endswith(".jsonl"):
            docs.extend(_read_jsonl(path, text_field))
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text:
                docs.append(text)
    return docs


def load_documents(
    files: Optional[list[str]], text_field: str = "text", embedded_max_bytes: int = EMBEDDED_CORPUS_MAX_BYTES
) -> list[str]:
    """``files`` or, when None, the embedded corpus."""
    if files is None:
        return embedded_corpus_documents(embedded_max_bytes)
    return read_documents(files, text_field)
