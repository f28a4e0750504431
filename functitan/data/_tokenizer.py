"""Tokenizers: a built-in byte-level one, and loaders for Hugging Face and tiktoken tokenizer files.

Every tokenizer is anything with ``vocab_size``, ``bos_id``, ``eos_id``, ``encode`` and ``decode`` (the
:class:`Tokenizer` protocol), so the loader never needs to know where it came from. The byte tokenizer
needs no file and no package, which is what makes the default corpus train out of the box.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

__all__ = ["Tokenizer", "ByteTokenizer", "load_tokenizer"]

# Candidate names for the special tokens, in order of preference, tried when a tokenizer.json file does
# not say which of its tokens begin and end a document.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|im_end|>")

# The split pattern of Llama 3 / cl100k, used for tiktoken files (the file holds only the merge ranks).
_TIKTOKEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer.

    ``encode`` must not add special tokens itself: the loader puts ``eos_id`` after every document
    (and ``bos_id`` before it when asked), so a tokenizer that added its own would double them.
    """

    # read-only to the loader, so an attribute, a property or a class constant (ByteTokenizer's) all fit
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> Sequence[int] | np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is BOS, 257 is EOS (``vocab_size`` 258).

    Needs no file and round-trips any string. Encoding is one ``str.encode`` plus a zero-copy numpy view,
    so it tokenises tens of MB per second.

    >>> tok = ByteTokenizer()
    >>> tok.encode("hé").tolist()
    [104, 195, 169]
    >>> tok.decode([104, 195, 169, 257])
    'hé'
    """

    vocab_size: ClassVar[int] = 258
    bos_id: ClassVar[int] = 256
    eos_id: ClassVar[int] = 257

    def encode(self, text: str) -> np.ndarray:
        """``text`` as a ``uint16`` array of its UTF-8 bytes (no special tokens)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids``; BOS/EOS are dropped and broken UTF-8 decodes as U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(
                f"ByteTokenizer.decode: id {int(bad[0])} is outside the vocabulary 0..{self.vocab_size - 1}; "
                "were these ids made by another tokenizer?"
            )
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class _HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer.json behind the :class:`Tokenizer` protocol."""

    def __init__(self, tok: Any, path: Path, bos_token: str | None, eos_token: str | None):
        self._tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._special(path, eos_token, _EOS_NAMES, "eos_token")
        # Tokenizers without a BOS (GPT-2 style) use their end-of-text token for both.
        try:
            self.bos_id = self._special(path, bos_token, _BOS_NAMES, "bos_token")
        except ValueError:
            if bos_token is not None:
                raise
            self.bos_id = self.eos_id

    def _special(self, path: Path, given: str | None, names: Sequence[str], arg: str) -> int:
        for name in (given,) if given is not None else names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return int(idx)
        found = "is not in its vocabulary" if given is not None else f"none of {list(names)} is in its vocabulary"
        raise ValueError(
            f"tokenizer file {path}: cannot find the {arg} ({given!r} {found}); "
            f"pass {arg}='...' naming the token that {'ends' if 'eos' in arg else 'begins'} a document"
        )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])


class _TiktokenTokenizer:
    """A tiktoken BPE ranks file (Llama 3 ``tokenizer.model`` style) behind the :class:`Tokenizer` protocol.

    The file holds only the mergeable ranks; special tokens follow them as in Llama 3: ``n`` is
    ``<|begin_of_text|>`` (BOS), ``n + 1`` is ``<|end_of_text|>`` (EOS), then reserved tokens up to
    ``num_special_tokens``.
    """

    def __init__(self, tiktoken: Any, path: Path, ranks: dict[bytes, int], num_special_tokens: int):
        n = len(ranks)
        names = ["<|begin_of_text|>", "<|end_of_text|>"]
        names += [f"<|reserved_special_token_{i}|>" for i in range(max(num_special_tokens, 2) - 2)]
        special = {name: n + i for i, name in enumerate(names)}
        self._enc = tiktoken.Encoding(
            name=path.name, pat_str=_TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        self.vocab_size = n + len(names)
        self.bos_id, self.eos_id = n, n + 1

    def encode(self, text: str) -> np.ndarray:
        # encode_ordinary: text that happens to contain "<|end_of_text|>" stays text.
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._enc.decode([int(i) for i in np.asarray(ids).reshape(-1)], errors="replace")


def _require(module: str, path: Path, kind: str, pip_name: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"tokenizer file {path} is a {kind} file; reading it needs the `{module}` package, which is not "
            f"installed: pip install {pip_name}"
        ) from e


def _read_tiktoken_ranks(path: Path, lines: list[bytes]) -> dict[bytes, int] | None:
    """The ranks of a tiktoken file, or None when the file is not one (checked on its first line)."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error):
            if not ranks:
                return None
            raise ValueError(
                f"tokenizer file {path}, line {lineno}: expected 'base64-token rank' as in the lines before, "
                f"found {line[:80]!r}"
            ) from None
    return ranks or None


def load_tokenizer(
    path: str | Path,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    num_special_tokens: int = 256,
) -> Tokenizer:
    """A tokenizer from a file: a Hugging Face ``tokenizer.json`` or a tiktoken BPE ranks file.

    The format is recognised from the content, not the name. Hugging Face files need the ``tokenizers``
    package, tiktoken files the ``tiktoken`` package; neither is imported until a file needs it.

    Args:
        path: the tokenizer file.
        bos_token, eos_token: for tokenizer.json, the tokens that begin / end a document, when they are
            not one of the usual names (``<|begin_of_text|>``, ``<s>``, ``</s>``, ``<|endoftext|>``...).
            Without a BOS token the EOS token is used for both.
        num_special_tokens: for tiktoken files, how many special ids follow the ranks (256 as in Llama 3).

    Raises:
        FileNotFoundError: no such file.
        ImportError: the file's package is not installed (the message says what to install).
        ValueError: the file is neither format, or its BOS/EOS tokens cannot be found.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    raw = path.read_bytes()
    if raw.lstrip()[:1] == b"{":
        try:
            spec = json.loads(raw)
        except ValueError:
            spec = None
        if isinstance(spec, dict) and "model" in spec:
            tokenizers = _require("tokenizers", path, "Hugging Face tokenizers JSON", "tokenizers")
            return _HFTokenizer(tokenizers.Tokenizer.from_file(str(path)), path, bos_token, eos_token)
    else:
        ranks = _read_tiktoken_ranks(path, raw.splitlines())
        if ranks is not None:
            tiktoken = _require("tiktoken", path, "tiktoken BPE", "tiktoken")
            return _TiktokenTokenizer(tiktoken, path, ranks, num_special_tokens)
    raise ValueError(
        f"tokenizer file {path} is not a recognised format: expected a Hugging Face tokenizer.json (a JSON "
        "object with a 'model' key) or a tiktoken BPE file (lines 'base64-token rank'). SentencePiece "
        ".model files are not supported: convert them to tokenizer.json with the `transformers` library, "
        "or omit the tokenizer to use the built-in byte tokenizer"
    )
