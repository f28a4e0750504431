"""Context parallelism (cp 1, 2, 4; attention by all-gather K/V, ring, Ulysses): per-rank activation memory,
step time, the ring's exposed communication, and torch's own ``context_parallel`` where it runs.

One Llama (``--dim`` 128, 2 layers, 8 heads / 4 kv heads, ffn 3 x dim, vocab 258, fp32), one global batch of
``--batch`` rows x ``--seq`` tokens (the same tokens at every cp: ``layout.embed`` cuts each rank's two
balanced chunks, ``layout.cross_entropy`` its targets). cp 1 is ``Layout(make_mesh(dp_shard=1))`` on one
process; cp N is ``Layout(make_mesh(cp=N), cp_attention=ALG)`` on N gloo processes (one thread each), params
sharded over cp by FSDP (``place`` with ``default_rules``), the train step as the trainer builds it
(``make_train_step(value_and_grad(partial(llama.loss, ...)), optim.adamw(...))``).

What is measured, per rank:

- ``memory``: live tensor bytes of one forward + backward (``value_and_grad``, after a warm call) counted by
  ``functitan.plan._memtrack.LiveBytes`` (a dispatch mode with ``MemTracker``'s rules: each storage an op
  returns, from the op to its free; the params are tracked from the start and their bytes taken off every
  number below, the batch and anything else made before it are not counted).
  ``activation_bytes``: bytes alive when the first backward op runs (what the forward saved for backward, plus
  logits and the loss); ``peak_bytes``: the peak over forward and backward, grads included;
  ``peak_minus_grads_bytes``: that minus the grads' bytes (the most the grads can hold at the peak, so a lower
  bound of the non-gradient bytes there). ``summary.activation_memory_vs_cp1``: over cp 1's, max over ranks
  (targets of the issue: <= 0.55 at cp 2, <= 0.30 at cp 4). Exact counts, independent of the machine's load.
  ``activation_mib_by_op_rank0``: the same activation bytes by the op that made them (first run).
- ``step``: train-step wall time (slowest rank, barrier before each step), summed and max per-rank process CPU
  time; the algorithms alternate inside one process tree (A B C, C B A, ...), cp 1 runs in its own.
- ``ring``: the ring's waits (``dist.Work.wait`` around each forward K/V receive and each backward gradient
  receive, timed by wrapping the works ``_cp._Shift.exchange`` returns) per timed train step, and ring attention
  alone (forward + backward of ``layout.attention`` on this rank's q/k/v of one layer) with real sends vs the
  same computation with the exchange replaced by a local copy (``no_comm``: same shapes, same masks, wrong
  values). ``exposed_comm_ms = real - no_comm``.
- ``torch_cp``: ``torch.distributed.tensor.experimental.context_parallel`` on ``benchmarks.torch_llama.Llama``
  with the same params and tokens (its RoPE tables and the tokens as CP buffers), timed beside functitan's
  when it runs; when it cannot run here the JSON holds the first line of its error instead of a ratio.

What a 2-core CPU with gloo cannot show: the ranks share two cores (cp 2 takes both, cp 4 has two ranks per
core), so cp N's wall time is not a cp-N machine's; ``cpu_max_rank_ms`` (the busiest rank's CPU time) is the
closer estimate of a step with a core per rank, and the wall ratio vs cp 1 mostly shows total work / 2 cores.
Loopback gloo has no real bandwidth cost, so the ring's sends cost little to move, and a wait mostly measures
the peer being late (load imbalance, or its process waiting for a core), not wire time: how much of a real
interconnect's transfer the ring hides is not shown. CPU SDPA kernels are not the GPU's (flash / cuDNN):
memory per algorithm is what this code allocates on the CPU path (CPU flash attention for ``F.sdpa``; the
ring's own matmul blocks), which on a GPU would be the same for the ring and for plain-SDPA paths.

Run from the repository root::

    python -m benchmarks.context_parallel                   # seq 2048, cp 1 2 4, 3 runs
    python -m benchmarks.context_parallel --runs 1 --cp 1 2 --steps 4

Writes ``benchmarks/results/context_parallel.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import _common
from functitan import _cp, optim
from functitan._cp import ALGORITHMS
from functitan.mesh import make_mesh
from functitan.plan._memtrack import LiveBytes
from functitan.random import fold_in, key
from functitan.sharding import Layout, default_rules, place
from functitan.step import make_train_step
from functitan.testing import run_distributed
from functitan.train_state import TrainState
from functitan.transforms import value_and_grad
from functitan.tree import flatten_with_names
from models import llama

RESULTS = Path(__file__).parent / "results"
TARGETS = {"2": 0.55, "4": 0.30}  # activation memory per rank / cp 1's (the issue)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    seq: int = 2048
    batch: int = 1
    steps: int = 5
    warmup: int = 1
    attn_steps: int = 4
    threads: int = 1
    torch_cp: bool = True


def _cfg(s: Setup) -> llama.LlamaConfig:
    return llama.config(
        "debug",
        dim=s.dim,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        n_kv_heads=s.n_kv_heads,
        ffn_dim=3 * s.dim,
        max_seq_len=s.seq,
    )


def _batch(cfg: llama.LlamaConfig, s: Setup) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (s.batch, s.seq + 1), generator=g)
    return {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}


def _local_bytes(tree: Any) -> int:
    total = 0
    for _, t in flatten_with_names(tree)[0]:
        if isinstance(t, Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


# ----------------------------------------------------------------------------------------------- the ring's sends


class _TimedWork:
    """A ``dist.Work`` whose ``wait`` is timed into ``log``."""

    def __init__(self, work: Any, log: list[float]) -> None:
        self.work, self.log = work, log

    def wait(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = self.work.wait(*args)
        self.log.append(time.perf_counter() - t0)
        return out


@contextlib.contextmanager
def _ring_exchange(mode: str, log: list[float]) -> Iterator[None]:
    """``real``: the library's exchange, its waits timed into ``log``; ``no_comm``: the receive buffer gets a
    local copy of what would be sent (no message, same shapes)."""
    original = _cp._Shift.exchange

    def timed(self: Any, send: Tensor, recv: Tensor, *, forward: bool) -> list[Any]:
        return [_TimedWork(w, log) for w in original(self, send, recv, forward=forward)]

    def local(self: Any, send: Tensor, recv: Tensor, *, forward: bool) -> list[Any]:
        self.sent = send
        recv.copy_(send)
        return []

    _cp._Shift.exchange = timed if mode == "real" else local  # type: ignore[method-assign]
    try:
        yield
    finally:
        _cp._Shift.exchange = original  # type: ignore[method-assign]


# ----------------------------------------------------------------------------------------------- the worker


def _timed(fns: dict[str, Callable[[], Any]], *, steps: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Per call of each fn, alternating (A B C, C B A): wall (max over ranks), CPU (sum and max over ranks)."""
    names = list(fns)
    out: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu_sum": [], "cpu_max": []} for k in names}
    for r in range(warmup + steps):
        for k in names if r % 2 == 0 else reversed(names):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fns[k]()
            t, c = torch.tensor(time.perf_counter() - t0), torch.tensor(time.process_time() - c0)
            cmax = c.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.all_reduce(cmax, op=dist.ReduceOp.MAX)
            dist.all_reduce(c)
            if r >= warmup:
                out[k]["wall"].append(float(t))
                out[k]["cpu_sum"].append(float(c))
                out[k]["cpu_max"].append(float(cmax))
    return out


