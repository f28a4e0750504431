"""The whole train step under ``torch.compile``: functitan compiled vs functitan eager vs a compiled torch step.

Four steps on the same model (the debug Llama), data, optimizer (AdamW, warmup-cosine, global-norm clip 1.0)
and threads, in one process, timed in alternating rounds (``_common.interleaved``):

- ``functitan_eager``: ``make_train_step(value_and_grad(partial(llama.loss, ...)), adamw)`` on plain tensors.
- ``functitan_compiled``: the same with ``compile=True``: forward, backward, norm, clipping and the AdamW
  update in one inductor graph (functitan/step.py ``_compiled_step``).
- ``torch_eager``: ``benchmarks.torch_llama.Llama`` with ``torch.optim.AdamW``, ``clip_grad_norm_``, LambdaLR.
- ``torch_compiled``: the same module under ``torch.compile`` (forward and backward) and a compiled
  ``opt.step`` (PyTorch's recipe for a compiled nn.Module step; clipping stays eager).

Each of ``--runs`` runs builds fresh steps, compiles them (not timed), times ``--steps`` alternating rounds and
reports medians; the JSON holds every run's ratios and their median, and ``graph_breaks``: what
``torch._dynamo.explain`` reports for functitan's compiled step on one process and on each of 2 gloo processes
under FSDP (``dp_shard=2``, same model and optimizer; ``--no-fsdp`` skips that)::

    python -m benchmarks.compile_step --runs 3 --steps 10 --batch 4 --seq 128
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import _common
from benchmarks.torch_llama import from_functional
from functitan import optim
from functitan.random import fold_in, key
from functitan.step import make_train_step
from functitan.train_state import TrainState
from functitan.transforms import value_and_grad
from functitan.tree import tree_leaves
from models import llama

RESULTS = Path(__file__).parent / "results"
LR, STEPS_TOTAL = 1e-3, 1000


def _schedule() -> optim.Schedule:
    return optim.warmup_cosine(LR, 10, STEPS_TOTAL, final=LR / 10)


def functitan_step(cfg: llama.LlamaConfig, batches: list[Any], compile: bool) -> Callable[[], float]:
    params = llama.init(cfg, fold_in(key(0), "params"))
    for p in tree_leaves(params):
        p.requires_grad_(True)
    opt = optim.adamw(_schedule(), b1=0.9, b2=0.95, weight_decay=0.1)
    step = make_train_step(value_and_grad(functools.partial(llama.loss, cfg=cfg)), opt, max_norm=1.0, compile=compile)
    box = [TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=key(0))]

    def run() -> float:
        box[0], out = step(box[0], batches[box[0].step % len(batches)])
        return out["loss"]

    return run


def torch_step(cfg: llama.LlamaConfig, batches: list[Any], compile: bool) -> Callable[[], float]:
    model = from_functional(llama.init(cfg, fold_in(key(0), "params")), cfg)
    decay = [p for n, p in model.named_parameters() if optim.default_decay_mask(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not optim.default_decay_mask(n, p)]
    opt = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95), weight_decay=0.1
    )
    sched_fn = _schedule()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sched_fn(s) / LR)
    fwd = torch.compile(model) if compile else model
    opt_step = torch.compile(opt.step) if compile else opt.step
    n = [0]

    def run() -> float:
        batch = batches[n[0] % len(batches)]
        opt.zero_grad(set_to_none=True)
        logits = fwd(batch["inputs"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt_step()
        sched.step()
        n[0] += 1
        return loss.item()

    return run


def _explain(cfg: llama.LlamaConfig, batch: Any, layout: Any = None) -> dict[str, Any]:
    """Graphs and graph breaks of functitan's compiled step (explain traces; nothing is timed)."""
    from functitan.sharding import Layout, place

    layout = layout or Layout()
    params = llama.init(cfg, fold_in(key(0), "params"))
    if layout.mesh is not None:
        params = place(params, llama.specs(cfg), layout.rules, layout.mesh)
    opt = optim.adamw(_schedule(), b1=0.9, b2=0.95, weight_decay=0.1)
    loss = functools.partial(llama.loss, cfg=cfg, layout=layout)
    step = make_train_step(value_and_grad(loss), opt, max_norm=1.0, compile=True)
    ex = step.explain(params, opt.init(params), batch)
    return {
        "graph_count": ex.graph_count,
        "graph_break_count": ex.graph_break_count,
        "break_reasons": [str(r.reason).split("\n")[0] for r in ex.break_reasons],
    }


