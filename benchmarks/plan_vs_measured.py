"""Predicted vs measured step time of >= 8 layouts on 4 gloo processes (same model), and what the planner's
recommendation costs against the best layout measured.

    PYTHONPATH=. python -m benchmarks.plan_vs_measured [--runs 3] [--steps 3] [--dim 128]

Predictions: ``functitan.plan`` with this machine calibrated (``--calibrate``: the matmul rate and host time
per op of 4 concurrent processes, gloo all-reduce alpha-beta, processes per core). Measurements: the trainer's
own step (``plan.build_step``, real tensors) on 4 gloo processes; every layout is built up front and stepped in
alternating rounds (drift on the shared machine falls on all alike), each step timed between barriers; after
the warm-up rounds, ``--runs`` runs of ``--steps`` rounds; a layout's time is the median over runs of its
per-run median. Writes benchmarks/results/plan_vs_measured.json: per layout predicted and measured seconds
(and per run), the Spearman rank correlation, and recommended-measured / best-measured (target <= 1.10),
overall and per run.
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


def _measure(layouts, dims, warmup, runs, steps):
    """Per layout, ``runs`` lists of ``steps`` step times. All layouts are built up front and stepped in
    alternating rounds (A B C, C B A, ...), so drift on the shared machine falls on every layout alike; a step
    is timed between barriers (the slowest rank's time)."""
    import torch.distributed as dist

    from functitan.mesh import make_mesh
    from functitan.plan import build_step

    model, mcfg = _model(dims)
    built = []
    for c in layouts:
        cfg = job_config(_base(dims), c, batch_size=BATCH, seq_len=SEQ)
        mesh = make_mesh(dp_replicate=c.dp_replicate, dp_shard=c.dp_shard, tp=c.tp, pp=c.pp, device="cpu")
        built.append(list(build_step(cfg, model, mcfg, mesh, fake=False)))
    times: list[list[float]] = [[] for _ in layouts]
    order = list(range(len(layouts)))
    for r in range(warmup + runs * steps):
        for i in order if r % 2 == 0 else reversed(order):
            state, step, batch = built[i]
            dist.barrier()
            t0 = time.perf_counter()
            state, _ = step(state, batch)
            dist.barrier()
            built[i][0] = state
            if r >= warmup:
                times[i].append(time.perf_counter() - t0)
    return [[t[k * steps : (k + 1) * steps] for k in range(runs)] for t in times]


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


def _predict(dims):
    """Seconds per step of every layout, by the planner with this machine calibrated; the device's source line."""
    dev = calibrate(device("cpu"), processes=WORLD)
    cluster = Cluster(device=dev, nodes=1, per_node=WORLD)
    model, mcfg = _model(dims)
    shape = model_shape(model, mcfg, SEQ)
    fpt = model.flops_per_token(mcfg, SEQ)
    predicted = []
    for c in LAYOUTS:
        p = predict(_base(dims), model, mcfg, shape, c, batch_size=BATCH, seq_len=SEQ, backend="gloo")
        t = step_time(c, cluster, p.comm, flops_per_token=fpt, tokens=BATCH * SEQ, n_blocks=p.blocks, ops=p.ops)
        predicted.append(t.total)
    return predicted, dev.source


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds (every layout once per round)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed rounds per run")
    ap.add_argument(
        "--reuse-measured", action="store_true", help="predict again, keep the measured times of the last result"
    )
    args = ap.parse_args()
    dims = {"dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 3 * args.dim}
    out = Path(__file__).parent / "results" / "plan_vs_measured.json"
    t0 = time.perf_counter()
    predicted, source = _predict(dims)
    t_plan = time.perf_counter() - t0
    if args.reuse_measured:
        old = json.loads(out.read_text())
        per_run = [row["measured_runs_s"] for row in old["layouts"]]
        args.runs, args.steps, args.warmup = old["runs"], old["steps"], old["warmup"]
    else:
        raw = run_distributed(_measure, WORLD, LAYOUTS, dims, args.warmup, args.runs, args.steps, timeout=3000)[0]
        per_run = [[statistics.median(run) for run in layout] for layout in raw]
    measured = [statistics.median(runs) for runs in per_run]
    rec = min(range(len(LAYOUTS)), key=lambda i: predicted[i])
    run_ratios = [per_run[rec][k] / min(layout[k] for layout in per_run) for k in range(args.runs)]
    result = {
        "world": WORLD,
        "model": dims,
        "seq_len": SEQ,
        "batch_size": BATCH,
        "warmup": args.warmup,
        "runs": args.runs,
        "steps": args.steps,
        "device": source,
        "plan_seconds": t_plan,
        "layouts": [
            {"layout": c.label(), "predicted_s": p, "measured_s": m, "measured_runs_s": r}
            for c, p, m, r in zip(LAYOUTS, predicted, measured, per_run)
        ],
        "spearman": spearman(predicted, measured),
        "recommended": LAYOUTS[rec].label(),
        "recommended_over_best_measured": measured[rec] / min(measured),
        "recommended_over_best_measured_runs": run_ratios,
        "target": "recommended_over_best_measured <= 1.10",
    }
    out.write_text(json.dumps(result, indent=2))
    for row in result["layouts"]:
        runs = " ".join(f"{x:.4f}" for x in row["measured_runs_s"])
        print(f"{row['layout']:<40} predicted {row['predicted_s']:.4f} s  measured {row['measured_s']:.4f} s ({runs})")
    print(
        f"spearman {result['spearman']:.3f}; recommended {result['recommended']}: "
        f"{result['recommended_over_best_measured']:.3f} x the best measured "
        f"(per run {', '.join(f'{x:.3f}' for x in run_ratios)}); wrote {out}"
    )


if __name__ == "__main__":
    main()
