"""TokenLoader: documents -> one packed token stream per epoch -> data-parallel batches, resumable.

The global stream (the same on every rank, whatever the data-parallel size):

1. Epoch ``e`` orders the files by a permutation drawn from ``(seed, e)``, and the documents inside each
   file by one drawn from ``(seed, e, file)``.
2. Each document becomes ``[BOS] tokens EOS`` (BOS only with ``add_bos``); the epoch's token stream is
   these back to back.
3. The stream is cut into packed sequences of ``seq_len + 1`` tokens: sequence ``j`` is tokens
   ``[j*(S+1), (j+1)*(S+1))``. A leftover of fewer than ``S+1`` tokens at the end of an epoch is dropped,
   so every epoch has the same number ``N`` of sequences. After sequence ``N-1`` of epoch ``e`` comes
   sequence 0 of epoch ``e+1``.
4. Global step ``k`` consumes ``dp_size * batch_size`` consecutive sequences of that stream; rank ``r``
   takes the ``r``-th block of ``batch_size`` of them. So the ranks' batches, in rank order, are exactly
   the batch that one rank with ``batch_size * dp_size`` would see.

The iterator state ``{"epoch": e, "seq": n}`` says "n sequences of epoch e are consumed" in global units.
It is identical on every rank and does not depend on ``dp_size`` or ``batch_size``, so a run saved with 8
data-parallel ranks resumes with 4 (or 1, or a different per-rank batch size) at the same point of the
global stream. It does depend on ``seq_len``, the files, the tokenizer, ``add_bos``, ``seed`` and
``holdout``: change any of them and the same state points into a different stream.

A holdout splits the documents in two, once and for all: document ``d`` of a file is held out when a uniform
draw keyed by the file's name and ``d`` falls below ``holdout``, whatever the epoch, the shuffle seed or the
data-parallel size. The training loader (``held_out=False``) streams the others and the evaluation loader
(``held_out=True``) these, so no evaluated token is ever trained on (``[eval] holdout``).
"""

from __future__ import annotations

import bisect
import operator
import os
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from functitan.data._config import DataConfig
from functitan.data._corpus import (
    check_text_file,
    default_corpus,
    expand_paths,
    read_documents,
)
from functitan.data._shards import ShardSet, is_prepared
from functitan.data._tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from functitan.mesh import DP_AXES

__all__ = ["TokenLoader", "build_loader", "dp_coords"]

_STATE_KEYS = ("epoch", "seq")
_DOC_ORDERS_KEPT = 8  # per epoch: the files whose document order is kept between batches
_HOLDOUT_SALT = 0x4F1D  # keys the holdout draw apart from the shuffle seeds


class _FileTokens(NamedTuple):
    """One file's documents, tokenised once and cached for every epoch."""

    tokens: np.ndarray  # (n_tokens,) uint16 or uint32: the documents back to back, without BOS/EOS
    starts: np.ndarray  # (n_docs + 1,) int64: document d is tokens[starts[d]:starts[d + 1]]


class _Epoch:
    """The lazily built index of one epoch's token stream."""

    def __init__(self, order: np.ndarray):
        self.order = order  # (n_files,) file ids in stream order
        self.ends: list[int] = []  # ends[i]: stream offset where the block of file order[i] ends
        # file id -> (doc order, doc end offsets), the few most recently read (recomputed when evicted)
        self.docs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()


