"""Evaluation during training (``[eval]``): held-out documents never trained on, the loss over them exact under
every layout, refused by name when it cannot be computed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import SMALL, cli

from functitan.config import apply_overrides
from functitan.data import ByteTokenizer, TokenLoader, build_loader
from functitan.job_config import JobConfig
from functitan.model import load_model
from functitan.train import run

ASSET = str(Path(__file__).parent / "assets" / "objectives_models.py")  # TokenLoss over a 15% mask of the tokens
EVAL = {"eval.every": 2, "eval.holdout": 0.2, "eval.batches": 2, "training.steps": 4}
MLM = {
    "model.name": ASSET,
    "model.flavor": "mlm",
    "training.steps": 4,
    "training.batch_size": 4,
    "training.seq_len": 32,
    "optimizer.lr": 1e-2,
    "optimizer.eps": 1e-6,
    "metrics.log_every": 1,
    "data.max_corpus_bytes": 200_000,
}
# (name, base config, layout) at world 2: each splits the evaluated batch its own way
CASES = [
    ("llama_fsdp2_mb2", SMALL, {"parallelism.dp_shard": 2, "training.microbatches": 2}),
    ("llama_tp2_sp", SMALL, {"parallelism.dp_shard": 1, "parallelism.tp": 2}),
    ("llama_pp2", SMALL, {"parallelism.dp_shard": 1, "parallelism.pp": 2, "training.microbatches": 2}),
    ("mlm_ddp2", MLM, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1}),
    ("mlm_tp2_sp", MLM, {"parallelism.dp_shard": 1, "parallelism.tp": 2}),
]


def _records(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def _train(cases: list, run_dir: str) -> dict:
    """Every case trained with [eval]: rank 0's records with an eval/loss ({} on other ranks)."""
    out = {}
    for name, base, layout in cases:
        cfg = apply_overrides(
            JobConfig(), {**base, **EVAL, **layout, "metrics.run_dir": run_dir, "metrics.run_name": name}
        )
        summary = run(cfg)
        if torch.distributed.get_rank() == 0:
            out[name] = [r for r in _records(summary["run_dir"]) if "eval/loss" in r]
    return out


def _by_hand(cfg_overrides: dict, run_dir: str) -> tuple[list[dict], float]:
    """One process: the run's eval records, and the last eval's loss recomputed from the final params over the
    held-out batches (a TokenLoss's sums over its counts; a mean loss's mean)."""
    cfg = apply_overrides(
        JobConfig(), {**cfg_overrides, **EVAL, "metrics.run_dir": run_dir, "metrics.run_name": "hand"}
    )
    summary = run(cfg)
    model = load_model(cfg.model.name or "llama")
    loader = build_loader(
        cfg.data, batch_size=cfg.training.batch_size, seq_len=cfg.training.seq_len, holdout=0.2, held_out=True
    )
    model_cfg = model.config(cfg.model.flavor or "debug", **cfg.model.overrides, vocab_size=loader.tokenizer.vocab_size)
    params = summary["state"].params
    state, sums, counts = loader.init_state(), [], []
    with torch.no_grad():
        for _ in range(cfg.eval.batches):
            batch, state = loader.next(state)
            value = model.loss(params, batch, model_cfg)
            value = value[0] if isinstance(value, tuple) and not hasattr(value, "count") else value
            if hasattr(value, "count"):
                sums.append(float(value.sum))
                counts.append(float(value.count))
            else:
                sums.append(float(value))
    want = sum(sums) / sum(counts) if counts else sum(sums) / len(sums)
    return [r for r in _records(summary["run_dir"]) if "eval/loss" in r], want


def test_eval_loss_is_the_loss_over_the_held_out_batches_and_exact_under_fsdp_tp_sp_pp(gloo, tmp_path):
    """FSDP 2 x 2 microbatches, TP 2 + SP, PP 2 (1F1B) on llama's mean loss, and DDP 2 and TP 2 + SP on a
    TokenLoss over a 15% mask (a count that varies by row): eval/loss at steps 2 and 4 equals one process's
    within 1e-5, and one process's last one is the loss over the held-out batches with the final params."""
    pending = gloo.submit(_train, 2, CASES, str(tmp_path / "two"))
    refs = {
        base_name: gloo.run(_by_hand, 1, base, str(tmp_path / base_name))[0]
        for base_name, base in (("llama", SMALL), ("mlm", MLM))
    }
    for records, want in refs.values():
        assert [r["step"] for r in records] == [2, 4]
        assert records[-1]["eval/loss"] == pytest.approx(want, abs=1e-5)
        assert all(r["eval/perplexity"] == pytest.approx(torch.tensor(r["eval/loss"]).exp().item()) for r in records)
        assert records[1]["eval/loss"] < records[0]["eval/loss"]  # it learns, on documents it never saw
    got = pending()[0]
    failures = []
    for name, *_ in CASES:
        ref = refs[name.split("_")[0]][0]
        for mine, one in zip(got[name], ref, strict=True):
            if abs(mine["eval/loss"] - one["eval/loss"]) > 1e-5:
                failures.append(
                    f"{name} step {mine['step']}: eval/loss {mine['eval/loss']:.7f}, one process {one['eval/loss']:.7f}"
                )
    assert not failures, "\n".join(failures)


