"""Predicted vs measured step time of >= 8 layouts on 4 gloo processes (same model), and what the planner's
recommendation costs against the best layout measured.

    PYTHONPATH=. python benchmarks/plan_vs_measured.py [--steps 3] [--dim 256]

Predictions: ``functitan.plan`` with this machine calibrated (``--calibrate``: 4 concurrent processes' matmul
rate and gloo all-reduce alpha-beta). Measurements: the trainer's own step (``plan.build_step``, real tensors)
on 4 gloo processes, median step time after one warm-up step, all layouts in one launch. Writes
benchmarks/results/plan_vs_measured.json: per layout predicted and measured seconds, the Spearman rank
correlation, and recommended-measured / best-measured (target <= 1.10). CPU timings on a shared machine are
noisy: the ratio compares layouts measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from functitan.job_config import JobConfig, ModelConfig
from functitan.plan import Candidate, Cluster, calibrate, device, job_config, model_shape, predict
from functitan.plan._cost import step_time
from functitan.testing import run_distributed

WORLD, SEQ, BATCH = 4, 128, 8

LAYOUTS = [
    Candidate(dp_shard=4, param_dtype="float32"),
    Candidate(dp_shard=4, remat="full", param_dtype="float32"),
    Candidate(dp_replicate=4, param_dtype="float32"),
    Candidate(dp_replicate=2, dp_shard=2, param_dtype="float32"),
    Candidate(tp=4, param_dtype="float32"),
    Candidate(dp_shard=2, tp=2, param_dtype="float32"),
    Candidate(dp_shard=2, pp=2, schedule="1f1b", microbatches=2, param_dtype="float32"),
    Candidate(dp_shard=2, pp=2, schedule="zb_v", stages_per_rank=2, microbatches=4, param_dtype="float32"),
]


def _model(dims):
    from functitan.model import load_model

    model = load_model("llama")
    return model, model.config("debug", **dims)


def _base(dims) -> JobConfig:
    return JobConfig(model=ModelConfig(name="llama", flavor="debug", overrides=dims))


def _measure(layouts, dims, steps):
    import torch.distributed as dist

    from functitan.mesh import make_mesh
    from functitan.plan import build_step

    model, mcfg = _model(dims)
    out = []
    for c in layouts:
        cfg = job_config(_base(dims), c, batch_size=BATCH, seq_len=SEQ)
        mesh = make_mesh(dp_replicate=c.dp_replicate, dp_shard=c.dp_shard, tp=c.tp, pp=c.pp, device="cpu")
        state, step, batch = build_step(cfg, model, mcfg, mesh, fake=False)
        state, _ = step(state, batch)  # warm-up
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            state, _ = step(state, batch)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def _ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    for pos, i in enumerate(order):
        r[i] = float(pos)
    return r


def spearman(a, b) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    dims = {"dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 3 * args.dim}
    t0 = time.perf_counter()
    dev = calibrate(device("cpu"), processes=WORLD)
    cluster = Cluster(device=dev, nodes=1, per_node=WORLD)
    model, mcfg = _model(dims)
    shape = model_shape(model, mcfg, SEQ)
    fpt = model.flops_per_token(mcfg, SEQ)
    predicted = []
    for c in LAYOUTS:
        p = predict(_base(dims), model, mcfg, shape, c, batch_size=BATCH, seq_len=SEQ)
        predicted.append(
            step_time(c, cluster, p.comm, flops_per_token=fpt, tokens=BATCH * SEQ, n_blocks=p.blocks).total
        )
    t_plan = time.perf_counter() - t0
    measured = run_distributed(_measure, WORLD, LAYOUTS, dims, args.steps, timeout=3000)[0]
    rec = min(range(len(LAYOUTS)), key=lambda i: predicted[i])
    result = {
        "world": WORLD,
        "model": dims,
        "seq_len": SEQ,
        "batch_size": BATCH,
        "steps": args.steps,
        "device": dev.source,
        "plan_seconds": t_plan,
        "layouts": [
            {"layout": c.label(), "predicted_s": p, "measured_s": m} for c, p, m in zip(LAYOUTS, predicted, measured)
        ],
        "spearman": spearman(predicted, measured),
        "recommended": LAYOUTS[rec].label(),
        "recommended_over_best_measured": measured[rec] / min(measured),
        "target": "recommended_over_best_measured <= 1.10",
    }
    out = Path(__file__).parent / "results" / "plan_vs_measured.json"
    out.write_text(json.dumps(result, indent=2))
    for row in result["layouts"]:
        print(f"{row['layout']:<44} predicted {row['predicted_s']:.4f} s  measured {row['measured_s']:.4f} s")
    print(
        f"spearman {result['spearman']:.3f}; recommended {result['recommended']}: "
        f"{result['recommended_over_best_measured']:.3f} x the best measured; wrote {out}"
    )


if __name__ == "__main__":
    main()
