"""``functitan data prepare``: tokenize text / JSONL / parquet / Hugging Face ``datasets`` files into shards.

Each source file is tokenized by a worker process (``workers`` of them, in parallel) into one or more
memory-mapped shards (see ``functitan.data._shards`` for the layout); a finished file leaves a record
in ``parts/``, so a run that is interrupted resumes where it stopped when started again with the same
arguments (files whose size or mtime changed since, or a different tokenizer, are redone). The index is
written last.

Sources: a ``.parquet`` file (the ``text_key`` column; needs ``pyarrow``), an ``.arrow`` file or a
directory saved by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with
``pyarrow``, no ``datasets`` needed), a ``.jsonl`` file (one JSON object per line), any other file as one
UTF-8 text document. A directory that is not a ``datasets`` directory gives every file under it.

A ``DatasetDict``'s splits are never merged: ``split`` picks one (default ``train``), so the held-out
documents of ``test`` or ``validation`` stay out of the training shards; prepare each into its own folder.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from functitan.data._corpus import _jsonl_text, expand_paths, is_jsonl
from functitan.data._shards import FORMAT, INDEX, file_hash, tokenizer_identity
from functitan.data._tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from functitan.errors import UserError, unknown_command

__all__ = ["prepare", "source_files", "DataError"]

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB of uint16


class DataError(UserError):
    """A source file that cannot be prepared: empty, not decodable, not readable in its format."""


# -- sources -----------------------------------------------------------------------------------------


DEFAULT_SPLIT = "train"


def splits(d: Path) -> list[str] | None:
    """The split names of a ``DatasetDict.save_to_disk`` directory, else None."""
    if not (d / "dataset_dict.json").is_file():
        return None
    return list(json.loads((d / "dataset_dict.json").read_text()).get("splits", []))


def _datasets_files(d: Path, split: str) -> list[Path] | None:
    """The Arrow files of a ``datasets`` ``save_to_disk`` directory (a Dataset, or ``split`` of a DatasetDict),
    else None."""
    names = splits(d)
    if names is not None:
        if split not in names:
            raise DataError(
                f"{d}: a DatasetDict with the splits {names}, none named {split!r}; pass --split NAME (one of them)"
            )
        return _datasets_files(d / split, split)
    if (d / "state.json").is_file() and (d / "dataset_info.json").is_file():
        state = json.loads((d / "state.json").read_text())
        return [d / f["filename"] for f in state.get("_data_files", [])]
    return None


def source_files(paths: Sequence[str | os.PathLike], split: str = DEFAULT_SPLIT) -> list[Path]:
    """The files ``prepare`` reads, in order (a ``datasets`` directory gives its Arrow files; a DatasetDict those
    of ``split`` alone)."""
    out: list[Path] = []
    for p in map(Path, paths):
        hf = _datasets_files(p, split) if p.is_dir() else None
        out += hf if hf is not None else expand_paths([p])
    return out


def left_out(paths: Sequence[str | os.PathLike], split: str) -> dict[str, list[str]]:
    """``{DatasetDict directory: its splits other than split}``: what a prepare of ``split`` did not read."""
    out = {}
    for p in map(Path, paths):
        others = [n for n in (splits(p) if p.is_dir() else None) or [] if n != split]
        if others:
            out[str(p)] = others
    return out


def _arrow_batches(path: Path, text_key: str) -> Iterator[Any]:
    pa = _pyarrow(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except pa.ArrowException as e:
            raise DataError(f"{path}: not a readable parquet file ({e}); remove it or re-export it") from None
        if text_key not in pf.schema_arrow.names:
            raise DataError(f"{path}: no column {text_key!r} (columns: {pf.schema_arrow.names[:10]}); pass --text-key")
        yield from pf.iter_batches(columns=[text_key])
        return
    import pyarrow.ipc as ipc

    try:  # datasets writes the streaming format; accept the file format too
        reader = ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        try:
            reader = ipc.open_file(pa.memory_map(str(path)))
        except pa.ArrowInvalid as e:
            raise DataError(f"{path}: not an Arrow file ({e}); remove it or re-save the dataset") from None
    if text_key not in reader.schema.names:
        raise DataError(f"{path}: no column {text_key!r} (columns: {reader.schema.names[:10]}); pass --text-key")
    if hasattr(reader, "num_record_batches"):
        yield from (reader.get_batch(i).select([text_key]) for i in range(reader.num_record_batches))
    else:
        yield from (b.select([text_key]) for b in reader)


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ImportError(
            f"{path}: reading parquet / Arrow files needs pyarrow: pip install 'functitan[data]'"
        ) from None
    return pyarrow


def documents(path: Path, text_key: str) -> Iterator[str]:
    """The documents of one source file, streamed (a file larger than memory is fine unless it is one text)."""
    if path.suffix.lower() in (".parquet", ".arrow"):
        for batch in _arrow_batches(path, text_key):
            for i, text in enumerate(batch.column(0).to_pylist()):
                if not isinstance(text, str):
                    raise DataError(
                        f"{path}: row {i} of a batch holds {type(text).__name__} in {text_key!r}, expected a string"
                    )
                yield text
    elif is_jsonl(path):
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}, line {lineno}: byte {raw[e.start]:#04x} is not UTF-8; the file is not text"
                    ) from None
                if line.strip():
                    try:
                        yield _jsonl_text(line, path, lineno, text_key)
                    except ValueError as e:
                        raise DataError(str(e)) from None
    else:
        raw = path.read_bytes()
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}: byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8; it is not a text file "
                f"(remove it, or convert it to UTF-8)"
            ) from None


# -- one source file -> shards (in a worker) ------------------------------------------------------------


@lru_cache(maxsize=1)
def _tokenizer(path: str | None) -> Tokenizer:
    """The worker's tokenizer, loaded once per process."""
    return load_tokenizer(Path(path)) if path is not None else ByteTokenizer()


