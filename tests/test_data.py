"""Tests for functitan.data: tokenizers, corpus, JSONL, packing, resumable and data-parallel iteration."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from functitan.data import (
    ByteTokenizer,
    DataConfig,
    Tokenizer,
    TokenLoader,
    build_loader,
    default_corpus,
    dp_coords,
    load_tokenizer,
    read_documents,
)

EOS = ByteTokenizer.eos_id
BOS = ByteTokenizer.bos_id


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> list[Path]:
    """A few text files of uneven length and one JSONL file: small enough to wrap epochs in a few steps."""
    files = [_write(tmp_path / f"doc{i}.txt", f"document {i}: " + "abcdefghij"[i:] * (i + 1)) for i in range(6)]
    lines = [json.dumps({"text": f"line {i} " + "xyz" * i, "id": i}) for i in range(5)]
    files.append(_write(tmp_path / "more.jsonl", "\n".join(lines) + "\n\n"))
    return files


def _sequences(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The packed (B, S + 1) sequences a batch was cut from."""
    return torch.cat([batch["inputs"], batch["targets"][:, -1:]], dim=1)


def _stream(loader: TokenLoader, steps: int, state=None) -> tuple[list[torch.Tensor], dict]:
    state = loader.init_state() if state is None else state
    out = []
    for _ in range(steps):
        batch, state = loader.next(state)
        out.append(_sequences(batch))
    return out, state


# -- tokenizers ----------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "héllo, 世界 🙂\n\x00tab\t"
    ids = tok.encode(text)
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert ids[:3].tolist() == [104, 195, 169]  # 'h', then 'é' as two UTF-8 bytes
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([BOS, *ids.tolist(), EOS]) == text  # specials are dropped
    assert tok.decode([0xFF, 104]) == "\ufffdh"  # broken UTF-8 is replaced, not an error
    with pytest.raises(ValueError, match="id 300 is outside the vocabulary 0..257"):
        tok.decode([104, 300])


def test_tokenizer_file_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(FileNotFoundError, match="tokenizer file .*nope.json does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    junk = _write(tmp_path / "tokenizer.model", "\x00\x01 not a tokenizer")
    with pytest.raises(ValueError, match=r"tokenizer\.model is not a recognised format.*tokenizer\.json.*tiktoken"):
        load_tokenizer(junk)

    hf = _write(tmp_path / "tokenizer.json", json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"tokenizer\.json is a Hugging Face tokenizers JSON.*pip install tokenizers"):
        load_tokenizer(hf)

    tt = _write(tmp_path / "bpe.tiktoken", "IQ== 0\nIg== 1\n")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ImportError, match=r"bpe\.tiktoken is a tiktoken BPE file.*pip install tiktoken"):
        load_tokenizer(tt)


def test_hf_tokenizer_file(tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))

    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert (loaded.vocab_size, loaded.eos_id, loaded.bos_id) == (4, 3, 3)  # no BOS token: EOS doubles as BOS
    assert loaded.encode("hello world hello").tolist() == [1, 2, 1]
    assert loaded.decode([1, 2]) == "hello world"
    with pytest.raises(ValueError, match=r"cannot find the bos_token \('<bos>' is not in its vocabulary\)"):
        load_tokenizer(tmp_path / "tokenizer.json", bos_token="<bos>")

    _write(tmp_path / "d.txt", "hello world")
    batch, _ = TokenLoader([tmp_path / "d.txt"], batch_size=1, seq_len=2, tokenizer=loaded).next({"epoch": 0, "seq": 0})
    assert batch["inputs"].tolist() == [[1, 2]] and batch["targets"].tolist() == [[2, 3]]


def test_tiktoken_file(tmp_path: Path):
    pytest.importorskip("tiktoken")
    import base64

    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll"]
    lines = [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(ranks)]
    loaded = load_tokenizer(_write(tmp_path / "tokenizer.model", "\n".join(lines) + "\n"), num_special_tokens=8)
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id) == (258 + 8, 258, 259)
    assert loaded.encode("hello").tolist() == [256, 257, ord("o")]
    assert loaded.decode(loaded.encode("héllo <|end_of_text|>")) == "héllo <|end_of_text|>"


# -- documents and the default corpus -------------------------------------------------------------------


