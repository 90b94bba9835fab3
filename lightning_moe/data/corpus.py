"""Reading documents: the embedded corpus and local ``.txt`` / ``.jsonl`` / ``.json`` files (optionally compressed).

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
from typing import Any, Optional, Union

__all__ = ["EMBEDDED_CORPUS_MAX_BYTES", "embedded_corpus_documents", "expand_files", "read_documents",
           "read_text_file"]

#: default cap of the embedded corpus, in bytes of UTF-8 text
EMBEDDED_CORPUS_MAX_BYTES = 8_000_000

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
_DATA_SUFFIXES = (".txt", ".jsonl", ".json")
_COMPRESSIONS = (".gz", ".bz2", ".xz")


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


def _format_of(path: str) -> tuple[str, Optional[str]]:
    """(format, compression) from the file name: ``data.jsonl.gz`` -> ("jsonl", "gz"); unknown suffixes are "txt"."""
    name = path.lower()
    compression = None
    for suffix in _COMPRESSIONS:
        if name.endswith(suffix):
            compression, name = suffix[1:], name[: -len(suffix)]
            break
    for fmt in ("jsonl", "json"):
        if name.endswith("." + fmt):
            return fmt, compression
    return "txt", compression


def _is_data_file(name: str) -> bool:
    lower = name.lower()
    for suffix in _COMPRESSIONS:
        if lower.endswith(suffix):
            lower = lower[: -len(suffix)]
            break
    return lower.endswith(_DATA_SUFFIXES)


def expand_files(files: Union[str, os.PathLike, list[str]]) -> list[str]:
    """Expand directories (recursively: ``*.txt``, ``*.jsonl``, ``*.json`` and their ``.gz`` / ``.bz2`` / ``.xz``
    forms, sorted) and check that every path exists. ``files`` may be one path or a list."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    out: list[str] = []
    for entry in files:
        path = os.path.expanduser(os.fspath(entry))
        if os.path.isdir(path):
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
                found.extend(os.path.join(dirpath, n) for n in filenames if _is_data_file(n))
            if not found:
                raise ValueError(
                    f"data directory {path!r} holds no .txt, .jsonl or .json files (optionally .gz, .bz2 or .xz "
                    "compressed); add some or change `files`."
                )
            out.extend(sorted(found, key=lambda p: os.path.relpath(p, path).replace(os.sep, "/")))
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise ValueError(f"data file or directory {path!r} does not exist; fix the path in `files`.")
    return out


# magic numbers of formats we cannot read as text: refuse them rather than train on their bytes
_BINARY_MAGIC = {
    b"\x28\xb5\x2f\xfd": "zstd-compressed (decompress it first, e.g. `zstd -d`)",
    b"PK\x03\x04": "a zip archive (extract it first)",
    b"PAR1": "a Parquet file (convert it to .jsonl, e.g. with pandas or `datasets`)",
    b"ARROW1": "an Arrow file (convert it to .jsonl, e.g. with `datasets`)",
    b"\x80\x04\x95": "a Python pickle",
    b"\x93NUMPY": "a NumPy array",
    b"%PDF": "a PDF document (extract its text first)",
}
_COMPRESSED_MAGIC = {b"\x1f\x8b": "gz", b"BZh": "bz2", b"\xfd7zXZ\x00": "xz"}


def _decompress(raw: bytes, compression: str, path: str) -> bytes:
    import bz2
    import gzip
    import lzma

    try:
        if compression == "gz":
            return gzip.decompress(raw)
        if compression == "bz2":
            return bz2.decompress(raw)
        return lzma.decompress(raw)
    except (OSError, EOFError, lzma.LZMAError, ValueError) as err:
        raise ValueError(f"{path}: cannot decompress it as .{compression} ({err}); is the file complete?") from err


