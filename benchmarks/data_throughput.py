"""The shard loader's tokens/s against what a training step consumes, and its resident memory on a big corpus.

1. ``functitan data prepare`` on ~``--mb`` MB of text (the default corpus, repeated), 2 workers: its rate.
2. The loader over those shards at the batch shape of the debug model (8 x 256, configs/debug.toml) and of
   a 1B-shaped model (llama3_1b, 8 x 2048 sequences per rank): tokens/s of ``loader.next``, with the
   step's consumption beside it:
   - debug: measured, the trainer's real step on this CPU (``functitan.train.run``, a few steps);
   - 1B: estimated from FLOPs (running it here is too slow): PaLM's training FLOPs per token
     (``metrics.transformer_flops_per_token``) at 50% MFU of one H100's dense bf16 peak (989 TFLOP/s),
     the most a single accelerator of today would ask of one loader process. The debug model gets the
     same estimate too, for reference (a 3M model is launch-bound on a GPU, so it overstates).
3. RSS growth of the loader walking a 4 GiB sparse corpus (128 shards of 32 MiB, 4 kept mapped).

Writes benchmarks/results/data_throughput.json.

    python benchmarks/data_throughput.py [--mb 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from functitan import metrics as M  # noqa: E402
from functitan.data import DataConfig, ShardSet, TokenLoader, build_loader, default_corpus, prepare  # noqa: E402

H100_BF16_DENSE = 989e12
MFU = 0.5


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _make_text(root: Path, mb: float) -> list[Path]:
    files = [f for f in default_corpus() if f.stat().st_size > 0]  # prepare rejects empty files
    out, total, i = [], 0, 0
    while total < mb * 1e6:
        src = files[i % len(files)]
        dst = root / f"t{i:05d}.txt"
        shutil.copyfile(src, dst)
        total += dst.stat().st_size
        out.append(dst)
        i += 1
    return out


def _loader_rate(shards: ShardSet, batch: int, seq: int, seconds: float = 3.0) -> float:
    loader = TokenLoader(shards=shards, batch_size=batch, seq_len=seq)
    state = loader.init_state()
    loader.next(state)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _, state = loader.next(state)
        n += 1
    return n * batch * seq / (time.perf_counter() - t0)


def _step_rate_debug(shard_dir: str, run_dir: str) -> float:
    """Tokens/s of the trainer's real step for the debug model on this CPU (steps 2..6, after compile/warmup)."""
    import torch.distributed as dist

    from functitan.config import apply_overrides
    from functitan.job_config import JobConfig
    from functitan.train import run

    cfg = apply_overrides(
        JobConfig(),
        {
            "training.steps": 6,
            "training.batch_size": 8,
            "training.seq_len": 256,
            "data.path": shard_dir,
            "metrics.run_dir": run_dir,
            "metrics.run_name": "d",
            "metrics.log_every": 1,
            "training.device": "cpu",
        },
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    try:
        run(cfg)
    finally:
        dist.destroy_process_group()
    rows = [json.loads(line) for line in open(f"{run_dir}/d/metrics.jsonl")]
    walls = [r["tokens_per_s"] for r in rows[2:] if "tokens_per_s" in r]
    return sum(walls) / len(walls) if walls else float("nan")


def _flops_rate(flavor: str, seq: int) -> float:
    from models import llama

    cfg = llama.config(flavor)
    fpt = M.transformer_flops_per_token(
        n_params=llama.num_params(cfg, embedding=False),
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        seq_len=seq,
    )
    return H100_BF16_DENSE * MFU / fpt


def _rss_growth(root: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_data_prepare import _sparse_shards

    shard_tokens, n_shards, max_open = 16 << 20, 128, 4
    _sparse_shards(root / "big", n_shards, shard_tokens, doc_tokens=1 << 14)
    loader = build_loader(DataConfig(path=str(root / "big"), max_open_shards=max_open), batch_size=16, seq_len=8191)
    loader.next(loader.init_state())
    base = _rss()
    n = loader.sequences_per_epoch
    state, peak, t0, steps = {"epoch": 0, "seq": 0}, base, time.perf_counter(), 0
    while state["epoch"] == 0 and state["seq"] < n // 4:  # a quarter of the corpus: 1 GiB read
        _, state = loader.next(state)
        peak, steps = max(peak, _rss()), steps + 1
    return {
        "corpus_GiB": n_shards * shard_tokens * 2 / 2**30,
        "read_GiB": steps * 16 * 8192 * 2 / 2**30,
        "max_open_shards": max_open,
        "shard_MiB": shard_tokens * 2 / 2**20,
        "rss_growth_MiB": round((peak - base) / 2**20, 1),
        "bound_MiB": max_open * shard_tokens * 2 / 2**20 + 32,
        "tokens_per_s_sequential": round(steps * 16 * 8191 / (time.perf_counter() - t0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=64.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="functitan-data-bench-"))
    try:
        (root / "text").mkdir()
        files = _make_text(root / "text", args.mb)
        t0 = time.perf_counter()
        index = prepare(files, root / "prep", workers=2, progress=False)
        prep_s = time.perf_counter() - t0
        shards = ShardSet(root / "prep")
        res: dict = {
            "prepare": {
                "source_MB": round(sum(f.stat().st_size for f in files) / 1e6, 1),
                "tokens": index["tokens"],
                "workers": 2,
                "seconds": round(prep_s, 2),
                "tokens_per_s": round(index["tokens"] / prep_s),
            },
            "models": {},
        }
        for name, flavor, batch, seq in (("debug", "debug", 8, 256), ("llama3_1b", "llama3_1b", 8, 2048)):
            rate = _loader_rate(shards, batch, seq)
            need = _flops_rate(flavor, seq)
            res["models"][name] = {
                "batch_per_rank": batch,
                "seq_len": seq,
                "loader_tokens_per_s": round(rate),
                "step_tokens_per_s_flops_estimate_h100_mfu50": round(need),
                "loader_over_step_flops_estimate": round(rate / need, 2),
            }
        measured = _step_rate_debug(str(root / "prep"), str(root / "runs"))
        res["models"]["debug"]["step_tokens_per_s_measured_cpu"] = round(measured)
        res["models"]["debug"]["loader_over_step_measured_cpu"] = round(
            res["models"]["debug"]["loader_tokens_per_s"] / measured, 1
        )
        res["rss"] = _rss_growth(root)
        res["note"] = (
            "2 shared, busy CPU cores: rates are noisy. 1B step consumption is a FLOPs estimate (989 TFLOP/s "
            "bf16 at 50% MFU on one GPU), not a measurement; the debug model's is measured on this CPU."
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/data_throughput.json", "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