def test_jsonl_documents_and_errors(tmp_path: Path):
    good = _write(tmp_path / "good.jsonl", '{"body": "first", "n": 1}\n\n{"body": "sécond"}\n')
    assert read_documents(good, text_key="body") == ["first", "sécond"]
    assert read_documents(_write(tmp_path / "plain.txt", "a\nb\n")) == ["a\nb\n"]  # a text file is one document

    bad = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: not valid JSON"):
        read_documents(bad)
    missing_key = r"good\.jsonl, line 1: no key 'text' \(keys: \['body', 'n'\]\); name the field .* in data\.text_key"
    with pytest.raises(ValueError, match=missing_key):
        read_documents(good)
    nonstr = _write(tmp_path / "n.jsonl", '{"text": 5}\n')
    with pytest.raises(ValueError, match=r"n\.jsonl, line 1: 'text' holds int, expected a string"):
        read_documents(nonstr)
    # The loader reports the same error when the stream reaches the file.
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3"):
        TokenLoader([bad], batch_size=1, seq_len=4).next({"epoch": 0, "seq": 0})


def test_default_corpus_is_deterministic_and_capped():
    cap = 400_000
    files = default_corpus(max_bytes=cap)
    assert files == default_corpus(max_bytes=cap)
    assert 0 < sum(f.stat().st_size for f in files) <= cap
    assert all(f.is_file() and f.suffix in (".py", ".txt") for f in files)
    assert not any({"site-packages", "test", "tests", "__pycache__"} & set(f.parts) for f in files)
    smaller = default_corpus(max_bytes=cap // 4)
    assert 0 < len(smaller) < len(files) and files[: len(smaller)] == smaller  # a smaller cap is a prefix
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        default_corpus(max_bytes=0)


def test_default_loader_batch():
    loader = TokenLoader(default_corpus(max_bytes=300_000), batch_size=2, seq_len=64)
    batch, state = loader.next(loader.init_state())
    assert batch["inputs"].shape == batch["targets"].shape == (2, 64)
    assert batch["inputs"].dtype == torch.int64 and int(batch["inputs"].max()) < 258
    assert state == {"epoch": 0, "seq": 2}


# -- packing ---------------------------------------------------------------------------------------------


def test_packing_puts_eos_after_each_document_and_shifts_targets(tmp_path: Path):
    docs = ["ab", "cde", "f"]
    files = [_write(tmp_path / f"{i}.txt", d) for i, d in enumerate(docs)]
    # 2+1 + 3+1 + 1+1 = 9 tokens per epoch = exactly 3 sequences of seq_len + 1 = 3.
    loader = TokenLoader(files, batch_size=3, seq_len=2, seed=1)
    assert loader.sequences_per_epoch == 3
    orders = set()
    state = loader.init_state()
    for epoch in range(4):
        batch, state = loader.next(state)
        assert state == {"epoch": epoch + 1, "seq": 0}
        assert torch.equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
        stream = _sequences(batch).reshape(-1).tolist()
        assert stream[-1] == EOS and stream.count(EOS) == 3
        text = bytes(t if t != EOS else ord("|") for t in stream).decode()
        assert sorted(text.rstrip("|").split("|")) == docs
        orders.add(text)
    assert len(orders) > 1  # each epoch has its own document order

    bos = TokenLoader(files[:1], batch_size=1, seq_len=3, add_bos=True)  # [BOS] a b [EOS]
    batch, _ = bos.next(bos.init_state())
    assert batch["inputs"].tolist() == [[BOS, ord("a"), ord("b")]]
    assert batch["targets"].tolist() == [[ord("a"), ord("b"), EOS]]


def test_corpus_too_small_is_an_error(tmp_path: Path):
    loader = TokenLoader([_write(tmp_path / "tiny.txt", "hi")], batch_size=1, seq_len=8)
    too_small = r"has 3 tokens per epoch \(with EOS\), too few for one sequence of seq_len \+ 1 = 9"
    with pytest.raises(ValueError, match=too_small):
        loader.next(loader.init_state())


# -- resuming and data parallelism -----------------------------------------------------------------------


def test_restored_iterator_continues_identically(corpus: list[Path]):
    make = lambda: TokenLoader(corpus, batch_size=3, seq_len=16, seed=7)  # noqa: E731
    loader = make()
    n = loader.sequences_per_epoch
    uninterrupted, _ = _stream(loader, 12)
    assert 12 * 3 > n  # the run wraps into a later epoch

    _, saved = _stream(make(), 5)
    saved = json.loads(json.dumps(saved))  # plain ints: survives any checkpoint format
    assert saved == {"epoch": 5 * 3 // n, "seq": 5 * 3 % n}
    resumed, _ = _stream(make(), 7, saved)
    for a, b in zip(uninterrupted[5:], resumed):
        assert torch.equal(a, b)
    # A state restored as tensors (as a checkpoint may give it back) works too.
    tensor_state = {k: torch.tensor(v) for k, v in saved.items()}
    assert torch.equal(make().next(tensor_state)[0]["inputs"], uninterrupted[5][:, :-1])


def test_dp_ranks_partition_the_single_rank_stream(corpus: list[Path]):
    ref = TokenLoader(corpus, batch_size=4, seq_len=8, seed=3)
    ranks = [TokenLoader(corpus, batch_size=2, seq_len=8, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    ref_state, states = ref.init_state(), [r.init_state() for r in ranks]
    for _ in range(30):  # several epochs
        ref_batch, ref_state = ref.next(ref_state)
        outs = [r.next(s) for r, s in zip(ranks, states)]
        states = [s for _, s in outs]
        assert states[0] == states[1] == ref_state
        for key in ("inputs", "targets"):
            assert torch.equal(torch.cat([b[key] for b, _ in outs]), ref_batch[key])
    assert ref_state["epoch"] >= 2


def test_resume_with_a_different_dp_size_continues_the_global_stream(corpus: list[Path]):
    kw = dict(seq_len=8, seed=5)
    reference, _ = _stream(TokenLoader(corpus, batch_size=1, **kw), 60)  # one sequence per step
    reference = [s[0] for s in reference]

    got, state = [], {"epoch": 0, "seq": 0}
    for dp_size, batch_size, steps in ((2, 2, 3), (4, 1, 4), (1, 3, 3), (3, 2, 2)):
        for _ in range(steps):
            outs = [
                TokenLoader(corpus, batch_size=batch_size, dp_rank=r, dp_size=dp_size, **kw).next(state)
                for r in range(dp_size)
            ]
            assert all(s == outs[0][1] for _, s in outs)
            got += [row for b, _ in outs for row in _sequences(b)]
            state = outs[0][1]
    assert len(got) == 12 + 16 + 9 + 12
    for i, row in enumerate(got):
        assert torch.equal(row, reference[i]), f"sequence {i} differs"


def test_state_and_argument_errors(corpus: list[Path]):
    loader = TokenLoader(corpus, batch_size=1, seq_len=4)
    with pytest.raises(ValueError, match=r"state must be a dict with keys \['epoch', 'seq'\]"):
        loader.next({"step": 3})
    with pytest.raises(TypeError, match=r"state\['seq'\] must be an int, got 1.5"):
        loader.next({"epoch": 0, "seq": 1.5})
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, dp_size=2\), got 2"):
        TokenLoader(corpus, batch_size=1, seq_len=4, dp_rank=2, dp_size=2)
    with pytest.raises(FileNotFoundError, match="data path .*missing.txt does not exist"):
        TokenLoader([corpus[0].parent / "missing.txt"], batch_size=1, seq_len=4)


def test_build_loader_and_directories(corpus: list[Path]):
    cfg = DataConfig(paths=(str(corpus[0].parent),), seed=2)
    loader = build_loader(cfg, batch_size=2, seq_len=8, dp_rank=1, dp_size=2)
    assert loader.files == sorted(corpus, key=lambda p: p.name)
    direct = TokenLoader(corpus, batch_size=4, seq_len=8, seed=2)
    assert torch.equal(loader.next(loader.init_state())[0]["inputs"], direct.next(direct.init_state())[0]["inputs"][2:])


class _FakeMesh:
    mesh_dim_names = ("pp", "dp_replicate", "dp_shard", "tp")
    _sizes, _ranks = (2, 2, 3, 2), (1, 1, 2, 0)

    def size(self, dim: int) -> int:
        return self._sizes[dim]

    def get_local_rank(self, axis: str) -> int:
        return self._ranks[self.mesh_dim_names.index(axis)]


def test_dp_coords_flattens_replicate_and_shard():
    assert dp_coords(_FakeMesh()) == (1 * 3 + 2, 6)  # pp and tp ranks do not change the data rank
