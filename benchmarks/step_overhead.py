"""What functitan's functional train step costs over the same step written in plain PyTorch.

Three steps on the same model, data, optimizer and threads, in one process, timed in alternating rounds:

- ``functitan_dtensor``: the step exactly as ``functitan.train`` builds it: params placed as DTensors on a
  one-rank mesh from ``make_mesh()``, ``make_train_step(accumulate(value_and_grad(partial(llama.loss, cfg=...,
  layout=Layout(mesh))), 1), build_optimizer(...), max_norm=..., donate=True)`` (AdamW after global-norm
  clipping, warmup-cosine; the donated state lets adamw run torch's fused kernel in place).
- ``functitan_plain``: the same with plain tensors and ``Layout()``: the difference to the first is the
  DTensor bookkeeping alone.
- ``torch``: ``benchmarks.torch_llama.Llama`` with ``torch.optim.AdamW`` (decay / no-decay param groups as
  functitan's mask), ``LambdaLR`` on the same schedule and ``clip_grad_norm_``.

Run from the repository root::

    python -m benchmarks.step_overhead                    # debug config, batch 8, seq 256, 1 thread
    python -m benchmarks.step_overhead --steps 40 --threads 2 --profile 5

Writes ``benchmarks/results/step_overhead.json`` (medians, ratios, config, environment); ``--profile N``
also writes torch.profiler tables of N steps of each variant next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import _common
from benchmarks.torch_llama import from_functional
from functitan import optim
from functitan.hostmem import keep_freed_memory
from functitan.job_config import OptimizerConfig, build_optimizer, learning_rate_schedule
from functitan.mesh import make_mesh
from functitan.random import fold_in, key
from functitan.sharding import Layout, default_rules, place
from functitan.step import make_train_step
from functitan.train_state import TrainState
from functitan.transforms import accumulate, value_and_grad
from functitan.tree import tree_map
from models import llama

VARIANTS = ("functitan_dtensor", "functitan_plain", "torch")
RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    cfg: llama.LlamaConfig
    opt_cfg: OptimizerConfig
    total_steps: int
    batches: list[dict[str, torch.Tensor]]
    device: torch.device
    dtype: torch.dtype
    torch_foreach: bool | None
    tag: bool = False  # wrap the phases in torch.profiler record_function ranges


class Variant(NamedTuple):
    """One way of training: the whole step, and its two phases for the breakdown.

    ``grad`` computes loss and gradients for the next batch (forward + backward); ``update`` runs the rest of
    the step (norm, host sync, optimizer, new params) on the gradients the last ``grad`` left.
    """

    step: Callable[[], list[float]]
    grad: Callable[[], Any]
    update: Callable[[], Any]


def _tagged(name: str, fn: Callable[..., Any], on: bool) -> Callable[..., Any]:
    if not on:
        return fn

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapped


def functitan_variant(s: Setup, *, mesh: Any) -> Variant:
    """The functitan train step as ``functitan.train`` builds it (DTensor params when ``mesh`` is given)."""
    rng = key(0)
    params = llama.init(s.cfg, fold_in(rng, "params"), device=s.device, dtype=s.dtype)
    if mesh is not None:
        rules = default_rules()
        layout = Layout(mesh, rules)
        params = place(params, llama.specs(s.cfg), rules, mesh)
    else:
        layout = Layout()
        params = tree_map(lambda p: p.requires_grad_(True), params)
    optimizer = build_optimizer(s.opt_cfg, s.total_steps)
    box = [TrainState(step=0, params=params, opt_state=optimizer.init(params), data_state=None, rng=rng)]
    grad_fn = accumulate(value_and_grad(functools.partial(llama.loss, cfg=s.cfg, layout=layout)), 1)
    in_place = optimizer.update_in_place and _tagged("optimizer.update", optimizer.update_in_place, s.tag)
    optimizer = optimizer._replace(
        update=_tagged("optimizer.update", optimizer.update, s.tag), update_in_place=in_place
    )
    # donate=True: the trainer's step (adamw updates the buffers in place, in torch's fused kernel)
    train_step = make_train_step(
        _tagged("grad_fn", grad_fn, s.tag), optimizer, max_norm=s.opt_cfg.max_norm, donate=True
    )
    last: list[Any] = [None]
    # the same step with the gradients of the last grad() handed in: everything but forward and backward
    update_step = make_train_step(lambda params, batch: last[0], optimizer, max_norm=s.opt_cfg.max_norm, donate=True)

    def step() -> list[float]:
        box[0], out = train_step(box[0], s.batches[box[0].step % len(s.batches)])
        return [out["loss"], out["grad_norm"]]

    def grad() -> None:
        last[0] = grad_fn(box[0].params, s.batches[box[0].step % len(s.batches)])

    def update() -> None:
        box[0], _ = update_step(box[0], None)

    return Variant(step, grad, update)


def torch_variant(s: Setup) -> Variant:
    """The plain-PyTorch step: zero_grad, forward, backward, clip_grad_norm_, AdamW, LambdaLR, one host sync."""
    params = llama.init(s.cfg, fold_in(key(0), "params"), device=s.device, dtype=s.dtype)
    model = from_functional(params, s.cfg)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if optim.default_decay_mask(name, p) else no_decay).append(p)
    o = s.opt_cfg
    opt = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.b1, o.b2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        foreach=s.torch_foreach,
    )
    lr_at = learning_rate_schedule(o, s.total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step) / o.lr)
    n = [0]
    tag = (lambda name: record_function(name)) if s.tag else (lambda name: contextlib.nullcontext())
    loss_box: list[torch.Tensor] = []

    def grad() -> None:
        batch = s.batches[n[0] % len(s.batches)]
        opt.zero_grad(set_to_none=True)
        with tag("forward"):
            loss = model.loss(batch["inputs"], batch["targets"])
        with tag("backward"):
            loss.backward()
        loss_box[:] = [loss.detach()]

    def update() -> list[float]:
        with tag("clip_grad_norm_"):
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_norm, foreach=s.torch_foreach)
        with tag("optimizer.step"):
            opt.step()
            sched.step()
        n[0] += 1
        return torch.stack([loss_box[0].float(), gnorm.float()]).tolist()  # one host sync, as functitan's step

    def step() -> list[float]:
        grad()
        return update()

    return Variant(step, grad, update)


def build(s: Setup, variants: tuple[str, ...]) -> dict[str, Variant]:
    fns: dict[str, Variant] = {}
    for v in variants:
        if v == "functitan_dtensor":
            fns[v] = functitan_variant(s, mesh=make_mesh(device=s.device.type))
        elif v == "functitan_plain":
            fns[v] = functitan_variant(s, mesh=None)
        elif v == "torch":
            fns[v] = torch_variant(s)
        else:
            raise ValueError(f"unknown variant {v!r}; choose among {VARIANTS}")
    return fns


def run_profile(s: Setup, variants: tuple[str, ...], steps: int, rows: int, out_dir: Path) -> dict[str, str]:
    """torch.profiler tables (self CPU time, top ``rows`` ops) over ``steps`` steps of each variant."""
    fns = {name: v.step for name, v in build(dataclasses.replace(s, tag=True), variants).items()}
    for fn in fns.values():  # warm
        fn(), fn()
    paths = {}
    for name, fn in fns.items():
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                with record_function("step"):
                    fn()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        phases = prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)
        path = out_dir / f"step_overhead_profile_{name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}: {steps} steps\n\n## by self CPU time\n{table}\n\n## by total CPU time\n{phases}\n")
        paths[name] = str(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="debug", help=f"a models.llama config: {sorted(llama.CONFIGS)}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (same for all variants)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    ap.add_argument(
        "--torch-foreach",
        default="default",
        choices=["on", "off", "default"],
        help="torch.optim.AdamW / clip_grad_norm_ foreach (default: torch's choice: per-tensor loops on CPU, foreach on CUDA)",
    )
    ap.add_argument(
        "--breakdown",
        type=int,
        default=0,
        help="also time the grad and update phases separately, this many rounds each",
    )
    ap.add_argument("--profile", type=int, default=0, help="also profile this many steps of each variant")
    ap.add_argument("--profile-rows", type=int, default=30)
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's default thresholds (the trainer applies functitan.hostmem.keep_freed_memory; "
        "it speeds both sides, functional updates more)",
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=3,
        help="fresh runs of the alternating rounds; the JSON holds each run's ratios and their median",
    )
    ap.add_argument(
        "--no-tiny",
        dest="tiny",
        action="store_false",
        help="skip the second measurement at batch 1, seq 32 (>= 60 steps), where fixed per-step cost dominates",
    )
    ap.add_argument("--out", default=str(RESULTS / "step_overhead.json"))
    return ap.parse_args(argv)


def breakdown(
    fns: dict[str, Variant], *, steps: int, warmup: int, device: torch.device
) -> dict[str, dict[str, dict[str, float]]]:
    """Median milliseconds of each variant's two phases, each phase timed in its own alternating rounds.

    ``grad``: forward and backward. ``update``: norm, host sync, optimizer, new params (the same gradients
    every time). The difference to ``torch`` in each phase says where functitan's overhead sits.
    """
    for v in fns.values():
        v.grad()
    out: dict[str, dict[str, dict[str, float]]] = {}
    for phase in ("grad", "update"):
        wall, cpu = _common.interleaved(
            {n: getattr(v, phase) for n, v in fns.items()}, steps=steps, warmup=warmup, device=device
        )
        out[phase] = {
            n: {"wall_ms": 1e3 * _common.median(wall[n]), "cpu_ms": 1e3 * _common.median(cpu[n])} for n in fns
        }
    return out


def _ratios(med: dict[str, float]) -> dict[str, float]:
    out = {f"{n}/torch": med[n] / med["torch"] for n in med if n != "torch" and "torch" in med}
    if {"functitan_dtensor", "functitan_plain"} <= med.keys():
        out["functitan_dtensor/functitan_plain"] = med["functitan_dtensor"] / med["functitan_plain"]
    return out


def measure(a: argparse.Namespace, batch: int, seq: int, steps: int) -> dict[str, Any]:
    """``a.runs`` runs (fresh variants each) of ``steps`` alternating rounds at (batch, seq); medians over runs."""
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    variants = tuple(v for v in a.variants.split(",") if v)
    cfg = llama.config(a.config)
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "inputs": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),
            "targets": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),
        }
        for _ in range(4)
    ]
    foreach = {"on": True, "off": False, "default": None}[a.torch_foreach]
    total = a.warmup + steps + 2 * (a.profile + 2) + a.breakdown + a.warmup  # every update advances the schedule
    s = Setup(
        cfg=cfg,
        opt_cfg=OptimizerConfig(),
        total_steps=total,
        batches=batches,
        device=device,
        dtype=dtype,
        torch_foreach=foreach,
    )
    runs = []
    for r in range(a.runs):
        fns = build(s, variants if r % 2 == 0 else tuple(reversed(variants)))
        last: dict[str, list[float]] = {}
        wrapped = {n: (lambda n=n, f=f.step: last.__setitem__(n, f())) for n, f in fns.items()}
        times, cpu = _common.interleaved(wrapped, steps=steps, warmup=a.warmup, device=device)
        med = {n: _common.median(t) for n, t in times.items()}
        med_cpu = {n: _common.median(t) for n, t in cpu.items()}
        runs.append(
            {
                "median_s": med,
                "ratios": _ratios(med),
                "median_cpu_s": med_cpu,
                "ratios_cpu": _ratios(med_cpu),
                "times_s": times,
                "cpu_times_s": cpu,
                "last_loss_and_grad_norm": last,
            }
        )
        print(
            f"  batch {batch} seq {seq} run {r + 1}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in runs[-1]["ratios"].items()),
            flush=True,
        )
    keys = runs[0]["ratios"].keys()
    result: dict[str, Any] = {
        "ratios": {k: _common.median([x["ratios"][k] for x in runs]) for k in keys},  # median over runs
        "ratios_cpu": {k: _common.median([x["ratios_cpu"][k] for x in runs]) for k in keys},
        "per_run_ratios": {k: [x["ratios"][k] for x in runs] for k in keys},
        "per_run_ratios_cpu": {k: [x["ratios_cpu"][k] for x in runs] for k in keys},
        "median_s": {n: _common.median([x["median_s"][n] for x in runs]) for n in runs[0]["median_s"]},
        "runs": runs,
        "config": {
            "model": a.config,
            **dataclasses.asdict(cfg),
            "batch": batch,
            "seq": seq,
            "steps": steps,
            "warmup": a.warmup,
            "runs": a.runs,
            "dtype": a.dtype,
            "torch_foreach": a.torch_foreach,
            "default_malloc": a.default_malloc,
            "optimizer": dataclasses.asdict(s.opt_cfg),
        },
    }
    if a.breakdown:
        result["breakdown"] = breakdown(build(s, variants), steps=a.breakdown, warmup=a.warmup, device=device)
    if a.profile:
        result["profiles"] = run_profile(
            s, variants, a.profile, a.profile_rows, Path(a.out).parent / f"b{batch}_s{seq}"
        )
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    if not a.default_malloc:
        keep_freed_memory()  # as functitan.train does, for every variant alike (one process)
    shapes = {"default": (a.batch, a.seq, a.steps)}
    if a.tiny:
        shapes["tiny"] = (1, 32, max(a.steps, 60))
    result: dict[str, Any] = {"targets": {"default": "functitan_dtensor/torch <= 1.0", "tiny": "<= 1.05"}}
    for name, (batch, seq, steps) in shapes.items():
        result[name] = measure(a, batch, seq, steps)
        for r, v in result[name]["ratios"].items():
            print(f"{name:>8} {r:>38}: {v:.3f} wall, {result[name]['ratios_cpu'][r]:.3f} CPU (median of {a.runs} runs)")
    result["ratios"] = {f"{name}:{k}": v for name in shapes for k, v in result[name]["ratios"].items()}
    result["env"] = _common.environment(a.threads, torch.device(a.device))
    print(f"wrote {_common.write_json(a.out, result)}")
    return result


if __name__ == "__main__":
    main()