class _ShardWriter:
    """Appends documents to ``<u>-<k>.bin/.idx`` files, starting a new shard past ``shard_tokens``."""

    # the shard being written, set by ``add`` when it opens one
    _name: str
    _starts: list[int]
    _tokens: int

    def __init__(self, out: Path, unit: int, dtype: np.dtype, shard_tokens: int):
        self.out, self.unit, self.dtype, self.limit = out, unit, dtype, shard_tokens
        self.done: list[dict] = []
        self._bin: BinaryIO | None = None

    def add(self, ids: np.ndarray) -> None:
        if self._bin is None or (self._tokens and self._tokens + len(ids) > self.limit):
            self.close()
            self._name = f"{self.unit:06d}-{len(self.done):04d}"
            self._bin = open(self.out / f"{self._name}.bin.tmp", "wb")
            self._starts, self._tokens = [0], 0
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self._tokens += len(ids)
        self._starts.append(self._tokens)

    def abort(self) -> None:
        """Close and delete the shard being written (the file failed)."""
        if self._bin is not None:
            self._bin.close()
            (self.out / f"{self._name}.bin.tmp").unlink(missing_ok=True)
            self._bin = None

    def close(self) -> None:
        if self._bin is None:
            return
        self._bin.close()
        np.asarray(self._starts, np.int64).tofile(self.out / f"{self._name}.idx.tmp")
        record = {"name": self._name, "tokens": self._tokens, "docs": len(self._starts) - 1}
        for ext, prefix in ((".bin", ""), (".idx", "idx_")):
            final = self.out / f"{self._name}{ext}"
            os.replace(self.out / f"{self._name}{ext}.tmp", final)
            st = final.stat()
            record |= {
                f"{prefix}bytes": st.st_size,
                f"{prefix}mtime_ns": st.st_mtime_ns,
                f"{prefix}hash": file_hash(final),
            }
        self.done.append(record)
        self._bin = None


