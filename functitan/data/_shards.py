"""Prepared token shards on disk: the index that describes them, and lazy (memory-mapped) access.

A directory written by ``functitan data prepare``::

    <dir>/index.json            what follows, the tokenizer's identity, every shard's size, mtime and hash
    <dir>/shards/<u>-<k>.bin    the documents' tokens back to back (uint16 when the vocabulary fits, else uint32)
    <dir>/shards/<u>-<k>.idx    int64 document offsets into the .bin: document d is tokens[idx[d]:idx[d + 1]]
    <dir>/parts/<u>.json        one record per finished source file (what resuming an interrupted run skips)

Source file ``u`` gives shards ``u-0``, ``u-1``... of at most ``shard_tokens`` tokens each, cut between
documents; the loader treats each shard as one "file" of its stream (see ``functitan.data._loader``).
Opening the directory checks every shard against the index (present, same size; a changed mtime makes
it compare the content hash), and the tokenizer against the one the shards were made with.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from functitan.data._tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["INDEX", "FORMAT", "ShardSet", "is_prepared", "tokenizer_identity", "file_hash"]

INDEX = "index.json"
FORMAT = "functitan.data/1"


class ShardTokens(NamedTuple):
    """One shard's documents: memory-mapped, nothing read until used."""

    tokens: np.ndarray  # (n_tokens,) uint16/uint32, a view of the memory-mapped file
    starts: np.ndarray  # (n_docs + 1,) int64, read into memory


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by ``functitan data prepare``."""
    return (Path(path) / INDEX).is_file()


def file_hash(path: str | os.PathLike) -> str:
    """The blake2b-128 hex digest of a file's content (read in 8 MiB blocks)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def tokenizer_identity(tokenizer: Tokenizer, path: str | os.PathLike | None) -> dict[str, Any]:
    """What must match between preparing and training: the file's content hash and the special ids."""
    ident: dict[str, Any] = {
        "kind": "byte" if path is None else "file",
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": int(tokenizer.bos_id),
        "eos_id": int(tokenizer.eos_id),
    }
    if path is not None:
        ident |= {"path": str(Path(path).resolve()), "hash": file_hash(path)}
    elif not isinstance(tokenizer, ByteTokenizer):
        raise TypeError(f"a {type(tokenizer).__name__} needs the file it was loaded from to identify it; pass its path")
    return ident


def _describe(ident: dict) -> str:
    if ident.get("kind") == "byte":
        return "the byte tokenizer"
    return f"{ident.get('path')} (hash {str(ident.get('hash'))[:12]}, vocab {ident.get('vocab_size')})"


class ShardSet:
    """The shards of a prepared directory, checked against its index, opened lazily.

    Args:
        path: the directory ``functitan data prepare`` wrote.
        tokenizer: the tokenizer file training uses; None for "the one the shards were made with".
        max_open: shards kept memory-mapped at once (least recently used closed first). Each open shard
            may keep up to its size resident (the pages read), so this bounds the loader's memory.

    Raises:
        FileNotFoundError: no index, or a shard it lists is missing.
        ValueError: a shard changed since it was written (size or content), or ``tokenizer`` is not the
            one the shards were made with; the message names the file and the fix.
    """

    def __init__(self, path: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None, max_open: int = 4):
        self.root = Path(path)
        index_file = self.root / INDEX
        if not index_file.is_file():
            raise FileNotFoundError(
                f"{self.root} has no {INDEX}: it is not a prepared shard directory (or `functitan data prepare` "
                f"did not finish; run it again with the same arguments to resume)"
            )
        try:
            self.index = json.loads(index_file.read_text())
        except ValueError as e:
            raise ValueError(f"{index_file} is not valid JSON ({e}); re-run functitan data prepare") from None
        if self.index.get("format") != FORMAT:
            raise ValueError(
                f"{index_file}: format {self.index.get('format')!r}, expected {FORMAT!r}; re-run functitan data prepare"
            )
        self.shards: list[dict] = self.index["shards"]
        self.dtype = np.dtype(self.index["dtype"])
        self.tokenizer = self._tokenizer(tokenizer)
        self._check_files()
        self.max_open = max(1, int(max_open))
        self._open: OrderedDict[int, ShardTokens] = OrderedDict()

    def __len__(self) -> int:
        return len(self.shards)

    def name(self, i: int) -> str:
        return str(self.root / "shards" / self.shards[i]["name"])

    def size(self, i: int) -> tuple[int, int]:
        """``(tokens, documents)`` of shard ``i``, from the index (no I/O)."""
        return int(self.shards[i]["tokens"]), int(self.shards[i]["docs"])

    def get(self, i: int) -> ShardTokens:
        """Shard ``i`` memory-mapped (the least recently used one is closed past ``max_open``)."""
        if i in self._open:
            self._open.move_to_end(i)
            return self._open[i]
        base = self.root / "shards" / self.shards[i]["name"]
        n_tok, n_docs = self.size(i)
        tokens = (
            np.memmap(f"{base}.bin", dtype=self.dtype, mode="r", shape=(n_tok,)) if n_tok else np.zeros(0, self.dtype)
        )
        # plain ndarray views of the mapping (slicing a np.memmap costs ~10x more); the view keeps it mapped
        starts = np.fromfile(f"{base}.idx", dtype=np.int64, count=n_docs + 1)  # small: 8 bytes per document
        self._open[i] = ShardTokens(np.asarray(tokens), starts)
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)  # dropping the last reference unmaps it
        return self._open[i]

    # -- checks ---------------------------------------------------------------------------------

    def _tokenizer(self, given: str | os.PathLike | None) -> Tokenizer:
        made = self.index["tokenizer"]
        if given is None:
            if made["kind"] == "byte":
                return ByteTokenizer()
            given = made["path"]
            if not Path(given).is_file():
                raise FileNotFoundError(
                    f"{self.root} was prepared with the tokenizer {given}, which no longer exists; pass "
                    f"data.tokenizer=<a copy of that file>"
                )
        tok = load_tokenizer(Path(given))
        ident = tokenizer_identity(tok, given)
        keys = ("kind", "hash", "vocab_size", "bos_id", "eos_id")
        if any(ident.get(k) != made.get(k) for k in keys):
            raise ValueError(
                f"data.tokenizer {_describe(ident)} differs from the tokenizer the shards in {self.root} were made "
                f"with, {_describe(made)}; pass data.tokenizer={made.get('path', '(none: the byte tokenizer)')} or "
                f"re-run functitan data prepare with the new tokenizer"
            )
        return tok

    def _check_files(self) -> None:
        fix = f"the shards changed since `functitan data prepare` wrote {self.root / INDEX}; re-run it"
        for sh in self.shards:
            for ext, size_key, mtime_key, hash_key in (
                (".bin", "bytes", "mtime_ns", "hash"),
                (".idx", "idx_bytes", "idx_mtime_ns", "idx_hash"),
            ):
                f = self.root / "shards" / f"{sh['name']}{ext}"
                try:
                    st = f.stat()
                except FileNotFoundError:
                    raise FileNotFoundError(f"{f} is missing: {fix}") from None
                if st.st_size != sh[size_key]:
                    raise ValueError(f"{f} has {st.st_size} bytes, the index recorded {sh[size_key]}: {fix}")
                if st.st_mtime_ns != sh[mtime_key] and file_hash(f) != sh[hash_key]:  # touched: compare content
                    raise ValueError(f"{f} was modified (its content hash differs from the index's): {fix}")
