"""Predicted vs measured step time of 8 layouts on 4 gloo processes, for three model families (Llama, GPT-2,
Qwen3, each its debug flavor at dim 128 and 4 blocks), and what the planner's recommendation costs against the
best layout measured.

    PYTHONPATH=. python -m benchmarks.plan_vs_measured [--runs 3] [--steps 5] [--dim 128] [--families llama gpt2]

Predictions: ``functitan.plan`` with this machine calibrated once for all families (the matmul rate and host
time per op of 4 concurrent processes, gloo all-reduce alpha-beta, processes per core). A layout the planner
rejects for a family is dropped for that family, with the reason. Measurements: per family, in fresh
processes, the trainer's own step (``plan.build_step``, real tensors) on 4 gloo processes; every layout is
built up front and stepped in alternating rounds (drift on the shared machine falls on all alike), each step
timed between barriers; after the warm-up rounds, ``--runs`` runs of ``--steps`` rounds; a layout's time is
the median over runs of its per-run median. Writes benchmarks/results/plan_vs_measured.json: per family, per
layout predicted and measured seconds (and per run), the Kendall (tau-b) and Spearman rank correlations,
recommended-measured / best-measured overall and per run, and the 1/5/15-minute load average before and after
its measurement; a top-level summary of kendall, spearman and regret per family. Targets: kendall >= 0.8 and
regret <= 1.05. ``--reuse-measured`` predicts again and keeps the measured times of the last result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

from functitan.job_config import JobConfig, ModelConfig
from functitan.plan import Candidate, Cluster, calibrate, device, job_config, model_shape, predict
from functitan.plan._cost import step_time
from functitan.testing import run_distributed

WORLD, SEQ, BATCH = 4, 128, 8
TARGET = "kendall >= 0.8 and recommended_over_best_measured <= 1.05"

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


def family_dims(name: str, dim: int, layers: int) -> dict:
    """Overrides of each family's debug flavor to comparable small models: dim, 4 blocks, 8 heads (4 kv heads
    where the family has GQA), untied output head (GPT-2 and Qwen3 tie by default; Llama does not)."""
    if name == "llama":
        return {"dim": dim, "n_layers": layers, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 3 * dim}
    if name == "gpt2":  # two MLP matrices, so GPT-2's own 4 * dim
        return {"dim": dim, "n_layers": layers, "n_heads": 8, "ffn_dim": 4 * dim, "tie_embeddings": False}
    if name == "qwen3":  # head_dim is its own field; dim / n_heads keeps it at Llama's
        return {
            "dim": dim,
            "n_layers": layers,
            "n_heads": 8,
            "n_kv_heads": 4,
            "head_dim": dim // 8,
            "ffn_dim": 3 * dim,
            "tie_embeddings": False,
        }
    raise ValueError(f"no dims for family {name!r}; choose llama, gpt2 or qwen3")


def _model(name, dims):
    from functitan.model import load_model

    model = load_model(name)
    return model, model.config("debug", **dims)


def _base(name, dims) -> JobConfig:
    return JobConfig(model=ModelConfig(name=name, flavor="debug", overrides=dims))


def _measure(name, layouts, dims, warmup, runs, steps):
    """Per layout, ``runs`` lists of ``steps`` step times. All layouts are built up front and stepped in
    alternating rounds (A B C, C B A, ...), so drift on the shared machine falls on every layout alike; a step
    is timed between barriers (the slowest rank's time)."""
    import torch.distributed as dist

    from functitan.mesh import make_mesh
    from functitan.plan import build_step

    model, mcfg = _model(name, dims)
    built = []
    for c in layouts:
        cfg = job_config(_base(name, dims), c, batch_size=BATCH, seq_len=SEQ)
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


def kendall(a, b) -> float:
    """Kendall's tau-b: (concordant - discordant) pairs over the pairs untied in each; tau-a without ties."""
    con = dis = tied_a = tied_b = 0
    for i in range(len(a)):
        for j in range(i):
            sa, sb = (a[i] > a[j]) - (a[i] < a[j]), (b[i] > b[j]) - (b[i] < b[j])
            if sa and sb:
                con, dis = con + (sa == sb), dis + (sa != sb)
            else:  # a pair tied in both counts against neither side's denominator
                tied_a, tied_b = tied_a + (not sa and bool(sb)), tied_b + (bool(sa) and not sb)
    return (con - dis) / math.sqrt((con + dis + tied_a) * (con + dis + tied_b))


def _predict(name, dims, cluster):
    """Seconds per step of every layout the planner accepts for this family; the rejected ones with why."""
    model, mcfg = _model(name, dims)
    shape = model_shape(model, mcfg, SEQ)
    fpt = model.flops_per_token(mcfg, SEQ)
    kept, predicted, dropped = [], [], []
    for c in LAYOUTS:
        try:
            p = predict(_base(name, dims), model, mcfg, shape, c, batch_size=BATCH, seq_len=SEQ, backend="gloo")
        except ValueError as e:  # the layout does not fit this family's shapes: measure the rest
            dropped.append({"layout": c.label(), "reason": str(e)})
            continue
        t = step_time(c, cluster, p.comm, flops_per_token=fpt, tokens=BATCH * SEQ, n_blocks=p.blocks, ops=p.ops)
        kept.append(c)
        predicted.append(t.total)
    return kept, predicted, dropped


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _old_measured(old, name, layouts):
    """The last result's per-run times and loads of this family's layouts (``--reuse-measured``)."""
    fam = old["families"][name]
    by_label = {row["layout"]: row["measured_runs_s"] for row in fam["layouts"]}
    return [by_label[c.label()] for c in layouts], fam["load_before"], fam["load_after"]


def _family(name, dims, cluster, args, old):
    """One family's result: predictions, measurements (fresh processes), rank correlations, regret, load."""
    t0 = time.perf_counter()
    layouts, predicted, dropped = _predict(name, dims, cluster)
    t_plan = time.perf_counter() - t0
    if old is not None:
        per_run, load_before, load_after = _old_measured(old, name, layouts)
    else:
        load_before = _load()
        raw = run_distributed(
            _measure, WORLD, name, layouts, dims, args.warmup, args.runs, args.steps, timeout=args.timeout
        )[0]
        load_after = _load()
        per_run = [[statistics.median(run) for run in layout] for layout in raw]
    measured = [statistics.median(runs) for runs in per_run]
    rec = min(range(len(layouts)), key=lambda i: predicted[i])
    n_runs = len(per_run[0])
    run_ratios = [per_run[rec][k] / min(layout[k] for layout in per_run) for k in range(n_runs)]
    return {
        "model": dims,
        "plan_seconds": t_plan,
        "measure_seconds": time.perf_counter() - t0 - t_plan,
        "load_before": load_before,
        "load_after": load_after,
        "layouts": [
            {"layout": c.label(), "predicted_s": p, "measured_s": m, "measured_runs_s": r}
            for c, p, m, r in zip(layouts, predicted, measured, per_run)
        ],
        "dropped": dropped,
        "kendall": kendall(predicted, measured),
        "spearman": spearman(predicted, measured),
        "recommended": layouts[rec].label(),
        "recommended_over_best_measured": measured[rec] / min(measured),
        "recommended_over_best_measured_runs": run_ratios,
    }


def _print(name, fam) -> None:
    print(f"== {name}: load {fam['load_before']} -> {fam['load_after']}")
    for row in fam["layouts"]:
        runs = " ".join(f"{x:.4f}" for x in row["measured_runs_s"])
        print(f"{row['layout']:<40} predicted {row['predicted_s']:.4f} s  measured {row['measured_s']:.4f} s ({runs})")
    for row in fam["dropped"]:
        print(f"{row['layout']:<40} dropped: {row['reason']}")
    ratios = ", ".join(f"{x:.3f}" for x in fam["recommended_over_best_measured_runs"])
    print(
        f"kendall {fam['kendall']:.3f}, spearman {fam['spearman']:.3f}; recommended {fam['recommended']}: "
        f"{fam['recommended_over_best_measured']:.3f} x the best measured (per run {ratios})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=["llama", "gpt2", "qwen3"])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds (every layout once per round)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed rounds per run")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds before one family's measurement is killed")
    ap.add_argument(
        "--reuse-measured", action="store_true", help="predict again, keep the measured times of the last result"
    )
    args = ap.parse_args()
    out = Path(__file__).parent / "results" / "plan_vs_measured.json"
    old = json.loads(out.read_text()) if args.reuse_measured else None
    if old is not None:  # the per-run times only mean anything with the rounds they were taken with
        args.runs, args.steps, args.warmup = old["runs"], old["steps"], old["warmup"]
    t0 = time.perf_counter()
    dev = calibrate(device("cpu"), processes=WORLD)  # one machine: one calibration for every family
    cluster = Cluster(device=dev, nodes=1, per_node=WORLD)
    t_calibrate = time.perf_counter() - t0
    families = {}
    for name in args.families:
        families[name] = _family(name, family_dims(name, args.dim, args.layers), cluster, args, old)
        _print(name, families[name])
    result = {
        "world": WORLD,
        "seq_len": SEQ,
        "batch_size": BATCH,
        "warmup": args.warmup,
        "runs": args.runs,
        "steps": args.steps,
        "device": dev.source,
        "calibrate_seconds": t_calibrate,
        "wall_seconds": time.perf_counter() - t0,
        "target": TARGET,
        "summary": {
            name: {
                "kendall": fam["kendall"],
                "spearman": fam["spearman"],
                "regret": fam["recommended_over_best_measured"],
                "recommended": fam["recommended"],
                "layouts": len(fam["layouts"]),
            }
            for name, fam in families.items()
        },
        "families": families,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} in {result['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