def _prepare_one(job: tuple) -> tuple[int, dict]:
    unit, path, tok_path, text_key, dtype, shard_tokens, out = job
    path, out = Path(path), Path(out)
    tok = _tokenizer(tok_path)
    for stale in out.glob(f"shards/{unit:06d}-*"):  # a run interrupted inside this file
        stale.unlink()
    st = path.stat()
    if st.st_size == 0:
        raise DataError(f"{path} is empty (0 bytes); remove it from the sources")
    writer = _ShardWriter(out / "shards", unit, np.dtype(dtype), shard_tokens)
    vocab = tok.vocab_size
    try:
        for doc in documents(path, text_key):
            ids = np.asarray(tok.encode(doc))
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise DataError(
                    f"{path}: the tokenizer produced an id outside its vocabulary 0..{vocab - 1}; check its vocab_size"
                )
            writer.add(ids)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    if not writer.done:
        raise DataError(f"{path} holds no documents (only blank lines?); remove it from the sources")
    record = {"source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "shards": writer.done}
    return unit, record


# -- the whole run ------------------------------------------------------------------------------------


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
    except ImportError:  # a line per file instead

        class _Lines:
            n = 0

            def update(self, k: int) -> None:
                self.n += k
                print(f"{desc}: {self.n / 1e6:.1f} / {total / 1e6:.1f} MB", file=sys.stderr)

            def close(self) -> None:
                pass

        return _Lines()


def prepare(
    sources: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    text_key: str = "text",
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
    split: str = DEFAULT_SPLIT,
) -> dict:
    """Tokenize ``sources`` into shards under ``out`` (resuming a previous, interrupted run); return the index.

    Args:
        sources: files and directories (see the module docstring for the formats).
        out: the output directory (created).
        tokenizer: a tokenizer file (tokenizer.json or tiktoken); None for the byte tokenizer.
        text_key: the field / column holding the text (JSONL, parquet, Arrow).
        workers: tokenizing processes (default: the CPU count, at most the number of files).
        shard_tokens: the most tokens in one shard (a larger document gets a shard of its own).
        progress: show a progress bar (bytes of source files done) on stderr.
        split: the split of a ``DatasetDict`` source to prepare (the others are left out, never merged).

    Raises:
        DataError: an empty, undecodable or unreadable source file (the message names it).
    """
    files = source_files(sources, split)
    if not files:
        raise DataError(f"no source files under {list(map(str, sources))}")
    out = Path(out)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    (out / "parts").mkdir(exist_ok=True)
    tok_path = str(Path(tokenizer).resolve()) if tokenizer is not None else None
    tok = _tokenizer(tok_path)
    ident = tokenizer_identity(tok, tok_path)
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    settings = {"tokenizer": ident, "text_key": text_key, "dtype": dtype, "shard_tokens": shard_tokens}
    records: dict[int, dict] = {}
    todo = []
    for u, f in enumerate(files):
        part = out / "parts" / f"{u:06d}.json"
        st = f.stat()
        if part.is_file():
            rec = json.loads(part.read_text())
            same = rec.get("settings") == settings and rec["source"] == str(f.resolve())
            if same and rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns:
                records[u] = rec
                continue
        todo.append((u, str(f), tok_path, text_key, dtype, shard_tokens, str(out)))
    bar = (
        _progress(sum(files[j[0]].stat().st_size for j in todo), f"functitan data prepare -> {out}")
        if progress
        else None
    )
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    t0 = time.perf_counter()
    results: Iterator[tuple[int, dict]]
    try:
        if workers == 1:
            results = map(_prepare_one, todo)
        else:
            # fork: workers start in milliseconds (spawn would re-import torch in each); nothing here has
            # started threads that a forked child could inherit mid-operation
            pool = mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(workers)
            results = pool.imap_unordered(_prepare_one, todo)
        for u, rec in results:
            rec["settings"] = settings
            _write_json(out / "parts" / f"{u:06d}.json", rec)
            records[u] = rec
            if bar is not None:
                bar.update(rec["size"])
    finally:
        if workers > 1:
            pool.terminate()
        if bar is not None:
            bar.close()
    shards = [sh for u in range(len(files)) for sh in records[u]["shards"]]
    index = {
        "format": FORMAT,
        **settings,
        "sources": [{k: records[u][k] for k in ("source", "size", "mtime_ns")} for u in range(len(files))],
        "shards": shards,
        "tokens": sum(sh["tokens"] for sh in shards),
        "documents": sum(sh["docs"] for sh in shards),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    _write_json(out / INDEX, index)
    return index


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


DESCRIPTION = """Tokenize text / .jsonl / .parquet files and Hugging Face `datasets` directories into memory-mapped
token shards, in parallel; run it again with the same arguments to resume. Train on them with --data.path=DIR."""
EXAMPLE = """example:
  functitan data prepare corpus/*.jsonl --out shards/ --tokenizer tokenizer.json
  functitan train --config configs/debug.toml --data.path=shards/
"""


def _parser() -> Any:
    from functitan._command import CommandParser, config_flag

    ap = CommandParser("data prepare", description=DESCRIPTION, examples=EXAMPLE)
    ap.add_argument("sources", nargs="+", metavar="SRC", help="a text, .jsonl or .parquet file, or a datasets folder")
    ap.add_argument("--out", required=True, metavar="DIR", help="the shards' folder (train with --data.path=DIR)")
    config_flag(ap, "data.tokenizer", metavar="FILE")
    config_flag(ap, "data.text_key")
    ap.add_argument("--workers", type=int, default=None, metavar="N", help="processes (default: one per CPU)")
    ap.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N", help="tokens per shard")
    ap.add_argument(
        "--split",
        default=DEFAULT_SPLIT,
        metavar="NAME",
        help=f"a DatasetDict's split to prepare (default {DEFAULT_SPLIT}); its other splits are left out, never merged",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress line")
    return ap


def main(argv: Sequence[str]) -> int:
    """``functitan data prepare ...``; bad input is one line and exit 2 (``--debug`` shows its traceback)."""
    from functitan._command import run

    return run(argv, _data_cli)


def _data_cli(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(_parser().format_help())
        return 0
    if args[0] != "prepare":
        return unknown_command("functitan data", args[0], ["prepare"])
    ns = _parser().parse_args(args[1:])
    for flag, value, hint in (
        ("--workers", ns.workers, "omit it for one per CPU"),
        ("--shard-tokens", ns.shard_tokens, f"the default is {DEFAULT_SHARD_TOKENS}"),
    ):
        if value is not None and value < 1:  # --workers 0 used to mean the default
            raise ValueError(f"{flag}={value}: must be >= 1 ({hint})")
    index = prepare(
        ns.sources,
        ns.out,
        tokenizer=ns.tokenizer,
        text_key=ns.text_key,
        workers=ns.workers,
        shard_tokens=ns.shard_tokens,
        progress=not ns.no_progress,
        split=ns.split,
    )
    print(
        f"functitan data prepare: {index['documents']} documents, {index['tokens']} tokens in "
        f"{len(index['shards'])} shards ({index['dtype']}) under {ns.out}"
    )
    for d, others in left_out(ns.sources, ns.split).items():
        print(
            f"functitan data prepare: split {ns.split!r} of {d}; left out {', '.join(others)} "
            f"(prepare one with --split {others[0]} --out ANOTHER_DIR)"
        )
    return 0
