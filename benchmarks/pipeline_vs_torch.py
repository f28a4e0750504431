"""functitan's pipeline executor vs ``torch.distributed.pipelining`` on the same Llama split, PP 2 and PP 4.

Both sides run one pipelined forward + backward (no optimizer) of the same model, stages and microbatches:

- ``functitan``: ``pipeline.pipeline_grad_fn`` over ``llama.stage_model`` (pure functions, DTensor params on the
  stage mesh), schedules ``one_f_one_b`` and ``interleaved_1f1b(v=2)``.
- ``torch``: ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` over ``PipelineStage``s of an ``nn.Module`` stage
  (``_TorchStage`` below: blocks of ``benchmarks.torch_llama`` holding copies of the same params), with the
  same layer split (``pipeline.balance``).

Timing: every rank runs the variants in alternating rounds with a barrier before each step; a step's time is
the slowest rank's. Also reported, for every functitan schedule: the measured idle fraction of each rank
(1 - busy compute / step time, from ``pipeline_grad_fn(timeline=...)``; ``wait`` is the part spent waiting
for a receive) beside the simulator's bubble fraction for the measured per-stage F / B / W / BW durations
(p2p = 0: the gap between them is communication and host overhead), and each measured step replayed in the
simulator with its own action durations (``simulated_replay``: no averaging of a spread of durations, which
on a shared machine is wide and costs a tightly packed schedule more than 1F1B), and the simulation with the costs
`pipeline.fit_costs` measures from every rank's timeline (``simulated_fit``: the same durations plus the measured
P2P latency ``p2p_s`` and host time per action ``overhead_s``).

Fewer cores than ranks (PP 4 on a 2-core machine): a rank's idle time is another rank's compute time, so no
schedule can beat the summed CPU time of the ranks over the cores (``cpu_bound_s``), and a schedule that
only removes bubbles (zero-bubble) cannot gain on one that is already at that bound. Hence also, per
schedule: ``wall_over_cpu_bound`` (1.0 = CPU-bound) and, from the per-action CPU times (``Span.cpu``), the
simulator's makespan with a core per rank (``ideal_ratio_vs_1f1b``): what the schedule gives where each rank
has its own core.

Run from the repository root (processes: gloo on loopback, one thread each)::

    python -m benchmarks.pipeline_vs_torch                 # debug Llama with 8 layers, seq 128, 8 microbatches
    python -m benchmarks.pipeline_vs_torch --steps 5 --pp 2

Writes ``benchmarks/results/pipeline_vs_torch.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks import _common
from benchmarks.torch_llama import from_functional
from functitan import pipeline
from functitan.mesh import make_mesh
from functitan.random import PRNGKey
from functitan.sharding import Layout, default_rules
from functitan.testing import run_distributed
from models import llama

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb_h1", "zb_v")
VERSUS_TORCH = ("1f1b", "interleaved")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    n_layers: int = 8
    seq: int = 128
    batch: int = 8
    microbatches: int = 8
    steps: int = 10
    warmup: int = 2


def _schedule(name: str, pp: int, m: int) -> pipeline.Schedule:
    if name == "interleaved":
        return pipeline.interleaved_1f1b(pp=pp, v=2, m=m)
    return {"gpipe": pipeline.gpipe, "1f1b": pipeline.one_f_one_b, "zb_h1": pipeline.zb_h1, "zb_v": pipeline.zb_v}[
        name
    ](pp=pp, m=m)


class _TorchStage(nn.Module):
    """One stage of ``benchmarks.torch_llama.Llama``: embedding if first, its blocks, norm + output if last."""

    def __init__(self, full: nn.Module, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = full.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in layers})
        self.norm = full.norm if last else None
        self.output = full.output if last else None
        self.register_buffer("rope_cos", full.rope_cos, persistent=False)
        self.register_buffer("rope_sin", full.rope_sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # tokens (mb, seq) on the first stage, else (mb, seq, dim)
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        s = x.shape[1]
        cos, sin = self.rope_cos[:s].to(x.dtype), self.rope_sin[:s].to(x.dtype)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.output(self.norm(x))  # logits (mb, seq, vocab)
        return x


def _ce(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _torch_runner(cfg: llama.LlamaConfig, params: dict, stages: pipeline.Stages, name: str, device: torch.device):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    full = from_functional(params, cfg, device=device)
    n = stages.num_stages
    pstages = [
        PipelineStage(
            _TorchStage(full, stages.layers[s], first=s == 0, last=s == n - 1), s, n, device, group=stages.pp_group
        )
        for s in stages.local
    ]
    m = stages.schedule.microbatches
    sched = (
        Schedule1F1B(pstages[0], m, loss_fn=_ce) if name == "1f1b" else ScheduleInterleaved1F1B(pstages, m, loss_fn=_ce)
    )
    has_first, has_last = 0 in stages.local, n - 1 in stages.local
    modules = [p.submod for p in pstages]

    def step(batch: dict[str, Tensor]) -> float:
        for mod in modules:
            mod.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        args = (batch["inputs"],) if has_first else ()
        # return_outputs=False: a training step needs the losses, not the last stage's logits merged over microbatches
        target = batch["targets"] if has_last else None
        sched.step(*args, target=target, losses=losses if has_last else None, return_outputs=False)
        return float(torch.stack(losses).detach().mean()) if has_last else 0.0

    return step


def _costs(spans: list[pipeline.Span], schedule: pipeline.Schedule, *, cpu: bool = False) -> pipeline.Costs:
    """Per-stage median F, B, W durations (BW as b with w = 0; wall or CPU time), gathered from every rank."""
    by: dict[tuple[str, int], list[float]] = {}
    for s in spans:
        by.setdefault((s.action.kind, s.action.stage), []).append(s.cpu if cpu else s.end - s.start)
    merged: list[Any] = [None] * schedule.pp
    dist.all_gather_object(merged, {k: statistics.median(v) for k, v in by.items()})
    med = {k: v for d in merged for k, v in d.items()}
    f = [med[("F", s)] for s in range(schedule.num_stages)]
    b = [med.get(("B", s), med.get(("BW", s), 0.0)) for s in range(schedule.num_stages)]
    w = [med.get(("W", s), 0.0) for s in range(schedule.num_stages)]
    return pipeline.Costs(f=f, b=b, w=w, p2p=0)


def _worker(pp: int, setup: Setup) -> dict:
    device = torch.device("cpu")
    cfg = llama.config("debug", n_layers=setup.n_layers, max_seq_len=setup.seq)
    mesh = make_mesh(pp=pp, device=device.type)
    rules = default_rules()
    layout = Layout(pipeline.stage_mesh(mesh), pipeline.stage_rules(rules))
    model = llama.stage_model(cfg, layout, seq_len=setup.seq)
    full_params = llama.init(cfg, PRNGKey(0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (setup.batch, setup.seq + 1), generator=g)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    fns, timelines, schedules, layers = {}, {}, {}, {}
    for name in SCHEDULES:
        stages = pipeline.make_stages(model, _schedule(name, pp, setup.microbatches), mesh)
        params = pipeline.place_stages(full_params, llama.specs(cfg), rules, stages)
        timelines[name], schedules[name], layers[name] = [], stages.schedule, [list(r) for r in stages.layers]
        grad_fn = pipeline.pipeline_grad_fn(stages, timeline=timelines[name])
        fns[f"functitan_{name}"] = lambda grad_fn=grad_fn, params=params: float(grad_fn(params, batch)[0])
        if name in VERSUS_TORCH:
            fns[f"torch_{name}"] = (lambda step: lambda: step(batch))(
                _torch_runner(cfg, full_params, stages, name, device)
            )

    group = mesh["pp"].get_group()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    losses: dict[str, float] = {}
    names = list(fns)
    for r in range(setup.warmup + setup.steps):
        for k in names if r % 2 == 0 else reversed(names):
            dist.barrier(group)
            t0, c0 = time.perf_counter(), time.process_time()
            losses[k] = fns[k]()
            t, c = torch.tensor(time.perf_counter() - t0), torch.tensor(time.process_time() - c0)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # a step lasts until its slowest rank ends
            dist.all_reduce(c, group=group)  # CPU seconds of all ranks: steadier than wall time on a busy machine
            if r >= setup.warmup:
                wall[k].append(float(t))
                cpu[k].append(float(c))
        if r == setup.warmup - 1:
            for tl in timelines.values():
                tl.clear()
    loss_sum = {k: torch.tensor(v) for k, v in losses.items()}
    for v in loss_sum.values():
        dist.all_reduce(v, group=group)  # torch reports the loss on the last stage only; functitan on every rank
    out: dict[str, Any] = {
        "step_s": {k: statistics.median(v) for k, v in wall.items()},
        "cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "idle": {},
        "layers": layers,
    }
    out["loss"] = {k: float(v) / (pp if k.startswith("functitan") else 1) for k, v in loss_sum.items()}
    cores = len(os.sched_getaffinity(0))
    out["cores"] = cores
    ideal: dict[str, float] = {}
    for name, tl in timelines.items():
        gathered: list[Any] = [None] * pp
        dist.all_gather_object(
            gathered, (statistics.median(s.idle_fraction for s in tl), statistics.median(s.wait_fraction for s in tl))
        )
        spans = [sp for s in tl for sp in s.spans]
        sim = pipeline.simulate(schedules[name], _costs(spans, schedules[name]))
        # the same with the measured P2P latency and per-action host time (pipeline.fit_costs)
        every_rank: list[Any] = [None] * pp
        dist.all_gather_object(every_rank, tl)
        fitted = pipeline.fit_costs(schedules[name], every_rank)
        sim_fit = pipeline.simulate(schedules[name], fitted)
        sim_cpu = pipeline.simulate(schedules[name], _costs(spans, schedules[name], cpu=True))
        # each measured step replayed action by action (its own durations, every rank's): the idle time the
        # schedule implies for that step, so what remains of the measured idle is P2P and host overhead
        steps: list[Any] = [None] * pp
        dist.all_gather_object(steps, [[(sp.action, sp.end - sp.start) for sp in t.spans] for t in tl])
        replay = [
            float(pipeline.simulate(schedules[name], durations={a: d for r in steps for a, d in r[i]}).bubble_fraction)
            for i in range(len(tl))
        ]
        ideal[name] = float(sim_cpu.makespan)
        kinds = sorted({sp.action.kind for sp in spans})
        cpu_bound = out["cpu_s"][f"functitan_{name}"] / min(pp, cores)
        out["idle"][name] = {
            "measured_per_rank": [round(x, 4) for x, _ in gathered],
            "measured_mean": round(sum(x for x, _ in gathered) / pp, 4),
            "wait_per_rank": [round(w, 4) for _, w in gathered],
            "simulated": round(float(sim.bubble_fraction), 4),
            "simulated_per_rank": [round(float(i / sim.makespan), 4) for i in sim.idle],
            "simulated_replay": round(statistics.median(replay), 4),
            "simulated_fit": round(float(sim_fit.bubble_fraction), 4),
            "p2p_s": round(float(fitted.p2p), 6),
            "overhead_s": round(float(fitted.overhead), 6),
            "simulated_core_per_rank": round(float(sim_cpu.bubble_fraction), 4),
            "cpu_bound_s": round(cpu_bound, 4),
            "wall_over_cpu_bound": round(out["step_s"][f"functitan_{name}"] / cpu_bound, 3),
            "median_action_s_rank0": {
                k: round(statistics.median(sp.end - sp.start for sp in spans if sp.action.kind == k), 5) for k in kinds
            },
            "median_action_cpu_s_rank0": {
                k: round(statistics.median(sp.cpu for sp in spans if sp.action.kind == k), 5) for k in kinds
            },
        }
    for name in ("zb_h1", "zb_v"):
        out["idle"][name]["ideal_ratio_vs_1f1b"] = round(ideal[name] / ideal["1f1b"], 4)
    return out


def _ratios(r: dict) -> dict[str, float]:
    """functitan / torch per schedule (1F1B, interleaved), and the zero-bubble schedules / functitan's 1F1B."""
    out = {f"{n}/torch_{n}": r["step_s"][f"functitan_{n}"] / r["step_s"][f"torch_{n}"] for n in VERSUS_TORCH}
    out.update({f"{n}/1f1b": r["step_s"][f"functitan_{n}"] / r["step_s"]["functitan_1f1b"] for n in ("zb_h1", "zb_v")})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=Setup.steps)
    ap.add_argument("--microbatches", type=int, default=Setup.microbatches)
    ap.add_argument(
        "--runs", type=int, default=3, help="fresh process groups per pp; the JSON holds every run and the medians"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline_vs_torch.json"))
    args = ap.parse_args(argv)
    setup = Setup(steps=args.steps, microbatches=args.microbatches)
    result: dict[str, Any] = {
        "setup": dataclasses.asdict(setup),
        "model": "llama debug (dim 256, 8 heads, 4 kv heads, ffn 768)",
        "environment": _common.environment(1, torch.device("cpu")),
        "pp": {},
    }
    for pp in args.pp:
        runs = []
        for run in range(args.runs):
            r = run_distributed(_worker, pp, pp, setup, timeout=1800)[0]
            r["ratios"] = _ratios(r)
            r["cpu_ratios"] = {
                f"{n}/torch_{n}": r["cpu_s"][f"functitan_{n}"] / r["cpu_s"][f"torch_{n}"] for n in VERSUS_TORCH
            }
            r["cpu_ratios"].update(
                {f"{n}/1f1b": r["cpu_s"][f"functitan_{n}"] / r["cpu_s"]["functitan_1f1b"] for n in ("zb_h1", "zb_v")}
            )
            runs.append(r)
            print(f"pp={pp} run {run + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items()), flush=True)
            for name, idle in r["idle"].items():
                print(
                    f"  {name:12s} idle measured {idle['measured_mean']:.3f}  simulated {idle['simulated']:.3f}"
                    f"  replayed {idle['simulated_replay']:.3f}  fitted {idle['simulated_fit']:.3f}"
                    f" (p2p {idle['p2p_s'] * 1e3:.2f} ms, host {idle['overhead_s'] * 1e3:.2f} ms/action)"
                    f"  waits {sum(idle['wait_per_rank']) / pp:.3f}"
                    f"  wall/cpu-bound {idle['wall_over_cpu_bound']:.2f}  "
                    + (f"ideal vs 1f1b {idle['ideal_ratio_vs_1f1b']:.3f}" if "ideal_ratio_vs_1f1b" in idle else ""),
                    flush=True,
                )
            print("  cpu ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_ratios"].items()), flush=True)
        keys = runs[0]["ratios"]
        result["pp"][str(pp)] = {
            "ratios": {k: statistics.median(x["ratios"][k] for x in runs) for k in keys},  # median over runs
            "per_run_ratios": {k: [round(x["ratios"][k], 4) for x in runs] for k in keys},
            "cpu_ratios": {k: statistics.median(x["cpu_ratios"][k] for x in runs) for k in runs[0]["cpu_ratios"]},
            "idle": {
                n: {
                    "measured": statistics.median(x["idle"][n]["measured_mean"] for x in runs),
                    "simulated": statistics.median(x["idle"][n]["simulated"] for x in runs),
                    "simulated_replay": statistics.median(x["idle"][n]["simulated_replay"] for x in runs),
                    "simulated_fit": statistics.median(x["idle"][n]["simulated_fit"] for x in runs),
                    "p2p_s": statistics.median(x["idle"][n]["p2p_s"] for x in runs),
                    "overhead_s": statistics.median(x["idle"][n]["overhead_s"] for x in runs),
                    "wall_over_cpu_bound": statistics.median(x["idle"][n]["wall_over_cpu_bound"] for x in runs),
                    **(
                        {"ideal_ratio_vs_1f1b": statistics.median(x["idle"][n]["ideal_ratio_vs_1f1b"] for x in runs)}
                        if "ideal_ratio_vs_1f1b" in runs[0]["idle"][n]
                        else {}
                    ),
                }
                for n in runs[0]["idle"]
            },
            "runs": runs,
        }
        print(f"pp={pp} medians: {result['pp'][str(pp)]['ratios']}", flush=True)
    _common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
