"""Where documents come from: the default corpus, path expansion, and reading text / JSONL files.

A *document* is the unit that the loader shuffles and ends with EOS: a whole text file, or one line of a
JSONL file.
"""

from __future__ import annotations

import codecs
import json
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

__all__ = ["DEFAULT_CORPUS_BYTES", "default_corpus", "expand_paths", "read_documents", "is_jsonl", "check_text_file"]

DEFAULT_CORPUS_BYTES = 16 * 2**20
"""16 MiB: the whole Python 3.11 stdlib (about 12 MB of .py/.txt without tests) fits."""

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Directories whose content is not good prose or code for a language model, or is not the stdlib.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The ``*.py`` and ``*.txt`` files of the running interpreter's stdlib: a corpus with no download.

    Files are taken in sorted order of their path relative to the stdlib directory (so the list is the same
    on every rank and every run of the same Python) while their total size stays within ``max_bytes``;
    site-packages, test directories and ``__pycache__`` are left out. A different Python version gives a
    different corpus.

    Args:
        max_bytes: the cap on the total size of the returned files, in bytes.

    Returns:
        Absolute paths, sorted; their sizes add up to at most ``max_bytes``.
    """
    if max_bytes <= 0:
        raise ValueError(f"default_corpus: max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(
            f"default_corpus: the stdlib directory {root} of this interpreter does not exist (an embedded or "
            "zipped Python?); pass the training files explicitly"
        )
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if f.endswith((".py", ".txt"))]
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    out, total = [], 0
    for p in found:
        size = p.stat().st_size
        if total + size > max_bytes:
            break
        out.append(p)
        total += size
    return out


def is_jsonl(path: Path) -> bool:
    """Whether ``path`` is read as JSONL (one document per line) rather than as one text document."""
    return path.suffix.lower() in _JSONL_SUFFIXES


def expand_paths(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Files from files and directories: a directory gives every non-hidden file under it, sorted.

    The order of ``paths`` is kept (it does not matter to the loader, which shuffles, but it makes the
    file list, and so the shuffle, the same on every rank).
    """
    out: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            rel = sorted((f.relative_to(p) for f in p.rglob("*") if f.is_file()), key=lambda r: r.as_posix())
            out += [p / r for r in rel if not any(part.startswith(".") for part in r.parts)]
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"data path {p} does not exist (neither a file nor a directory)")
    return out


def _not_utf8(path: Path, raw: bytes, e: UnicodeDecodeError) -> ValueError:
    line = raw.count(b"\n", 0, e.start) + 1
    return ValueError(
        f"{path}: byte {raw[e.start]:#04x} at offset {e.start} (line {line}) is not UTF-8; it is not a text "
        f"file (remove it from data.paths, or convert it to UTF-8)"
    )


def check_text_file(path: str | os.PathLike, *, head: int = 1 << 16) -> None:
    """Refuse a file that is not UTF-8 text from its first ``head`` bytes, before training starts (files are
    read when the shuffle first reaches them: a binary one would fail mid-run, or train on garbage)."""
    path = Path(path)
    with path.open("rb") as f:
        raw = f.read(head)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=len(raw) < head)  # a cut character is fine
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw, e) from None


def read_documents(path: str | os.PathLike, *, text_key: str = "text") -> list[str]:
    """The documents of one file: the whole text of a text file, or one per line of a ``.jsonl`` file.

    Text must be UTF-8, as ``functitan data prepare`` requires: a binary file (an image, an archive) in a
    training folder would otherwise train on U+FFFD replacement characters without a word. In JSONL, blank
    lines are skipped and every other line must be a JSON object with a string under ``text_key``.

    Raises:
        ValueError: a file that is not UTF-8 text (naming the byte and its offset); a JSONL line that is
            not JSON, not an object, or lacks a string ``text_key`` (naming the file and the line number).
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw, e) from None
    if not is_jsonl(path):
        return [text]
    return [
        _jsonl_text(line, path, lineno, text_key) for lineno, line in enumerate(text.split("\n"), 1) if line.strip()
    ]


def _jsonl_text(line: str, path: Path, lineno: int, text_key: str) -> str:
    where = f"{path}, line {lineno}"
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e}); each line of a JSONL file must be one JSON object") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    if text_key not in obj:
        raise ValueError(
            f"{where}: no key {text_key!r} (keys: {sorted(obj)[:10]}); name the field with the text in data.text_key "
            f"(functitan data prepare: --text-key)"
        )
    text = obj[text_key]
    if not isinstance(text, str):
        raise ValueError(f"{where}: {text_key!r} holds {type(text).__name__}, expected a string")
    return text