class TokenLoader:
    """Packed next-token batches over a document stream, with a functional, resumable iterator.

    ``batch, state = loader.next(state)`` gives ``{"inputs": (B, S) int64, "targets": (B, S) int64}``
    where ``targets[:, t] == inputs[:, t + 1]`` within a packed sequence of ``S + 1`` tokens. The state is
    a dict of two Python ints, for the checkpoint; see the module docstring for the global stream that it
    indexes, and why it survives a change of data-parallel size.

    Files are tokenised when the stream first reaches them and kept in memory as uint16/uint32 arrays,
    so the first batch costs only the first few files and later epochs cost no tokenisation. Restoring a
    state in a new process re-tokenises the files before that point (to count tokens).

    With ``shards`` (a directory written by ``functitan data prepare``, see ``ShardSet``) each shard is one
    "file" of the stream: sizes come from its index, tokens are memory-mapped when read and at most
    ``ShardSet.max_open`` shards stay mapped, so resident memory does not grow with the corpus.

    Args:
        paths: text / ``.jsonl`` files or directories (see ``expand_paths``); None for ``default_corpus()``.
        shards: prepared shards instead of ``paths`` (their tokenizer is ``shards.tokenizer``).
        batch_size: sequences per rank per step (B).
        seq_len: tokens per input sequence (S).
        tokenizer: any :class:`Tokenizer`; default the byte tokenizer.
        dp_rank, dp_size: this rank's index among the data-parallel ranks, and their number.
        seed: the shuffle seed.
        text_key: the field holding the text in JSONL files.
        add_bos: also put BOS before each document (EOS always follows it).
        device: where the batch tensors go (default: stay on the CPU, for the trainer to move).
        holdout: the share of each file's documents set aside for evaluation (see the module docstring).
        held_out: stream the held-out documents instead of the others.

    >>> loader = TokenLoader(batch_size=2, seq_len=16)  # the stdlib as a corpus, byte tokens
    >>> batch, state = loader.next(loader.init_state())
    >>> batch["inputs"].shape, state
    (torch.Size([2, 16]), {'epoch': 0, 'seq': 2})
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike] | None = None,
        *,
        shards: ShardSet | None = None,
        batch_size: int,
        seq_len: int,
        tokenizer: Tokenizer | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        text_key: str = "text",
        add_bos: bool = False,
        device: torch.device | str | None = None,
        holdout: float = 0.0,
        held_out: bool = False,
    ):
        if not 0.0 <= holdout < 1.0 or (held_out and holdout == 0.0):
            raise ValueError(f"TokenLoader: holdout must be in [0, 1) (and > 0 with held_out=True), got {holdout!r}")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("dp_size", dp_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TokenLoader: {name} must be a positive int, got {value!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"TokenLoader: dp_rank must be in [0, dp_size={dp_size}), got {dp_rank!r}")
        if shards is not None:
            if paths is not None or tokenizer is not None:
                raise ValueError(
                    "TokenLoader: pass either shards (whose tokenizer is shards.tokenizer) or paths/tokenizer"
                )
            self.files = [Path(shards.name(i)) for i in range(len(shards))]
            tokenizer = shards.tokenizer
        else:
            self.files = expand_paths(paths) if paths is not None else default_corpus()
            for f in self.files if paths is not None else ():
                check_text_file(f)  # a binary file is refused now, as `functitan data prepare` refuses it
        if not self.files:
            raise ValueError("TokenLoader: no data files (the paths name no files); pass files or directories")
        self.shards = shards
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.text_key, self.add_bos, self.device = text_key, add_bos, device
        self._dtype = np.uint16 if self.tokenizer.vocab_size <= 2**16 else np.uint32
        self._specials = 1 + int(add_bos)  # special tokens per document
        self.holdout, self.held_out = holdout, held_out
        self._kept: dict[int, np.ndarray] = {}  # file id -> the ids of the documents this loader streams
        self._cache: dict[int, _FileTokens] = {}
        self._epochs: dict[int, _Epoch] = {}
        self._total: int | None = None  # tokens per epoch, known once one epoch has been walked to its end

    # -- the functional iterator -------------------------------------------------------------------

    def init_state(self) -> dict[str, int]:
        """The state before the first batch."""
        return {"epoch": 0, "seq": 0}

    def next(self, state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """This rank's batch at ``state``, and the state after this global step (the same on all ranks)."""
        epoch, seq = self._check_state(state)
        width = self.seq_len + 1
        out = np.empty((self.batch_size, width), dtype=np.int64)  # (B, S + 1)
        first = seq + self.dp_rank * self.batch_size
        e0, j0 = self._normalize(epoch, first)
        e1, j1 = self._normalize(epoch, first + self.batch_size - 1)
        if (e0, j0 + self.batch_size - 1) == (e1, j1):  # consecutive sequences of one epoch: one read
            self._read(e0, j0 * width, (j1 + 1) * width, out.reshape(-1))
        else:
            for b in range(self.batch_size):
                e, j = self._normalize(epoch, first + b)
                self._read(e, j * width, (j + 1) * width, out[b])
        e, j = self._normalize(epoch, seq + self.dp_size * self.batch_size)
        inputs = torch.from_numpy(np.ascontiguousarray(out[:, :-1]))  # (B, S)
        targets = torch.from_numpy(np.ascontiguousarray(out[:, 1:]))  # (B, S)
        if self.device is not None:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
        return {"inputs": inputs, "targets": targets}, {"epoch": e, "seq": j}

    def holds(self, sequences: int) -> bool:
        """Whether one epoch holds this many sequences (indexes only the files it takes to tell)."""
        return self._reach(self._epoch(0), sequences * (self.seq_len + 1))

    @property
    def sequences_per_epoch(self) -> int:
        """N, the packed sequences in one epoch (tokenises the whole corpus on first use)."""
        self._reach(self._epoch(0), float("inf"))  # walks the whole epoch, so the total is known
        self._normalize(0, 0)  # raises when the corpus holds no full sequence
        return cast(int, self._total) // (self.seq_len + 1)  # known once the epoch was walked

    # -- the stream ----------------------------------------------------------------------------------

    def _check_state(self, state: Mapping[str, Any]) -> tuple[int, int]:
        if not isinstance(state, Mapping) or sorted(state) != sorted(_STATE_KEYS):
            raise ValueError(
                f"TokenLoader.next: the state must be a dict with keys {list(_STATE_KEYS)} as made by "
                f"init_state() or returned by next(), got {state!r}"
            )
        out = []
        for key in _STATE_KEYS:
            try:
                value = operator.index(state[key])
            except TypeError:
                raise TypeError(f"TokenLoader.next: state[{key!r}] must be an int, got {state[key]!r}") from None
            if value < 0:
                raise ValueError(f"TokenLoader.next: state[{key!r}] must be >= 0, got {value}")
            out.append(value)
        return out[0], out[1]

    def _normalize(self, epoch: int, seq: int) -> tuple[int, int]:
        """``(epoch, seq)`` with ``seq`` past the end of the epoch carried into later epochs."""
        width = self.seq_len + 1
        while self._total is None:
            if self._reach(self._epoch(epoch), (seq + 1) * width):
                return epoch, seq
        n = self._total // width
        if n == 0:
            raise ValueError(
                f"TokenLoader: the corpus ({len(self.files)} files, first {self.files[0]}) has {self._total} "
                f"tokens per epoch (with EOS), too few for one sequence of seq_len + 1 = {width}; add data "
                "or lower seq_len"
            )
        return epoch + seq // n, seq % n

    def _epoch(self, epoch: int) -> _Epoch:
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:  # a step straddles at most two epochs
                del self._epochs[min(self._epochs)]
            rng = np.random.default_rng([self.seed, epoch])
            self._epochs[epoch] = _Epoch(rng.permutation(len(self.files)))
        return self._epochs[epoch]

    def _reach(self, ep: _Epoch, stop: float) -> bool:
        """Index files of ``ep`` until its stream holds ``stop`` tokens; False when the epoch is shorter."""
        while (ep.ends[-1] if ep.ends else 0) < stop and len(ep.ends) < len(ep.order):
            n_tokens, n_docs = self._size(int(ep.order[len(ep.ends)]))
            size = n_tokens + self._specials * n_docs
            ep.ends.append((ep.ends[-1] if ep.ends else 0) + size)
        if len(ep.ends) == len(ep.order):
            self._total = ep.ends[-1] if ep.ends else 0
        return (ep.ends[-1] if ep.ends else 0) >= stop

    def _read(self, epoch: int, start: int, stop: int, out: np.ndarray) -> None:
        """Tokens ``[start, stop)`` of the epoch's stream into ``out``."""
        ep = self._epoch(epoch)
        self._reach(ep, stop)
        i, pos = bisect.bisect_right(ep.ends, start), start
        while pos < stop:
            block_start = ep.ends[i - 1] if i else 0
            hi = min(stop, ep.ends[i])
            fid, lo = int(ep.order[i]), pos - block_start
            self._read_block(epoch, ep, fid, lo, hi - block_start, out[pos - start : hi - start])
            pos, i = hi, i + 1

    def _read_block(self, epoch: int, ep: _Epoch, fid: int, lo: int, hi: int, out: np.ndarray) -> None:
        """Tokens ``[lo, hi)`` of one file's block (its documents in this epoch's order) into ``out``."""
        ft = self._tokens(fid)
        if fid not in ep.docs:
            kept = self._documents(fid)
            order = kept[np.random.default_rng([self.seed, epoch, fid]).permutation(len(kept))]
            ep.docs[fid] = (order, np.cumsum(np.diff(ft.starts)[order] + self._specials))
            if len(ep.docs) > _DOC_ORDERS_KEPT:
                ep.docs.popitem(last=False)
        ep.docs.move_to_end(fid)
        order, ends = ep.docs[fid]
        k, pos = int(np.searchsorted(ends, lo, side="right")), lo
        while pos < hi:
            doc_start = int(ends[k - 1]) if k else 0
            end = min(hi, int(ends[k]))
            self._read_doc(ft, int(order[k]), pos - doc_start, end - doc_start, out[pos - lo : end - lo])
            pos, k = end, k + 1

    def _read_doc(self, ft: _FileTokens, d: int, i: int, j: int, out: np.ndarray) -> None:
        """Positions ``[i, j)`` of document ``d`` laid out as ``[BOS] tokens EOS`` into ``out``."""
        s, n, nb = int(ft.starts[d]), int(ft.starts[d + 1] - ft.starts[d]), int(self.add_bos)
        tok = self.tokenizer
        for seg_lo, seg_hi, src in ((0, nb, tok.bos_id), (nb, nb + n, None), (nb + n, nb + n + 1, tok.eos_id)):
            lo, hi = max(i, seg_lo), min(j, seg_hi)
            if lo < hi:
                out[lo - i : hi - i] = src if src is not None else ft.tokens[s + lo - nb : s + hi - nb]

    def _size(self, fid: int) -> tuple[int, int]:
        """``(tokens, documents)`` this loader streams of one file (a whole shard's from its index, unread)."""
        if self.shards is not None and not self.holdout:
            return self.shards.size(fid)
        starts = self._tokens(fid).starts
        if not self.holdout:
            return int(starts[-1]), len(starts) - 1
        kept = self._documents(fid)
        return int((starts[kept + 1] - starts[kept]).sum()), len(kept)

    def _documents(self, fid: int) -> np.ndarray:
        """The ids of the documents of file ``fid`` this loader streams: all, or one side of the holdout."""
        if fid not in self._kept:
            n_docs = len(self._tokens(fid).starts) - 1
            if not self.holdout:
                return np.arange(n_docs)
            name = self.shards.shards[fid]["name"] if self.shards is not None else os.fspath(self.files[fid])
            draw = np.random.default_rng([_HOLDOUT_SALT, zlib.crc32(name.encode())]).random(n_docs)
            self._kept[fid] = np.flatnonzero((draw < self.holdout) == self.held_out)
        return self._kept[fid]

    def _tokens(self, fid: int) -> _FileTokens:
        if self.shards is not None:
            return _FileTokens(*self.shards.get(fid))
        if fid not in self._cache:
            path, vocab = self.files[fid], self.tokenizer.vocab_size
            arrays = []
            for doc in read_documents(path, text_key=self.text_key):
                ids = np.asarray(self.tokenizer.encode(doc))
                if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                    raise ValueError(
                        f"{path}: the tokenizer produced id {int(ids.max() if ids.max() >= vocab else ids.min())}"
                        f" outside its vocabulary 0..{vocab - 1}; check its vocab_size"
                    )
                if ids.size:  # an empty document adds nothing but an EOS
                    arrays.append(ids.astype(self._dtype, copy=False))
            starts = np.zeros(len(arrays) + 1, dtype=np.int64)
            np.cumsum([len(a) for a in arrays], out=starts[1:])
            tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=self._dtype)
            self._cache[fid] = _FileTokens(tokens, starts)
        return self._cache[fid]


