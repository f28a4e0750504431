"""functitan's FSDP and tensor parallelism vs PyTorch's (FSDP2 ``fully_shard``, ``parallelize_module``), same Llama.

One train step on both sides, same model, init, batches and world size (gloo processes on loopback, one
thread each):

- ``fsdp``: functitan ``Layout(make_mesh(dp_shard=N))`` with the trainer's step (``make_train_step(
  value_and_grad(partial(llama.loss, ...)), optim.adamw(...))``: forward, backward, global grad norm, one host
  sync of loss and norm, AdamW, ``apply_updates``) vs ``benchmarks.torch_llama.Llama`` with ``fully_shard`` on
  every block and on the root, ``torch.optim.AdamW(foreach=True)`` (torchtitan's default), and the same
  metrics (``get_total_norm`` of the DTensor grads, loss and norm all-reduced, one host sync). Both reshard
  a block's params after its forward (FSDP2's default; ``--no-reshard`` turns it off on both sides).
  ``--remat full`` checkpoints every block on both sides (functitan ``Layout(remat="full")``; torch
  ``checkpoint_wrapper`` on each block before ``fully_shard``, as torchtitan).
- ``tp`` / ``tp_sp``: functitan ``make_mesh(dp_shard=1, tp=N)``, ``default_rules(sequence_parallel=...)`` vs
  torchtitan's plan: ``ColwiseParallel`` wq/wk/wv/w1/w3, ``RowwiseParallel`` wo/w2, ``PrepareModuleInput`` on
  attention and feed_forward (one gather of the block input, one gradient reduction), a vocab-parallel
  embedding (``RowwiseParallel`` on it), a column-parallel output with ``loss_parallel``; with ``_sp``
  ``SequenceParallel`` on the norms and the residual stream in ``Shard(1)``.

Both sides start from the same params (``torch_llama.from_functional``): the first-step losses must agree to
1e-4 (checked, reported). Steps alternate between the sides (A B, B A, ...) after warmup, with a barrier
before each; a step lasts until its slowest rank finishes (wall: max over ranks); process CPU time is summed
over ranks (steadier on a shared machine: it leaves out time spent waiting for a core).

Both sides gather a column-parallel input shared by several contractions (q, k, v; gate, up) once
(functitan: ``Layout.einsums``; torch: ``PrepareModuleInput``).

Run from the repository root::

    python -m benchmarks.parallel_vs_torch                      # debug config, batch 8, seq 128, world 2 and 4
    python -m benchmarks.parallel_vs_torch --world 2 --cases tp_sp --steps 10 --runs 1

Writes ``benchmarks/results/parallel_vs_torch.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import _common
from benchmarks.torch_llama import Llama, from_functional
from functitan import optim
from functitan.mesh import make_mesh
from functitan.random import fold_in, key
from functitan.sharding import Layout, default_rules, place
from functitan.step import make_train_step
from functitan.testing import run_distributed
from functitan.train_state import TrainState
from functitan.transforms import value_and_grad
from models import llama

CASES = ("fsdp", "tp", "tp_sp")
RESULTS = Path(__file__).parent / "results"
LR, B1, B2, EPS, WD = 3e-4, 0.9, 0.95, 1e-8, 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    config: str = "debug"
    batch: int = 8  # global batch: FSDP ranks take batch / N rows each, TP ranks all rows
    seq: int = 128
    steps: int = 10
    warmup: int = 2
    threads: int = 1
    reshard_after_forward: bool = True
    remat: str = "none"  # "full": every block checkpointed on both sides
    profile: int = 0  # profile this many steps of each side on rank 0 (after timing)
    profile_dir: str = str(RESULTS)


# ----------------------------------------------------------------------------------------------- the two sides


def _batches(cfg: llama.LlamaConfig, s: Setup, rows: slice) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        tokens = torch.randint(0, cfg.vocab_size, (s.batch, s.seq + 1), generator=g)[rows]
        out.append({"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()})
    return out


def _mean_stats(loss: Tensor, gnorm: Tensor) -> list[float]:
    stats = torch.stack([loss.detach().float(), gnorm.detach().float()])
    dist.all_reduce(stats)
    return (stats / dist.get_world_size()).tolist()


def functitan_side(case: str, s: Setup, cfg: llama.LlamaConfig, full: Any, batches: list) -> Callable[[], list[float]]:
    """The train step as ``functitan.train`` builds it (constant lr, no clipping)."""
    n = dist.get_world_size()
    sp = case == "tp_sp"
    mesh = make_mesh(dp_shard=n) if case == "fsdp" else make_mesh(dp_shard=1, tp=n)
    rules = default_rules(sequence_parallel=sp)
    layout = Layout(mesh, rules, reshard_after_forward=s.reshard_after_forward, remat=s.remat)
    params = place(full, llama.specs(cfg), rules, mesh)
    optimizer = optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    box = [TrainState(step=0, params=params, opt_state=optimizer.init(params), data_state=None, rng=key(0))]
    # donate=True as the trainer: adamw updates the local shards in place (torch's fused kernel)
    train_step = make_train_step(
        value_and_grad(functools.partial(llama.loss, cfg=cfg, layout=layout)), optimizer, donate=True
    )

    def step() -> list[float]:
        box[0], out = train_step(box[0], batches[box[0].step % len(batches)])
        return [out["loss"], out["grad_norm"]]

    return step


def _torch_tp(model: Llama, tp_mesh: Any, sp: bool) -> None:
    """torchtitan's Llama TP plan (``parallelize_llama.apply_tp``), with the residual in Shard(1) only when SP."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    resid = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=resid),
        "output": ColwiseParallel(input_layouts=resid, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        plan: dict[str, Any] = {
            "attention": PrepareModuleInput(
                input_layouts=(resid, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=resid),
            "feed_forward": PrepareModuleInput(input_layouts=(resid,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=resid),
        }
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)


def _checkpoint_blocks(model: Llama, remat: str) -> None:
    """torchtitan's full activation checkpointing: each block wrapped, after TP and before ``fully_shard``."""
    if remat == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def torch_side(case: str, s: Setup, cfg: llama.LlamaConfig, full: Any, batches: list) -> Callable[[], list[float]]:
    """The module step: zero_grad, forward, backward, grad norm + one host sync (as functitan's), AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    n = dist.get_world_size()
    model = from_functional(full, cfg)
    if case == "fsdp":
        _checkpoint_blocks(model, s.remat)
        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp_shard",))
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=s.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=s.reshard_after_forward)
        ctx: Callable[[], Any] = _null
    else:
        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
        _torch_tp(model, mesh, sp=case == "tp_sp")
        _checkpoint_blocks(model, s.remat)
        ctx = loss_parallel
    # param groups by decay and by DTensor-ness: foreach kernels reject a mix of plain tensors and DTensors
    # (TP without SP leaves the norm weights plain)
    groups: dict[tuple[bool, bool], list[Tensor]] = {}
    for name, p in model.named_parameters():
        groups.setdefault((optim.default_decay_mask(name, p), isinstance(p, DTensor)), []).append(p)
    opt = torch.optim.AdamW(
        [{"params": ps, "weight_decay": WD if decay else 0.0} for (decay, _), ps in groups.items()],
        lr=LR,
        betas=(B1, B2),
        eps=EPS,
        foreach=True,
    )
    params = [p for ps in groups.values() for p in ps]
    i = [0]

    def step() -> list[float]:
        batch = batches[i[0] % len(batches)]
        i[0] += 1
        opt.zero_grad(set_to_none=True)
        with ctx():
            loss = model.loss(batch["inputs"], batch["targets"])
            loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        out = _mean_stats(loss, _grad_norm([p.grad for p in params]))
        opt.step()
        return out

    return step


def _grad_norm(grads: list[Tensor]) -> Tensor:
    """``get_total_norm`` per placement group (it rejects a mix of plain tensors and DTensors, as TP without SP
    leaves the norm weights plain), combined: one collective per group of sharded grads, as functitan's."""
    groups: dict[Any, list[Tensor]] = {}
    for g in grads:
        groups.setdefault(tuple(g.placements) if isinstance(g, DTensor) else None, []).append(g)
    sq = []
    for gs in groups.values():
        norm = torch.nn.utils.get_total_norm(gs, foreach=True)
        sq.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    return torch.stack(sq).sum().sqrt()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ----------------------------------------------------------------------------------------------- timing


def timed_rounds(fns: dict[str, Callable[[], Any]], *, steps: int, warmup: int) -> tuple[dict, dict, dict]:
    """(wall s, CPU s, outputs) per call of each ``fns[name]`` on every rank, in alternating rounds (A B, B A).

    A barrier starts each call on all ranks together; its wall time is the slowest rank's (a distributed step
    lasts until its last rank ends), its CPU time the sum over ranks. ``warmup`` rounds are not timed (their
    outputs are kept: the first is the first step's).
    """
    names = list(fns)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    outs: dict[str, list[Any]] = {k: [] for k in names}
    for r in range(warmup + steps):
        for k in names if r % 2 == 0 else reversed(names):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            out = fns[k]()
            t, c = torch.tensor(time.perf_counter() - t0), torch.tensor(time.process_time() - c0)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.all_reduce(c)
            outs[k].append(out)
            if r >= warmup:
                wall[k].append(float(t))
                cpu[k].append(float(c))
    return wall, cpu, outs


def _worker(case: str, s: Setup) -> dict[str, Any]:
    n, rank = dist.get_world_size(), dist.get_rank()
    cfg = llama.config(s.config, max_seq_len=max(s.seq, 16))
    llama.check_layout(cfg, tp=1 if case == "fsdp" else n, seq_len=s.seq, sequence_parallel=case == "tp_sp")
    full = llama.init(cfg, fold_in(key(0), "params"))
    rows = slice(rank * s.batch // n, (rank + 1) * s.batch // n) if case == "fsdp" else slice(None)
    batches = _batches(cfg, s, rows)
    fns = {"functitan": functitan_side(case, s, cfg, full, batches), "torch": torch_side(case, s, cfg, full, batches)}
    wall, cpu, losses = timed_rounds(fns, steps=s.steps, warmup=s.warmup)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    first = {k: v[0][0] for k, v in losses.items()}
    result = {
        "median_step_ms": {k: 1e3 * v for k, v in med.items()},
        "median_cpu_ms": {k: 1e3 * v for k, v in med_cpu.items()},
        "ratio": med["functitan"] / med["torch"],
        "ratio_cpu": med_cpu["functitan"] / med_cpu["torch"],
        "first_loss": first,
        "first_loss_abs_diff": abs(first["functitan"] - first["torch"]),
        "last_loss_and_grad_norm": {k: v[-1] for k, v in losses.items()},
        "step_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in wall.items()},
    }
    if s.profile:
        result["profiles"] = _profile(fns, case, s)
    return result


def _profile(fns: dict[str, Callable[[], Any]], case: str, s: Setup) -> dict[str, str]:
    """torch.profiler tables (rank 0) over ``s.profile`` steps of each side."""
    paths = {}
    for name, fn in fns.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(s.profile):
                with record_function("step"):
                    fn()
        if dist.get_rank() == 0:
            path = Path(s.profile_dir) / f"parallel_vs_torch_profile_{case}{dist.get_world_size()}_{name}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(
                f"# {case} world {dist.get_world_size()} {name}: {s.profile} steps, rank 0\n\n"
                + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            )
            paths[name] = str(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="debug")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    ap.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False on both sides (FSDP)")
    ap.add_argument(
        "--remat", choices=("none", "full"), default="none", help="full: checkpoint every block, both sides"
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=3,
        help="repeat everything this many times (fresh processes); the JSON holds every run's ratio and their median",
    )
    ap.add_argument("--profile", type=int, default=0, help="also profile this many steps per side (rank 0)")
    ap.add_argument("--out", default=str(RESULTS / "parallel_vs_torch.json"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    s = Setup(
        config=a.config,
        batch=a.batch,
        seq=a.seq,
        steps=a.steps,
        warmup=a.warmup,
        reshard_after_forward=not a.no_reshard,
        remat=a.remat,
        profile=a.profile,
        profile_dir=str(Path(a.out).parent),
    )
    runs: list[dict[str, Any]] = []
    for run in range(a.runs):  # each run starts fresh process trees
        results: dict[str, Any] = {}
        for world in (int(w) for w in a.world.split(",")):
            for case in (c for c in a.cases.split(",") if c):
                if case not in CASES:
                    raise ValueError(f"--cases: unknown case {case!r}; choose among {CASES}")
                r = run_distributed(_worker, world, case, s, timeout=1800.0, threads=s.threads)[0]
                if r["first_loss_abs_diff"] > 1e-4:
                    raise RuntimeError(
                        f"{case}{world}: first-step losses differ by {r['first_loss_abs_diff']:.2e} "
                        f"({r['first_loss']}): the two sides do not compute the same model"
                    )
                results[f"{case}{world}"] = r
                print(
                    f"run {run + 1} {case}{world:<2} functitan {r['median_step_ms']['functitan']:7.1f} ms, torch "
                    f"{r['median_step_ms']['torch']:7.1f} ms: functitan/torch {r['ratio']:.3f} wall, {r['ratio_cpu']:.3f} CPU; "
                    f"first loss diff {r['first_loss_abs_diff']:.1e}",
                    flush=True,
                )
        runs.append(results)
    keys = list(runs[0])
    summary = {}
    for field in ("ratio", "ratio_cpu"):
        if field in runs[0][keys[0]]:
            per = {k: [r[k][field] for r in runs] for k in keys}
            summary[field] = {"median": {k: statistics.median(v) for k, v in per.items()}, "per_run": per}
    cfg = llama.config(a.config)
    out = {
        "ratios": summary["ratio"]["median"],  # functitan / torch step time, median over runs (wall)
        "summary": summary,
        "first_loss": {k: runs[0][k]["first_loss"] for k in keys},
        "runs": runs,
        "config": {
            "model": a.config,
            **dataclasses.asdict(cfg),
            "batch": a.batch,
            "seq": a.seq,
            "steps": a.steps,
            "warmup": a.warmup,
            "runs": a.runs,
            "reshard_after_forward": s.reshard_after_forward,
            "remat": s.remat,
            "optimizer": {"lr": LR, "b1": B1, "b2": B2, "eps": EPS, "weight_decay": WD},
        },
        "env": _common.environment(s.threads, torch.device("cpu")),
    }
    path = _common.write_json(a.out, out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
