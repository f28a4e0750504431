"""Decision record: compute on local tensors with explicit collectives, or run the whole model as eager DTensor?

functitan stores params as DTensors but computes on plain local tensors (``Layout``: explicit all-gather /
reduce-scatter, Megatron's f/g). The alternative keeps every activation a DTensor and lets DTensor's sharding
propagation pick the collectives. Both run here on the same Llama, params, batch and mesh, forward + backward
(``value_and_grad(llama.loss)``, no optimizer), in alternating rounds:

- ``local``: ``Layout(mesh, rules, reshard_after_forward=False)``, the library path.
- ``dtensor``: ``DTensorLayout`` below, the same model function with
  ``param(p) = p.redistribute(compute placements)`` (the data-parallel axes gathered, tp shards kept),
  einsum / embed / cross_entropy as plain torch ops on DTensors, redistributes only where Megatron places
  its collectives (gather the input of a column-parallel contraction under SP; reduce a row-parallel output
  into the residual layout). Tokens and targets are DTensors sharded on the batch over the data-parallel
  axes. Three things DTensor cannot do by itself on CPU are bridged: SDPA has no sharding strategy (it runs
  through ``local_map``), the model's RoPE tables are plain tensors (``implicit_replication``), and the
  vocab-parallel loss needs ``loss_parallel``.

Neither side reshards after forward (the DTensor variant has no cheap way to; it is FSDP's memory knob, not
compute). The gradients of the two must agree (max abs difference reported).

Run from the repository root::

    python -m benchmarks.dtensor_vs_local              # FSDP 2, TP 2, TP 2 + SP; debug Llama, batch 8, seq 128

Writes ``benchmarks/results/dtensor_vs_local.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication, local_map
from torch.distributed.tensor.parallel import loss_parallel

from benchmarks import _common
from benchmarks.parallel_vs_torch import timed_rounds
from functitan._tp import _axis_of, parse_einsum
from functitan.mesh import DP_AXES, make_mesh
from functitan.random import fold_in, key
from functitan.sharding import Layout, default_rules, place
from functitan.testing import run_distributed
from functitan.transforms import value_and_grad
from functitan.tree import tree_map
from models import llama

CASES = ("fsdp", "tp", "tp_sp")
RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class DTensorLayout(Layout):
    """Layout whose compute runs on DTensors: params redistributed to their compute placement, ops dispatched
    by DTensor. The model function is unchanged; only the Layout's entry points differ (params, blocks,
    einsum, attention, embed, loss)."""

    def _compute(self, placements: tuple) -> list:
        names = self.mesh.mesh_dim_names
        return [Replicate() if names[i] in DP_AXES else pl for i, pl in enumerate(placements)]

    def _set_tp(self, placements: Any, pl: Any) -> list:
        out = list(placements)
        out[self.mesh.mesh_dim_names.index("tp")] = pl
        return out

    def param(self, p: Tensor) -> Tensor:
        return p.redistribute(self.mesh, self._compute(p.placements))

    def params(self, tree: Any) -> Any:
        return tree_map(self.param, tree)

    def block(self, fn: Callable[..., Tensor], params: Any, *args: Any, remat: Any = None) -> Tensor:
        return fn(self.params(params), *args)

    def blocks(self, fn: Callable[..., Tensor], layers: Any, x: Tensor, *args: Any, remat: Any = None) -> Tensor:
        for p in layers:
            x = fn(self.params(p), x, *args)
        return x

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, **_: Any) -> Tensor:
        return _sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    def einsum(self, pattern: str, *operands: Tensor) -> Tensor:
        _, _, op = parse_einsum(pattern, len(operands))
        if self._tp is None or len(operands) != 2:
            return op(*operands)
        (xn, wn), out, _ = parse_einsum(pattern, 2)
        x, w = operands
        sharded = _axis_of(wn, self.rules, "tp")
        if sharded is not None and sharded in out and sharded not in xn and self.sequence_parallel:
            x = x.redistribute(self.mesh, self._set_tp(x.placements, Replicate()))  # column parallel: whole input
        y = op(x, w)
        if sharded is not None and sharded in xn and sharded not in out:  # row parallel: partial sums
            y = y.redistribute(self.mesh, self._set_tp(y.placements, self._residual(out)))
        return y

    def einsums(self, x: Tensor, pairs: list[tuple[str, Tensor]]) -> list[Tensor]:
        return [self.einsum(pattern, x, w) for pattern, w in pairs]

    def _residual(self, names: tuple[str, ...]) -> Any:
        return Shard(names.index("seq")) if self.sequence_parallel and "seq" in names else Replicate()

    def embed(self, tokens: Tensor, table: Tensor, vocab_size: int) -> Tensor:
        y = F.embedding(tokens, table)  # a vocab-sharded table gives a partial result (DTensor's MaskPartial)
        if self._tp is not None:
            y = y.redistribute(self.mesh, self._set_tp(y.placements, self._residual(("batch", "seq", "embed"))))
            # DTensor cannot redistribute the Partial(sum) gradient of a replicated activation back into the
            # table's MaskPartial: reduce it to y's placements first (from_local's backward does that)
            y = DTensor.from_local(y.to_local(), self.mesh, y.placements, shape=y.shape, stride=y.stride())
        return y

    def cross_entropy(self, logits: Tensor, targets: Tensor, vocab_size: int) -> Tensor:
        # loss_parallel (vocab-sharded logits) supports a mean only on a 1-D mesh: sum, then divide
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / targets.numel()


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    if not isinstance(q, DTensor):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    # no sharding strategy for SDPA on CPU: run it on the local shards (batch or heads sharded, both local-safe)
    fn = local_map(
        functools.partial(F.scaled_dot_product_attention, **kwargs),
        out_placements=(q.placements,),
        in_placements=(q.placements, k.placements, v.placements),
        device_mesh=q.device_mesh,
    )
    return fn(q, k, v)


@contextlib.contextmanager
def dtensor_compute(vocab_parallel: bool) -> Iterator[None]:
    """What the DTensor variant needs around a call: plain RoPE tables taken as replicated, and the
    vocab-parallel loss (forward and backward). (SDPA runs through local_map: ``DTensorLayout.attention``.)"""
    with implicit_replication(), loss_parallel() if vocab_parallel else contextlib.nullcontext():
        yield


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    config: str = "debug"
    batch: int = 8
    seq: int = 128
    steps: int = 10
    warmup: int = 2
    repeats: int = 3


def _worker(case: str, s: Setup) -> dict[str, Any]:
    n, rank = dist.get_world_size(), dist.get_rank()
    cfg = llama.config(s.config, max_seq_len=max(s.seq, 16))
    sp = case == "tp_sp"
    mesh = make_mesh(dp_shard=n) if case == "fsdp" else make_mesh(dp_shard=1, tp=n)
    rules = default_rules(sequence_parallel=sp)
    params = place(llama.init(cfg, fold_in(key(0), "params")), llama.specs(cfg), rules, mesh)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (s.batch, s.seq + 1), generator=g)
    if case == "fsdp":
        tokens = tokens[rank * s.batch // n : (rank + 1) * s.batch // n]
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    # the DTensor variant sees the global batch: sharded on dim 0 over the data-parallel axes
    act = [Shard(0) if name in DP_AXES and mesh[name].size() > 1 else Replicate() for name in mesh.mesh_dim_names]
    dbatch = {k: DTensor.from_local(v, mesh, act) for k, v in batch.items()}

    local_grad = value_and_grad(
        functools.partial(llama.loss, cfg=cfg, layout=Layout(mesh, rules, reshard_after_forward=False))
    )
    dt_grad = value_and_grad(functools.partial(llama.loss, cfg=cfg, layout=DTensorLayout(mesh, rules)))

    def run_dtensor() -> Any:
        with dtensor_compute(vocab_parallel=case != "fsdp"):
            return dt_grad(params, dbatch)

    fns = {"local": lambda: local_grad(params, batch), "dtensor": run_dtensor}
    first_call_s = {}
    for k, fn in fns.items():  # cold: DTensor's sharding propagation fills its cache on the first step
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        first_call_s[k] = float(t)
    reps = []
    for _ in range(s.repeats):  # repeated timing blocks in the same processes (the cold start costs minutes)
        wall, cpu, outs = timed_rounds(fns, steps=s.steps, warmup=s.warmup)
        med = {k: statistics.median(v) for k, v in wall.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        reps.append(
            {
                "median_ms": {k: 1e3 * v for k, v in med.items()},
                "median_cpu_ms": {k: 1e3 * v for k, v in med_cpu.items()},
                "ratio": med["dtensor"] / med["local"],
                "ratio_cpu": med_cpu["dtensor"] / med_cpu["local"],
                "step_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in wall.items()},
            }
        )
    # same math: the gradients agree (the local loss is this rank's mean; the DTensor loss the global mean)
    (lo_loss, lo_g), (dt_loss, dt_g) = outs["local"][-1], outs["dtensor"][-1]
    diffs = [
        float((a.full_tensor() - b.full_tensor()).abs().max())
        for a, b in zip(optree.tree_leaves(lo_g), optree.tree_leaves(dt_g))
    ]
    mean_local = lo_loss.clone()
    dist.all_reduce(mean_local)
    return {
        "ratio": statistics.median(r["ratio"] for r in reps),
        "ratio_cpu": statistics.median(r["ratio_cpu"] for r in reps),
        "ratio_per_repeat": [r["ratio"] for r in reps],
        "ratio_cpu_per_repeat": [r["ratio_cpu"] for r in reps],
        "first_call_s": first_call_s,
        "loss": {
            "local_mean_over_ranks": float(mean_local) / n,
            "dtensor": float(dt_loss.full_tensor() if isinstance(dt_loss, DTensor) else dt_loss),
        },
        "grad_max_abs_diff": max(diffs),
        "repeats": reps,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="debug")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timing blocks per case, in the same processes")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(RESULTS / "dtensor_vs_local.json"))
    a = ap.parse_args(argv)
    s = Setup(config=a.config, batch=a.batch, seq=a.seq, steps=a.steps, warmup=a.warmup, repeats=a.repeats)
    results = {}
    for case in (c for c in a.cases.split(",") if c):
        if case not in CASES:
            raise ValueError(f"--cases: unknown case {case!r}; choose among {CASES}")
        r = run_distributed(_worker, a.world, case, s, timeout=1800.0, threads=1)[0]
        if r["grad_max_abs_diff"] > 1e-5:
            raise RuntimeError(
                f"{case}{a.world}: gradients differ by {r['grad_max_abs_diff']:.2e}: the variants disagree"
            )
        results[f"{case}{a.world}"] = r
        per = ", ".join(f"{x:.3f}" for x in r["ratio_per_repeat"])
        print(
            f"{case}{a.world:<2} dtensor/local {r['ratio']:.3f} wall (repeats {per}), {r['ratio_cpu']:.3f} CPU; first step "
            f"{r['first_call_s']['dtensor']:.1f} s dtensor, {r['first_call_s']['local']:.1f} s local; grads agree to "
            f"{r['grad_max_abs_diff']:.1e}",
            flush=True,
        )
    cfg = llama.config(a.config)
    out = {
        "ratios": {k: v["ratio"] for k, v in results.items()},
        "ratios_cpu": {k: v["ratio_cpu"] for k, v in results.items()},
        "results": results,
        "config": {
            "model": a.config,
            **dataclasses.asdict(cfg),
            "batch": a.batch,
            "seq": a.seq,
            "steps": a.steps,
            "warmup": a.warmup,
            "repeats": a.repeats,
        },
        "env": _common.environment(1, torch.device("cpu")),
    }
    print(f"wrote {_common.write_json(a.out, out)}")
    return out


if __name__ == "__main__":
    main()
