"""functitan data prepare and the memory-mapped shards: same stream as the text loader, resumable, named
errors, parquet / Arrow sources, and resident memory bounded on a multi-GB corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import cli

from functitan.data import ByteTokenizer, DataConfig, DataError, ShardSet, TokenLoader, build_loader, prepare
from functitan.data._shards import FORMAT, INDEX, file_hash, tokenizer_identity

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> list[Path]:
    src = tmp_path / "src"
    src.mkdir()
    files = [_write(src / f"doc{i}.txt", f"document {i}: " + "abcdefghij"[i:] * (i + 3)) for i in range(6)]
    lines = [json.dumps({"text": f"line {i} " + "xyz" * i, "id": i}) for i in range(7)]
    files.append(_write(src / "more.jsonl", "\n".join(lines) + "\n\n"))
    return files


def _stream(loader: TokenLoader, steps: int, state=None) -> tuple[list[torch.Tensor], dict]:
    state = loader.init_state() if state is None else state
    out = []
    for _ in range(steps):
        batch, state = loader.next(state)
        out.append(torch.cat([batch["inputs"], batch["targets"][:, -1:]], dim=1))
    return out, state


def test_shards_give_the_text_loaders_stream(corpus: list[Path], tmp_path: Path):
    index = prepare(corpus, tmp_path / "prep", workers=1, progress=False)
    assert index["format"] == FORMAT and index["dtype"] == "uint16" and len(index["shards"]) == len(corpus)
    assert index["documents"] == 6 + 7
    kw = dict(batch_size=3, seq_len=7, seed=3, add_bos=True)
    want, want_state = _stream(TokenLoader(corpus, **kw), 40)  # several epochs
    got, got_state = _stream(TokenLoader(shards=ShardSet(tmp_path / "prep"), **kw), 40)
    assert got_state == want_state
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i} differs"


def test_shard_stream_resumes_at_another_dp_size(corpus: list[Path], tmp_path: Path):
    # small shards: files split over several shards, each a "file" of the stream
    prepare(corpus, tmp_path / "prep", workers=1, shard_tokens=16, progress=False)
    shards = ShardSet(tmp_path / "prep")
    assert len(shards) > len(corpus)
    kw = dict(seq_len=8, seed=5)
    reference, _ = _stream(TokenLoader(shards=shards, batch_size=1, **kw), 48)
    reference = [s[0] for s in reference]
    # a run saved at dp 8 (batch 1 per rank) resumes at dp 4 (batch 2 per rank) at the same point
    got, state = [], {"epoch": 0, "seq": 0}
    for dp_size, batch_size, steps in ((8, 1, 3), (4, 2, 3)):
        for _ in range(steps):
            outs = [
                TokenLoader(
                    shards=ShardSet(tmp_path / "prep"), batch_size=batch_size, dp_rank=r, dp_size=dp_size, **kw
                ).next(state)
                for r in range(dp_size)
            ]
            assert all(s == outs[0][1] for _, s in outs)
            got += [torch.cat([b["inputs"], b["targets"][:, -1:]], 1)[k] for b, _ in outs for k in range(batch_size)]
            state = outs[0][1]
    assert len(got) == 48
    for i, row in enumerate(got):
        assert torch.equal(row, reference[i]), f"sequence {i} differs"


def test_cli_prepares_in_parallel_and_resumes(corpus: list[Path], tmp_path: Path):
    out = tmp_path / "prep"
    cmd = [
        sys.executable,
        "-m",
        "functitan.cli",
        "data",
        "prepare",
        *map(str, corpus),
        "--out",
        str(out),
        "--workers",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "13 documents" in r.stdout and "7 shards (uint16)" in r.stdout
    first = json.loads((out / INDEX).read_text())
    # an interrupted run: no index yet and one file unfinished; the rerun redoes only that file
    (out / INDEX).unlink()
    (out / "parts" / "000003.json").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()}
    prepare(corpus, out, workers=1, progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()}
    assert sorted(n for n in after if after[n] != before[n]) == ["000003-0000.bin", "000003-0000.idx"]
    again = json.loads((out / INDEX).read_text())
    assert [s["hash"] for s in again["shards"]] == [s["hash"] for s in first["shards"]]


def test_bad_sources_are_named_errors(tmp_path: Path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "binary.txt").write_bytes(b"ok \xff\xfe more")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xc3("}\n')
    cases = {
        "empty.txt": r"empty.txt is empty \(0 bytes\); remove it",
        "blank.jsonl": r"blank.jsonl holds no documents",
        "binary.txt": r"binary.txt: byte 0xff at offset 3 is not UTF-8; it is not a text file",
        "bad.jsonl": r"bad.jsonl, line 2: byte 0xc3 is not UTF-8",
    }
    for name, pattern in cases.items():
        with pytest.raises(DataError, match=pattern):
            prepare([tmp_path / name], tmp_path / f"out-{name}", workers=1, progress=False)
    # from the command line: one line, exit code 2
    r = cli("data", "prepare", str(tmp_path / "binary.txt"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]  # after the progress bar
    assert last.startswith("functitan: error: ") and "binary.txt: byte 0xff at offset 3 is not UTF-8" in last


def _word_tokenizer(path: Path, words: list[str]) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_changed_shards_and_another_tokenizer_are_detected(corpus: list[Path], tmp_path: Path):
    out = tmp_path / "prep"
    prepare(corpus, out, workers=1, progress=False)
    shard = out / "shards" / "000002-0000.bin"
    # touched, same content: the hash is compared and matches
    os.utime(shard, ns=(1, 1))
    ShardSet(out)
    # same size, other content: detected
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"000002-0000.bin was modified .*re-run it"):
        ShardSet(out)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=r"000002-0000.bin is missing: the shards changed since"):
        build_loader(DataConfig(path=str(out)), batch_size=1, seq_len=4)
    # a tokenizer other than the one the shards were made with
    words = _word_tokenizer(tmp_path / "tokenizer.json", ["document", "line"])
    with pytest.raises(
        ValueError,
        match=r"data.tokenizer .*tokenizer.json .* differs from the tokenizer the shards .* "
        r"were made with, the byte tokenizer",
    ):
        ShardSet(out, tokenizer=words)
    with pytest.raises(ValueError, match=r"data.path=.*prep"):
        build_loader(DataConfig(paths=(str(out),)), batch_size=1, seq_len=4)


def test_tokenizer_file_is_recorded_and_reused(corpus: list[Path], tmp_path: Path):
    words = _word_tokenizer(tmp_path / "tokenizer.json", ["document", "line", "xyz"])
    prepare(corpus, tmp_path / "prep", tokenizer=words, workers=1, progress=False)
    index = json.loads((tmp_path / "prep" / INDEX).read_text())
    assert index["tokenizer"] == {
        "kind": "file",
        "vocab_size": 5,
        "bos_id": 1,
        "eos_id": 1,
        "path": str(words.resolve()),
        "hash": file_hash(words),
    }
    loader = build_loader(DataConfig(path=str(tmp_path / "prep")), batch_size=1, seq_len=4)  # the recorded tokenizer
    assert loader.tokenizer.vocab_size == 5 and tokenizer_identity(loader.tokenizer, words) == index["tokenizer"]


def test_parquet_and_datasets_directories(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"row {i} " + "abc" * i for i in range(9)]
    pq.write_table(pa.table({"text": texts[:5], "n": list(range(5))}), tmp_path / "a.parquet", row_group_size=2)
    jsonl = _write(tmp_path / "ref.jsonl", "\n".join(json.dumps({"text": t}) for t in texts[:5]))
    want = prepare([jsonl], tmp_path / "ref", workers=1, progress=False)
    got = prepare([tmp_path / "a.parquet"], tmp_path / "pq", workers=1, progress=False)
    assert got["shards"][0]["hash"] == want["shards"][0]["hash"] and got["documents"] == 5
    with pytest.raises(DataError, match=r"a.parquet: no column 'body' \(columns: \['text', 'n'\]\); pass --text-key"):
        prepare([tmp_path / "a.parquet"], tmp_path / "pq2", text_key="body", workers=1, progress=False)
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": texts[:5]}),
            "test": datasets.Dataset.from_dict({"text": texts[5:]}),
        }
    )
    ds.save_to_disk(str(tmp_path / "hf"))
    got = prepare([tmp_path / "hf"], tmp_path / "hfprep", workers=1, progress=False)
    assert got["documents"] == 5  # the train split alone: tests/test_data_prepare.py checks the CLI's split
    assert got["tokens"] == sum(len(ByteTokenizer().encode(t)) for t in texts[:5])


def _documents_of(out: Path) -> list[str]:
    """Every document of a prepared folder, decoded (byte tokenizer)."""
    shards, tok, docs = ShardSet(out), ByteTokenizer(), []
    for i in range(len(shards)):
        tokens, starts = shards.get(i)
        docs += [tok.decode(tokens[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]
    return docs


def test_a_datasetdicts_splits_are_prepared_apart_and_no_test_document_reaches_the_training_shards(tmp_path, capsys):
    # `data prepare` of a saved DatasetDict merged its test split into the training shards without a word
    datasets = pytest.importorskip("datasets")
    from functitan.cli import main

    train = [f"train document {i} " + "ab" * i for i in range(6)]
    test = [f"held-out document {i} " + "cd" * i for i in range(3)]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": train}), "test": datasets.Dataset.from_dict({"text": test})}
    ).save_to_disk(str(tmp_path / "hf"))
    assert main(["data", "prepare", str(tmp_path / "hf"), "--out", str(tmp_path / "train"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"split 'train' of {tmp_path / 'hf'}; left out test (prepare one with --split test" in out, out
    assert sorted(_documents_of(tmp_path / "train")) == sorted(train)
    argv = [
        "data",
        "prepare",
        str(tmp_path / "hf"),
        "--split",
        "test",
        "--out",
        str(tmp_path / "test"),
        "--no-progress",
    ]
    assert main(argv) == 0
    assert sorted(_documents_of(tmp_path / "test")) == sorted(test)
    capsys.readouterr()
    assert main(["data", "prepare", str(tmp_path / "hf"), "--split", "validation", "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"functitan: error: {tmp_path / 'hf'}: a DatasetDict with the splits ['train', 'test'], none named "
        "'validation'; pass --split NAME (one of them)"
    ), err


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sparse_shards(out: Path, n_shards: int, shard_tokens: int, doc_tokens: int) -> None:
    """A prepared directory of ``n_shards`` sparse (all-zero) shards, written in milliseconds."""
    (out / "shards").mkdir(parents=True)
    shards = []
    for i in range(n_shards):
        name = f"{i:06d}-0000"
        with open(out / "shards" / f"{name}.bin", "wb") as f:
            f.truncate(shard_tokens * 2)
        np.arange(0, shard_tokens + 1, doc_tokens, dtype=np.int64).tofile(out / "shards" / f"{name}.idx")
        rec = {"name": name, "tokens": shard_tokens, "docs": shard_tokens // doc_tokens}
        for ext, prefix in ((".bin", ""), (".idx", "idx_")):
            st = (out / "shards" / f"{name}{ext}").stat()
            rec |= {f"{prefix}bytes": st.st_size, f"{prefix}mtime_ns": st.st_mtime_ns, f"{prefix}hash": "-"}
        shards.append(rec)
    index = {
        "format": FORMAT,
        "tokenizer": tokenizer_identity(ByteTokenizer(), None),
        "dtype": "uint16",
        "text_key": "text",
        "shard_tokens": shard_tokens,
        "sources": [],
        "shards": shards,
    }
    (out / INDEX).write_text(json.dumps(index))


def test_resident_memory_stays_bounded_on_a_multi_gb_corpus(tmp_path: Path):
    # 4 GiB of uint16 tokens (2 Gi tokens) in 128 shards of 32 MiB; 4 shards kept mapped at most
    shard_tokens, n_shards, max_open = 16 << 20, 128, 4
    _sparse_shards(tmp_path / "big", n_shards, shard_tokens, doc_tokens=1 << 14)
    loader = build_loader(DataConfig(path=str(tmp_path / "big"), max_open_shards=max_open), batch_size=16, seq_len=8191)
    state = loader.init_state()
    loader.next(state)  # imports, first allocations
    base = _rss_bytes()
    # jump through the whole epoch (a resume at any point reads no earlier shard) ...
    n = loader.sequences_per_epoch
    for k in range(0, n, n // 64):
        loader.next({"epoch": 0, "seq": k})
    # ... and read 12 shards' worth (384 MiB) in a row
    state = {"epoch": 0, "seq": n // 2}
    for _ in range(12 * shard_tokens // (16 * 8192)):
        batch, state = loader.next(state)
    assert set(batch["inputs"].unique().tolist()) == {0, ByteTokenizer.eos_id}  # zeros, and EOS between documents
    growth = _rss_bytes() - base
    bound = max_open * shard_tokens * 2 + (32 << 20)  # the mapped shards + 32 MiB for batches and indices
    assert growth < bound, f"RSS grew by {growth >> 20} MiB, bound {bound >> 20} MiB"


def _train_losses(overrides: dict) -> list[float]:
    from support import train_small

    return train_small(overrides)[0]


def test_training_on_prepared_shards_equals_training_on_the_files(corpus: list[Path], tmp_path: Path, gloo):

    prepare(corpus, tmp_path / "prep", workers=1, progress=False)  # one shard per file: the same stream
    common = {"training.steps": 2, "metrics.run_dir": str(tmp_path)}
    raw = gloo.run(_train_losses, 1, {**common, "data.paths": ",".join(map(str, corpus)), "metrics.run_name": "raw"})[0]
    shards = gloo.run(_train_losses, 1, {**common, "data.path": str(tmp_path / "prep"), "metrics.run_name": "sh"})[0]
    assert len(shards) == 2 and shards == raw