def _locals(tree: Any) -> list[Tensor]:
    return [
        t.to_local() if isinstance(t, DTensor) else t for _, t in flatten_with_names(tree)[0] if isinstance(t, Tensor)
    ]


def _memory(grad_fn: Callable, params: Any, batch: dict) -> dict[str, int]:
    """Bytes of one forward + backward beyond the params (counted from the start and taken off: a view of a
    param made inside the step would otherwise count as new)."""
    grad_fn(params, batch)  # warm: lazy tables (RoPE, masks) made once do not count
    param_bytes = _local_bytes(params)
    with LiveBytes() as m:
        m.track_external(*_locals(params))
        loss, grads = grad_fn(params, batch)
    grad_bytes = _local_bytes(grads)
    del loss, grads
    return {
        "activation_bytes": int((m.at_backward or 0) - param_bytes),
        "peak_bytes": int(m.peak - param_bytes),
        "peak_minus_grads_bytes": int(m.peak - param_bytes - grad_bytes),
        "grad_bytes": grad_bytes,
        "param_bytes": param_bytes,
    }


class _AliveByOp(TorchDispatchMode):
    """Which ops made the bytes alive when the first backward op runs: ``{op: bytes}`` (storages counted once,
    as ``LiveBytes``; plain tensors only, DTensor ops desugar into the local ops that allocate)."""

    def __init__(self, external: list[Tensor]) -> None:
        super().__init__()
        self.live: dict[int, tuple[str, int]] = {}
        self.snapshot: dict[str, int] | None = None
        for t in external:  # made before: never reported
            st = t.untyped_storage()
            self.live[st.data_ptr()] = ("(params)", st.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(t is DTensor for t in types):
            return NotImplemented
        if self.snapshot is None and torch._C._current_autograd_node() is not None:
            agg: dict[str, int] = {}
            for name, nbytes in list(self.live.values()):
                agg[name] = agg.get(name, 0) + nbytes
            self.snapshot = agg
        res = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(res):
            if isinstance(t, Tensor) and not isinstance(t, DTensor):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if st.nbytes() and ptr not in self.live:
                    self.live[ptr] = (str(func.overloadpacket.__name__), st.nbytes())
                    weakref.finalize(st, self.live.pop, ptr, None)
        return res


def _activation_by_op(grad_fn: Callable, params: Any, batch: dict, top: int = 8) -> dict[str, float]:
    """MiB alive at the start of backward by the op that made them, the ``top`` largest (rank 0's)."""
    with _AliveByOp(_locals(params)) as m:
        out = grad_fn(params, batch)
    del out
    snap = sorted(((k, v) for k, v in (m.snapshot or {}).items() if k != "(params)"), key=lambda kv: -kv[1])[:top]
    return {name: round(b / 2**20, 3) for name, b in snap}


def _max_over_ranks(d: dict[str, int]) -> dict[str, int]:
    t = torch.tensor([float(v) for v in d.values()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: int(v) for k, v in zip(d, t.tolist())}


def _attention_alone(layout: Layout, cfg: llama.LlamaConfig, s: Setup) -> Callable[[], None]:
    """Forward + backward of ``layout.attention`` on this rank's chunks of one layer's q, k, v."""
    g = torch.Generator().manual_seed(1)
    hd = cfg.head_dim
    q, k, v = (
        layout.seq.cut(torch.randn(s.batch, h, s.seq, hd, generator=g), 2).requires_grad_()
        for h in (cfg.n_heads, cfg.kv_heads, cfg.kv_heads)
    )

    def run() -> None:
        q.grad = k.grad = v.grad = None
        layout.attention(q, k, v).sum().backward()

    return run


def _torch_cp_side(cfg: llama.LlamaConfig, full: Any, batch: dict, cp: int) -> Callable[[], float]:
    """torch's ``context_parallel`` around forward + backward + AdamW of the module Llama (same params)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from benchmarks.torch_llama import from_functional

    model = from_functional(full, cfg)
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)

    def step() -> float:
        x, t = batch["inputs"].clone(), batch["targets"].clone()
        opt.zero_grad(set_to_none=True)
        with context_parallel(
            mesh,
            buffers=[x, t, model.rope_cos, model.rope_sin],
            buffer_seq_dims=[1, 1, 0, 0],
            no_restore_buffers={x, t},
        ):
            # the module's loss is the mean over local tokens; the global mean is their cp-mean (equal chunks)
            loss = model.loss(x, t)
            loss.backward()
        for p in model.parameters():  # cp ranks hold replicas: the whole-sequence gradient is the cp-mean
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= cp
        opt.step()
        out = loss.detach().clone()
        dist.all_reduce(out)
        return float(out) / cp

    return step


def _worker(cp: int, s: Setup, algorithms: tuple[str, ...], breakdown: bool) -> dict[str, Any]:
    cfg = _cfg(s)
    full = llama.init(cfg, fold_in(key(0), "params"))
    batch = _batch(cfg, s)
    rules = default_rules()
    mesh = make_mesh(cp=cp, dp_shard=1, device="cpu")
    names = algorithms if cp > 1 else ("single",)
    layouts = {a: Layout(mesh, rules, cp_attention=a if cp > 1 else "allgather") for a in names}
    out: dict[str, Any] = {"memory": {}, "first_loss": {}}
    wait_log: list[float] = []
    ring_waits: list[float] = []

    steps: dict[str, Callable[[], Any]] = {}
    for a, layout in layouts.items():
        params = place(full, llama.specs(cfg), rules, mesh)
        grad_fn = value_and_grad(functools.partial(llama.loss, cfg=cfg, layout=layout))
        out["memory"][a] = _max_over_ranks(_memory(grad_fn, params, batch))
        if breakdown:
            out.setdefault("activation_mib_by_op_rank0", {})[a] = _activation_by_op(grad_fn, params, batch)
        out["first_loss"][a] = float(grad_fn(params, batch)[0])
        opt = optim.adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
        box = [TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=key(0))]
        train_step = make_train_step(grad_fn, opt, donate=True)

        def step(box: list = box, train_step: Callable = train_step) -> Any:
            box[0], metrics = train_step(box[0], batch)
            return metrics["loss"]

        if a == "ring":

            def step(step: Callable = step) -> Any:  # the ring's waits of this step, summed
                wait_log.clear()
                loss = step()
                ring_waits.append(sum(wait_log))
                return loss

        steps[a] = step

    if cp > 1 and s.torch_cp:
        try:
            torch_step = _torch_cp_side(cfg, full, batch, cp)
            out["first_loss"]["torch_cp"] = torch_step()
            steps["torch_cp"] = torch_step
            out["torch_cp"] = {"runs": True}
        except Exception as e:  # noqa: BLE001 (recorded, not raised: the CPU may lack what it needs)
            first = (str(e).strip().splitlines() or [""])[0]
            out["torch_cp"] = {"runs": False, "error": f"{type(e).__name__}: {first}"[:400]}
            dist.barrier()

    with _ring_exchange("real", wait_log):
        timing = _timed(steps, steps=s.steps, warmup=s.warmup)
    out["step"] = {
        k: {
            "wall_ms": 1e3 * statistics.median(v["wall"]),
            "cpu_sum_ms": 1e3 * statistics.median(v["cpu_sum"]),
            "cpu_max_rank_ms": 1e3 * statistics.median(v["cpu_max"]),
            "wall_ms_all": [round(1e3 * x, 2) for x in v["wall"]],
        }
        for k, v in timing.items()
    }

    if cp > 1 and "ring" in layouts:
        t = torch.tensor(statistics.median(ring_waits[s.warmup :]))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        attn = _attention_alone(layouts["ring"], cfg, s)
        wlog: list[float] = []
        with _ring_exchange("real", wlog):
            real = _timed({"real": attn}, steps=s.attn_steps, warmup=1)["real"]
        with _ring_exchange("no_comm", []):
            none = _timed({"no_comm": attn}, steps=s.attn_steps, warmup=1)["no_comm"]
        attn_wait = torch.tensor(sum(wlog) / (s.attn_steps + 1))  # warmup call included
        dist.all_reduce(attn_wait, op=dist.ReduceOp.MAX)
        real_ms, none_ms = 1e3 * statistics.median(real["wall"]), 1e3 * statistics.median(none["wall"])
        out["ring"] = {
            "step_wait_ms_max_rank": 1e3 * float(t),
            "step_wait_fraction": float(t) / (out["step"]["ring"]["wall_ms"] / 1e3),
            "attention_alone": {
                "real_ms": real_ms,
                "no_comm_ms": none_ms,
                "exposed_comm_ms": real_ms - none_ms,
                "exposed_fraction": (real_ms - none_ms) / real_ms,
                "wait_ms_per_call_max_rank": 1e3 * float(attn_wait),
                "real_cpu_max_rank_ms": 1e3 * statistics.median(real["cpu_max"]),
                "no_comm_cpu_max_rank_ms": 1e3 * statistics.median(none["cpu_max"]),
            },
            "messages_per_step": 2 * (cp - 1) * cfg.n_layers,  # K/V forward, their grads backward, per layer
        }
    return out


# ----------------------------------------------------------------------------------------------- driver


def _summary(runs: list[dict[str, Any]], cps: list[int]) -> dict[str, Any]:
    """Median over runs of the ratios vs cp 1 (memory ratios are the same every run)."""
    base = [r["1"] for r in runs]
    out: dict[str, Any] = {"activation_memory_vs_cp1": {}, "peak_memory_vs_cp1": {}, "step_wall_vs_cp1": {},
                           "step_cpu_max_rank_vs_cp1": {}, "step_cpu_sum_vs_cp1": {}, "vs_torch_cp": {}}  # fmt: skip
    for cp in cps:
        if cp == 1:
            continue
        c = str(cp)
        for a in runs[0][c]["memory"]:
            k = f"cp{cp}_{a}"
            m, m1 = runs[0][c]["memory"][a], base[0]["memory"]["single"]
            out["activation_memory_vs_cp1"][k] = round(m["activation_bytes"] / m1["activation_bytes"], 4)
            out["peak_memory_vs_cp1"][k] = round(m["peak_bytes"] / m1["peak_bytes"], 4)
        for a in runs[0][c]["step"]:
            k = f"cp{cp}_{a}"
            for field, name in (("wall_ms", "step_wall_vs_cp1"), ("cpu_max_rank_ms", "step_cpu_max_rank_vs_cp1"),
                                ("cpu_sum_ms", "step_cpu_sum_vs_cp1")):  # fmt: skip
                per = [r[c]["step"][a][field] / b["step"]["single"][field] for r, b in zip(runs, base)]
                out[name][k] = round(statistics.median(per), 4)
            if "torch_cp" in runs[0][c]["step"] and a != "torch_cp":
                per = [r[c]["step"][a]["wall_ms"] / r[c]["step"]["torch_cp"]["wall_ms"] for r in runs]
                out["vs_torch_cp"][k] = round(statistics.median(per), 4)
        if runs[0][c].get("torch_cp", {}).get("runs") is False:
            out["vs_torch_cp"][f"cp{cp}"] = "torch context_parallel did not run: " + runs[0][c]["torch_cp"]["error"]
    out["activation_memory_targets"] = {
        f"cp{c}": {"target": TARGETS[c], **{a: v <= TARGETS[c] for k, v in out["activation_memory_vs_cp1"].items()
                                            for a in [k.split("_", 1)[1]] if k.startswith(f"cp{c}_")}}
        for c in TARGETS if int(c) in cps
    }  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq", type=int, default=Setup.seq)
    ap.add_argument("--dim", type=int, default=Setup.dim)
    ap.add_argument("--batch", type=int, default=Setup.batch)
    ap.add_argument("--steps", type=int, default=Setup.steps)
    ap.add_argument("--warmup", type=int, default=Setup.warmup)
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--no-torch-cp", action="store_true", help="do not try torch's context_parallel")
    ap.add_argument("--runs", type=int, default=3, help="fresh process trees; the JSON holds each and the medians")
    ap.add_argument("--out", default=str(RESULTS / "context_parallel.json"))
    a = ap.parse_args(argv)
    s = Setup(seq=a.seq, dim=a.dim, batch=a.batch, steps=a.steps, warmup=a.warmup, torch_cp=not a.no_torch_cp)
    cps = sorted(set([1, *a.cp]))
    t_start = time.perf_counter()
    env_before = _common.environment(s.threads, torch.device("cpu"))
    runs: list[dict[str, Any]] = []
    for run in range(a.runs):
        results: dict[str, Any] = {}
        for cp in cps:
            r = run_distributed(_worker, cp, cp, s, tuple(a.algorithms), run == 0, timeout=900.0, threads=s.threads)[0]
            results[str(cp)] = r
            steps = ", ".join(f"{k} {v['wall_ms']:.1f} ms" for k, v in r["step"].items())
            mem = ", ".join(f"{k} {v['activation_bytes'] / 2**20:.1f} MiB" for k, v in r["memory"].items())
            print(f"run {run + 1} cp{cp}: step {steps}; activations {mem}", flush=True)
            if "ring" in r:
                aa = r["ring"]["attention_alone"]
                print(
                    f"  ring: waits {r['ring']['step_wait_ms_max_rank']:.1f} ms/step; attention alone real "
                    f"{aa['real_ms']:.1f} ms, no comm {aa['no_comm_ms']:.1f} ms",
                    flush=True,
                )
            if "torch_cp" in r:
                print(f"  torch context_parallel: {r['torch_cp']}", flush=True)
        runs.append(results)
    cfg = _cfg(s)
    out = {
        "summary": _summary(runs, cps),
        "memory_bytes": {f"cp{c}": runs[0][str(c)]["memory"] for c in cps},
        "activation_mib_by_op_rank0": {f"cp{c}": runs[0][str(c)]["activation_mib_by_op_rank0"] for c in cps},
        "first_loss": {f"cp{c}": runs[0][str(c)]["first_loss"] for c in cps},
        "ring": {f"cp{c}": [r[str(c)]["ring"] for r in runs] for c in cps if "ring" in runs[0][str(c)]},
        "torch_cp": {f"cp{c}": runs[0][str(c)].get("torch_cp") for c in cps if c > 1},
        "runs": runs,
        "config": {
            "model": "llama",
            **dataclasses.asdict(cfg),
            **dataclasses.asdict(s),
            "runs": a.runs,
            "algorithms": a.algorithms,
            "cp": cps,
        },  # fmt: skip
        "env": {
            **env_before,
            "load_average_after": _common.environment(s.threads, torch.device("cpu"))["load_average"],
        },
        "runtime_s": round(time.perf_counter() - t_start, 1),
    }
    path = _common.write_json(a.out, out)
    print(f"wrote {path} in {out['runtime_s']} s")
    return out


if __name__ == "__main__":
    main()
