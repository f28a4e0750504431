"""``[data]``: what the trainer reads (its own module: the launcher checks a config without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

from functitan.data._corpus import DEFAULT_CORPUS_BYTES

__all__ = ["DataConfig"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What to train on; the batch shape and the data-parallel layout come from the trainer.

    Attributes:
        paths: text / .jsonl files or directories; empty for the default corpus (the Python stdlib).
        path: a directory written by ``functitan data prepare`` (memory-mapped shards) instead of ``paths``.
        tokenizer: a tokenizer.json or tiktoken file; None for the byte tokenizer (with ``path``: None for
            the one the shards were made with, else it must be that one).
        max_open_shards: with ``path``, the shards kept memory-mapped at once (bounds resident memory).
        text_key: the JSONL field holding the text.
        add_bos: put BOS before each document (EOS always follows it).
        seed: the document shuffle seed.
        max_corpus_bytes: the size cap of the default corpus.
    """

    paths: tuple[str, ...] = ()
    path: str | None = None
    tokenizer: str | None = None
    text_key: str = "text"
    add_bos: bool = False
    seed: int = 0
    max_corpus_bytes: int = DEFAULT_CORPUS_BYTES
    max_open_shards: int = 4

    def __post_init__(self) -> None:
        for key in ("max_corpus_bytes", "max_open_shards"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)}: must be >= 1")