def read_text_file(path: str) -> str:
    """The UTF-8 text of a local file, decompressed by suffix (``.gz``, ``.bz2``, ``.xz``) or by its magic number.

    Raises ValueError for files that are not text: NUL bytes, a known binary format, or mostly invalid UTF-8 (a few
    invalid bytes become U+FFFD)."""
    with open(path, "rb") as f:
        raw = f.read()
    _, compression = _format_of(path)
    if compression is None:
        compression = next((c for magic, c in _COMPRESSED_MAGIC.items() if raw.startswith(magic)), None)
    if compression is not None:
        raw = _decompress(raw, compression, path)
    for magic, what in _BINARY_MAGIC.items():
        if raw.startswith(magic):
            raise ValueError(f"{path} is {what}, not text; `files` takes .txt, .jsonl and .json files.")
    head = raw[:65536]
    if b"\x00" in head:
        raise ValueError(
            f"{path} is binary (it holds NUL bytes), not UTF-8 text; `files` takes .txt, .jsonl and .json files "
            "(UTF-16 text must be converted to UTF-8 first)."
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd")
        if bad > max(16, len(text) // 100):
            raise ValueError(
                f"{path} is not UTF-8 text ({bad} invalid bytes of {len(raw)}); convert it to UTF-8 "
                "(e.g. `iconv -t utf-8`) or remove it from `files`."
            ) from None
        return text


def _record_text(record: Any, text_field: str, where: str) -> str:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict) or text_field not in record:
        keys = f" (its keys: {', '.join(map(str, record))})" if isinstance(record, dict) else ""
        raise ValueError(
            f"{where} has no field {text_field!r}{keys}; set `text_field` to the key holding the text."
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string.")
    return text


def _jsonl_documents(text: str, path: str, text_field: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{lineno} is not valid JSON ({err}); each line must be one JSON object."
            ) from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno} is a JSON {type(record).__name__}; each line must be one JSON object "
                             f"with the text under {text_field!r}.")
        doc = _record_text(record, text_field, f"{path}:{lineno}")
        if doc:
            docs.append(doc)
    return docs


def _json_documents(text: str, path: str, text_field: str) -> list[str]:
    """A JSON array of strings or of objects holding ``text_field``; a ``.json`` file that is really JSON Lines
    (as pandas' and datasets' ``to_json`` write) is read as such."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":
            return _jsonl_documents(text, path, text_field)
        raise ValueError(f"{path} is not valid JSON ({err}).") from err
    if isinstance(data, dict) and text_field in data:
        data = [data]
    if not isinstance(data, list):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}; a .json file must hold an array of strings or of objects "
            f"with the text under {text_field!r} (or use .jsonl, one object per line)."
        )
    docs = []
    for i, record in enumerate(data):
        doc = _record_text(record, text_field, f"{path}[{i}]")
        if doc:
            docs.append(doc)
    return docs


def read_documents(files: Union[str, list[str]], text_field: str = "text") -> list[str]:
    """Documents of local files: ``.jsonl`` gives one document per line (``record[text_field]``), ``.json`` one per
    array element (a string, or ``record[text_field]``), any other file (``.txt``) is one document. Each may be
    ``.gz`` / ``.bz2`` / ``.xz`` compressed; binary files are refused."""
    docs: list[str] = []
    for path in expand_files(files):
        fmt, _ = _format_of(path)
        text = read_text_file(path)
        if fmt == "jsonl":
            docs.extend(_jsonl_documents(text, path, text_field))
        elif fmt == "json":
            docs.extend(_json_documents(text, path, text_field))
        elif text:
            docs.append(text)
    return docs


def load_documents(
    files: Optional[Union[str, list[str]]], text_field: str = "text", embedded_max_bytes: int = EMBEDDED_CORPUS_MAX_BYTES
) -> list[str]:
    """``files`` or, when None, the embedded corpus."""
    if files is None:
        return embedded_corpus_documents(embedded_max_bytes)
    return read_documents(files, text_field)