def dp_coords(mesh: Any) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this process on a functitan mesh: the flattened dp_replicate x dp_shard index.

    Ranks that differ only in ``tp`` or ``pp`` get the same data, as they must.
    """
    names = mesh.mesh_dim_names or ()
    rank, size = 0, 1
    for axis in DP_AXES:
        if axis in names:
            n = mesh.size(names.index(axis))
            rank, size = rank * n + mesh.get_local_rank(axis), size * n
    return rank, size


def build_loader(
    cfg: DataConfig,
    *,
    batch_size: int,
    seq_len: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    device: torch.device | str | None = None,
    holdout: float = 0.0,
    held_out: bool = False,
) -> TokenLoader:
    """The TokenLoader that ``cfg`` describes, for one data-parallel rank (``holdout``, ``held_out``: one side
    of a split of its documents, see ``TokenLoader``)."""
    if cfg.path is not None:
        if cfg.paths:
            raise ValueError(f"data.path={cfg.path} and data.paths={list(cfg.paths)}: give one (path: prepared shards)")
        if not Path(cfg.path).is_dir():
            raise FileNotFoundError(
                f"data.path={cfg.path}: no such directory; make the shards with `functitan data prepare SRC ... "
                f"--out {cfg.path}`, or use data.paths for text / JSONL / parquet files"
            )
        shards = ShardSet(cfg.path, tokenizer=cfg.tokenizer, max_open=cfg.max_open_shards)
        paths, tokenizer = None, None
    else:
        for p in cfg.paths:
            if is_prepared(p):
                raise ValueError(f"data.paths: {p} is a directory of prepared shards; pass it as data.path={p}")
        paths = list(cfg.paths) if cfg.paths else default_corpus(cfg.max_corpus_bytes)
        tokenizer = load_tokenizer(Path(cfg.tokenizer)) if cfg.tokenizer else None
        shards = None
    return TokenLoader(
        paths,
        shards=shards,
        batch_size=batch_size,
        seq_len=seq_len,
        tokenizer=tokenizer,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=cfg.seed,
        text_key=cfg.text_key,
        add_bos=cfg.add_bos,
        device=device,
        holdout=holdout,
        held_out=held_out,
    )