def _explain_fsdp(cfg: llama.LlamaConfig, batch: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from functitan.mesh import make_mesh
    from functitan.sharding import Layout

    rank = dist.get_rank()
    half = {k: v[rank * len(v) // 2 : (rank + 1) * len(v) // 2] for k, v in batch.items()}
    return _explain(cfg, half, Layout(make_mesh(dp_shard=2)))


def graph_breaks(cfg: llama.LlamaConfig, batch: Any, fsdp: bool) -> dict[str, Any]:
    from functitan.testing import run_distributed

    torch._dynamo.reset()
    out = {"one_process": _explain(cfg, batch)}
    if fsdp:
        out["fsdp2"] = run_distributed(_explain_fsdp, 2, cfg, batch, timeout=1200)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds after compilation")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-fsdp", action="store_true", help="skip the FSDP 2 graph-break count (2 processes)")
    ap.add_argument("--out", default=str(RESULTS / "compile_step.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = llama.config("debug")
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        t = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        batches.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    device = torch.device("cpu")
    runs = []
    for r in range(args.runs):
        torch._dynamo.reset()
        fns = {
            "functitan_eager": functitan_step(cfg, batches, False),
            "functitan_compiled": functitan_step(cfg, batches, True),
            "torch_eager": torch_step(cfg, batches, False),
            "torch_compiled": torch_step(cfg, batches, True),
        }
        first = {name: fn() for name, fn in fns.items()}  # compiles; the first losses agree across variants
        wall, cpu = _common.interleaved(fns, steps=args.steps, warmup=args.warmup, device=device)
        med = {n: _common.median(v) for n, v in wall.items()}
        cpu_med = {n: _common.median(v) for n, v in cpu.items()}
        runs.append(
            {
                "median_wall_s": med,
                "median_cpu_s": cpu_med,
                "first_loss": first,
                "ratios": {
                    "functitan_compiled_vs_eager": med["functitan_compiled"] / med["functitan_eager"],
                    "functitan_compiled_vs_torch_compiled": med["functitan_compiled"] / med["torch_compiled"],
                    "functitan_eager_vs_torch_eager": med["functitan_eager"] / med["torch_eager"],
                    "torch_compiled_vs_eager": med["torch_compiled"] / med["torch_eager"],
                },
            }
        )
        print(f"run {r + 1}/{args.runs}:", {k: round(v, 3) for k, v in runs[-1]["ratios"].items()}, flush=True)
    ratios = {k: statistics.median(run["ratios"][k] for run in runs) for k in runs[0]["ratios"]}
    breaks = graph_breaks(cfg, batches[0], fsdp=not args.no_fsdp)
    print(
        "graph breaks:",
        {
            k: v["graph_break_count"] if isinstance(v, dict) else [r["graph_break_count"] for r in v]
            for k, v in breaks.items()
        },
    )
    result = {
        "what": "train step time ratios (wall clock, median per run, median over runs); < 1: the first is faster",
        "ratios": ratios,
        "graph_breaks": breaks,
        "per_run": runs,
        "config": vars(args) | {"model": "debug", "dim": cfg.dim, "n_layers": cfg.n_layers},
        "environment": _common.environment(args.threads, device),
    }
    _common.write_json(args.out, result)
    print("median ratios:", {k: round(v, 3) for k, v in ratios.items()})
    return result


if __name__ == "__main__":
    main()
