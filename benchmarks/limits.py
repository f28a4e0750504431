"""Distance to the limit: each layout's step vs the compute-only time of the same per-rank work, and the
matmul-bound MFU of 1B-shaped blocks against this machine's measured GEMM peak.

1. ``layouts``: for FSDP N and DDP N (N = 2, 4) the train step (``make_train_step(value_and_grad(llama.loss),
   adamw)`` on ``Layout(make_mesh(...))``, the debug Llama, global batch 8, seq 128) against the same per-rank
   work without any collective: each rank runs the step on plain tensors with ``Layout()`` (its batch / N
   rows), the optimizer over its 1 / N of every parameter for FSDP (all of it for DDP). Both run as N
   concurrent processes so they share the cores alike (the compute-only ranks never talk); runs alternate
   (distributed, compute-only, torch, then torch, compute-only, distributed, ...). Ratio = step /
   compute-only; the gap is communication and waiting. Target for FSDP 2: <= 1.15. For FSDP N the same
   model as ``benchmarks.torch_llama.Llama`` with torch's ``fully_shard`` per block (FSDP2, the step of
   ``benchmarks.parallel_vs_torch``) is timed against the same compute-only time: ``torch_fully_shard``,
   how close torch itself gets on this machine. Each side also records the CPU seconds a rank used per step,
   its process's (``*_cpu_s``: all threads, gloo's included; with one core per rank no step is shorter) and
   its main thread's (``*_main_thread_cpu_s``: compute, packing, Python; the bound with a spare core for
   gloo).
2. ``gemm_peak``: fp32 ``torch.mm`` of square matrices (one thread, like the benchmarks' processes):
   FLOP/s, median over repeats, with min and max.
3. ``block_mfu``: forward + backward of one ``llama3_1b``-shaped block (dim 2048, 32 heads / 8 kv heads, ffn
   8192) on (1, seq) tokens: model FLOPs (6 x block params x tokens + attention) / time / GEMM peak, median
   over repeats with the spread.

    python -m benchmarks.limits                       # all three, 3 runs
    python -m benchmarks.limits --parts gemm,block    # single-process parts only

Writes ``benchmarks/results/limits.json``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import _common
from functitan import optim
from functitan.mesh import make_mesh
from functitan.random import fold_in, key
from functitan.sharding import Layout, default_rules, place
from functitan.step import make_train_step
from functitan.testing import run_distributed
from functitan.train_state import TrainState
from functitan.transforms import value_and_grad
from models import llama

RESULTS = Path(__file__).parent / "results"
BATCH, SEQ = 8, 128


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _layout_worker(case: str, compute_only: bool, steps: int, warmup: int, torch_fsdp: bool = False) -> list[float]:
    """Medians of one rank's step: [wall, CPU of its process (all threads), CPU of its main thread] seconds
    (the slowest rank's for the distributed case); ``torch_fsdp``: torch's ``fully_shard`` instead of
    functitan's FSDP."""
    n, rank = dist.get_world_size(), dist.get_rank()
    cfg = llama.config("debug", max_seq_len=SEQ)
    full = llama.init(cfg, fold_in(key(0), "params"))
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH // n, SEQ + 1), generator=g)
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    opt = optim.adamw(3e-4)
    if compute_only:
        loss = functools.partial(llama.loss, cfg=cfg, layout=Layout())
        params = {k: v for k, v in full.items()}
        grad_fn = value_and_grad(loss)
        # the optimizer touches what this rank stores: 1 / n of each leaf under FSDP, everything under DDP
        shard = (
            (lambda t: t.detach().flatten().chunk(n)[0].clone()) if case == "fsdp" else (lambda t: t.detach().clone())
        )
        opt_params = torch.utils._pytree.tree_map(shard, full)
        opt_state = opt.init(opt_params)

        def step() -> None:
            nonlocal opt_state, opt_params
            _, grads = grad_fn(params, batch)
            g_opt = torch.utils._pytree.tree_map(shard, grads)
            optim.global_norm(g_opt)
            updates, opt_state = opt.update(g_opt, opt_state, opt_params)
            opt_params = optim.apply_updates(opt_params, updates)
            float(optim.global_norm(updates))  # the host sync the real step has
    elif torch_fsdp:
        from benchmarks import parallel_vs_torch as pvt

        torch_step = pvt.torch_side("fsdp", pvt.Setup(batch=BATCH, seq=SEQ), cfg, full, [batch])

        def step() -> None:
            torch_step()
    else:
        mesh = make_mesh(dp_shard=n) if case == "fsdp" else make_mesh(dp_replicate=n, dp_shard=1)
        layout = Layout(mesh, default_rules())
        placed = place(full, llama.specs(cfg), layout.rules, mesh)
        box = [TrainState(step=0, params=placed, opt_state=opt.init(placed), data_state=None, rng=key(0))]
        train_step = make_train_step(  # donate=True, as the trainer
            value_and_grad(functools.partial(llama.loss, cfg=cfg, layout=layout)), opt, donate=True
        )

        def step() -> None:
            box[0], _ = train_step(box[0], batch)

    clocks = (time.perf_counter, time.process_time, time.thread_time)
    samples = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = [c() for c in clocks]
        step()
        t = torch.tensor([c() - s for c, s in zip(clocks, t0)])
        if not compute_only:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= warmup:
            samples.append(t.tolist())
    return [statistics.median(col) for col in zip(*samples)]


def layouts(names: list[str], runs: int, steps: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        case = name.rstrip("0123456789")  # "fsdp2" -> ("fsdp", 2)
        n = int(name[len(case) :] or 0)
        if case not in ("fsdp", "ddp") or n < 2:
            raise ValueError(f"--layouts: {name!r} is not fsdpN or ddpN with N >= 2")
        per_run = []
        sides = ["dist", "compute", "torch"] if case == "fsdp" else ["dist", "compute"]
        for r in range(runs):
            m = {}  # side -> [wall, process CPU, main-thread CPU]
            for side in sides if r % 2 == 0 else sides[::-1]:
                res = run_distributed(
                    _layout_worker, n, case, side == "compute", steps, warmup, side == "torch", timeout=900
                )
                m[side] = [statistics.median(col) for col in zip(*res)] if side == "compute" else res[0]
            dist_s, co_s = m["dist"][0], m["compute"][0]
            run = {"step_s": dist_s, "compute_only_s": co_s, "ratio": dist_s / co_s}
            run |= {"step_cpu_s": m["dist"][1], "step_main_thread_cpu_s": m["dist"][2]}
            run |= {"compute_only_cpu_s": m["compute"][1], "compute_only_main_thread_cpu_s": m["compute"][2]}
            line = f"{case}{n} run {r}: step {dist_s * 1e3:.1f} ms, compute-only {co_s * 1e3:.1f} ms"
            line += f", ratio {run['ratio']:.3f}; CPU ms (process / main thread) {m['dist'][1] * 1e3:.0f} / "
            line += f"{m['dist'][2] * 1e3:.0f} vs {m['compute'][1] * 1e3:.0f} / {m['compute'][2] * 1e3:.0f}"
            if "torch" in m:
                run |= {"torch_step_s": m["torch"][0], "torch_ratio": m["torch"][0] / co_s}
                run |= {"torch_cpu_s": m["torch"][1], "torch_main_thread_cpu_s": m["torch"][2]}
                line += f"; torch fully_shard {m['torch'][0] * 1e3:.1f} ms, ratio {run['torch_ratio']:.3f}"
                line += f" (CPU {m['torch'][1] * 1e3:.0f} / {m['torch'][2] * 1e3:.0f})"
            per_run.append(run)
            print(line, flush=True)
        out[f"{case}{n}"] = {"ratio": statistics.median(x["ratio"] for x in per_run), "runs": per_run}
        if case == "fsdp":
            out[f"{case}{n}"]["torch_fully_shard_ratio"] = statistics.median(x["torch_ratio"] for x in per_run)
    return out


def gemm_peak(repeats: int, size: int = 1024) -> dict[str, Any]:
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    rates = []
    for _ in range(repeats):
        k = 5
        t0 = time.perf_counter()
        for _ in range(k):
            torch.mm(a, b)
        rates.append(2 * size**3 * k / (time.perf_counter() - t0))
    return {"size": size, "dtype": "float32", "threads": torch.get_num_threads(), "flops": _spread(rates)}


def block_mfu(repeats: int, peak: float, seq: int = 256) -> dict[str, Any]:
    cfg = llama.config("llama3_1b", n_layers=1, max_seq_len=seq)
    p = llama.init(cfg, fold_in(key(0), "params"))["layers"][0]
    leaves = [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(p)]
    x = torch.randn(1, seq, cfg.dim, requires_grad=True)
    n_params = sum(t.numel() for t in leaves)
    flops = 6 * n_params * seq + 12 * cfg.n_heads * cfg.head_dim * seq * seq  # PaLM's count, one layer
    layout = Layout()

    def run() -> None:
        y = llama.block(p, x, cfg, layout)
        torch.autograd.grad(y.square().mean(), leaves + [x])

    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    mfus = [flops / t / peak for t in times]
    return {
        "shape": {
            "dim": cfg.dim,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "ffn_dim": cfg.ffn_dim,
            "seq": seq,
            "batch": 1,
        },
        "flops": flops,
        "time_s": _spread(times),
        "mfu_vs_measured_peak": _spread(mfus),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="layouts,gemm,block")
    ap.add_argument("--layouts", default="fsdp2,fsdp4,ddp2,ddp4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "limits.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    parts = a.parts.split(",")
    out: dict[str, Any] = {}
    if "gemm" in parts or "block" in parts:
        out["gemm_peak"] = gemm_peak(a.repeats)
        print(f"GEMM peak {out['gemm_peak']['flops']['median'] / 1e9:.1f} GFLOP/s", flush=True)
    if "block" in parts:
        out["block_mfu"] = block_mfu(a.repeats, out["gemm_peak"]["flops"]["median"])
        print(f"1B-shaped block MFU {100 * out['block_mfu']['mfu_vs_measured_peak']['median']:.1f}%", flush=True)
    if "layouts" in parts:
        out["layouts"] = layouts(a.layouts.split(","), a.runs, a.steps, a.warmup)
    out["environment"] = _common.environment(a.threads, torch.device("cpu"))
    print(f"wrote {_common.write_json(a.out, out)}")
    return out


if __name__ == "__main__":
    main()