def _documents(loader: TokenLoader, epoch: int = 0) -> list[tuple[int, ...]]:
    """The documents one epoch of ``loader`` streams (split at EOS), in order."""
    n = loader.sequences_per_epoch
    state, tokens = {"epoch": epoch, "seq": 0}, []
    for _ in range(n // loader.batch_size):
        batch, state = loader.next(state)
        tokens += torch.cat([batch["inputs"], batch["targets"][:, -1:]], 1).flatten().tolist()
    docs, doc = [], []
    for t in tokens:
        if t == loader.tokenizer.eos_id:
            docs.append(tuple(doc))
            doc = []
        else:
            doc.append(t)
    return docs  # the stream starts with a whole document; the tail after the last EOS is left out


def test_the_holdout_keeps_each_document_on_one_side_whatever_the_seed_or_epoch(tmp_path):
    """A document is held out or trained on for good: the two sides share none, cover every document but the
    few an epoch's tail cuts, hold out about the share asked, and neither the shuffle seed nor the epoch moves
    a document across."""
    corpus = tmp_path / "docs.jsonl"
    texts = [f"document number {i:04d} " + "x" * (i % 7) for i in range(400)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    kw = dict(batch_size=1, seq_len=15, holdout=0.25)
    train = set(_documents(TokenLoader([corpus], **kw)))
    held = set(_documents(TokenLoader([corpus], held_out=True, **kw)))
    assert not train & held
    assert len(train | held) >= 396 and 0.18 < len(held) / 400 < 0.32, (len(train), len(held))
    for other in (dict(seed=7), dict(epoch=1)):  # another order, and so another tail cut: the same sides
        seed = other.get("seed", 0)
        assert not set(_documents(TokenLoader([corpus], seed=seed, **kw), other.get("epoch", 0))) & held
        assert not set(_documents(TokenLoader([corpus], held_out=True, seed=seed, **kw), other.get("epoch", 0))) & train
    assert train | held <= {tuple(ByteTokenizer().encode(t)) for t in texts}


def test_eval_through_the_cli_writes_eval_loss_in_the_log_and_the_console(tmp_path, monkeypatch):
    """``functitan train --eval.every=2 --eval.holdout=0.2`` as typed: the training loader leaves the held-out
    documents out, the eval steps' records carry eval/loss and eval/perplexity (written whatever
    metrics.log_every), and the console line shows "eval"."""
    import functitan.train as trainer

    loaders = []
    monkeypatch.setattr(trainer, "build_loader", lambda *a, **kw: loaders.append(build_loader(*a, **kw)) or loaders[-1])
    flags = [f"--{k}={v}" for k, v in {**SMALL, **EVAL, "metrics.log_every": 3}.items()]
    out = cli("train", *flags, f"--metrics.run_dir={tmp_path}", "--metrics.run_name=cli")
    assert out.returncode == 0, out.stderr
    assert [(x.holdout, x.held_out) for x in loaders] == [(0.2, False)]  # the trainer's: the other side
    records = _records(str(tmp_path / "cli"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # 1 and 3: log_every=3 and the first; 2 and 4: eval
    assert ["eval/loss" in r for r in records] == [False, True, False, True]
    assert [line.count("| eval ") for line in out.stdout.splitlines() if line.startswith("step ")] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval.every=2"], "functitan: error: eval.every=2: evaluation needs tokens never trained on: add "),
        (["--eval.holdout=0.1", "--eval.paths=a.txt"], "eval.holdout=0.1: give one source of evaluation data, not "),
        (
            ["--eval.every=2", "--eval.holdout=0.002", "--eval.batches=50"],
            "functitan: error: eval.batches=50: eval.holdout=0.002 holds fewer than 400 sequences of ",
        ),
    ],
)
def test_eval_that_cannot_be_computed_is_one_line_before_step_1(tmp_path, flags, message):
    out = cli(
        "train", "--training.batch_size=8", "--data.max_corpus_bytes=100000", f"--metrics.run_dir={tmp_path}", *flags
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("functitan: error: ") and message.removeprefix("functitan: error: ") in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))  # nothing trained


def test_eval_on_prepared_shards_and_text_files_and_a_foreign_tokenizer_refused(tmp_path):
    """``--eval.path`` (a ``data prepare --split validation`` folder) and ``--eval.paths`` (text) evaluate the
    same documents alike; shards made with another tokenizer than training's are one line naming both."""
    from functitan.data import prepare

    tokenizers = pytest.importorskip("tokenizers")
    held = tmp_path / "validation.jsonl"
    held.write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) + "\n" for i in range(300))
    )
    prepare([held], tmp_path / "shards", workers=1, progress=False)
    vocab = {"[UNK]": 0, "</s>": 1, "def": 2, "return": 3}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    prepare([held], tmp_path / "word_shards", tokenizer=tmp_path / "words.json", workers=1, progress=False)

    flags = [f"--{k}={v}" for k, v in {**SMALL, "training.steps": 2, "eval.every": 2}.items()]
    losses = []
    for source in (f"--eval.path={tmp_path / 'shards'}", f"--eval.paths={held}"):
        out = cli("train", *flags, source, f"--metrics.run_dir={tmp_path}", f"--metrics.run_name=r{len(losses)}")
        assert out.returncode == 0, out.stderr
        losses.append(_records(str(tmp_path / f"r{len(losses)}"))[-1]["eval/loss"])
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) and 0 < losses[0] < 10

    out = cli("train", *flags, f"--eval.path={tmp_path / 'word_shards'}", f"--metrics.run_dir={tmp_path}")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert (
        f"eval.path={tmp_path / 'word_shards'} was tokenized with {tmp_path / 'words.json'} (vocab 4), training "
        in out.stderr
    )
    assert (
        "with the byte tokenizer; prepare it with the training tokenizer (functitan data prepare ... without "
        in out.stderr
    )
