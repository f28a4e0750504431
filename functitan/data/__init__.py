"""Training data: tokenizers, the default corpus, and a packed, data-parallel, resumable token loader.

Typical use::

    loader = TokenLoader(batch_size=8, seq_len=256, dp_rank=r, dp_size=n)  # stdlib corpus, byte tokens
    state = loader.init_state()                  # {"epoch": 0, "seq": 0}: checkpoint it with the model
    batch, state = loader.next(state)            # batch["inputs"], batch["targets"]: (8, 256) int64

A corpus larger than memory: ``functitan data prepare SRC... --out DIR`` once, then
``TokenLoader(shards=ShardSet(DIR), ...)`` (or ``--data.path=DIR``) reads it memory-mapped.
"""

from typing import TYPE_CHECKING

from functitan._lazy import lazy_exports
from functitan.data._config import DataConfig
from functitan.data._corpus import DEFAULT_CORPUS_BYTES, default_corpus, expand_paths, read_documents
from functitan.data._hf_tokenizer import run_tokenizer, save_hf_tokenizer
from functitan.data._prepare import DataError, prepare
from functitan.data._shards import ShardSet
from functitan.data._tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

if TYPE_CHECKING:  # imported on first use (functitan._lazy): the loader makes torch tensors, the rest does not
    from functitan.data._loader import TokenLoader, build_loader, dp_coords

__getattr__ = lazy_exports(__name__, {"._loader": ("TokenLoader", "build_loader", "dp_coords")})

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "load_tokenizer",
    "run_tokenizer",
    "save_hf_tokenizer",
    "DEFAULT_CORPUS_BYTES",
    "default_corpus",
    "expand_paths",
    "read_documents",
    "TokenLoader",
    "DataConfig",
    "build_loader",
    "dp_coords",
    "prepare",
    "DataError",
    "ShardSet",
]
