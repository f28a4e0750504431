"""One-GPU check for the day a GPU is lent (one H200, 15 minutes of device time, no second GPU).

For 1B- and 8B-shaped Llama layers (``llama3_1b`` / ``llama3_8b`` widths and vocabulary, few layers so a
whole train step fits one GPU), in bf16 compute with fp32 master weights and fp32 gradient reduction:

- step time and MFU of functitan's train step (``make_train_step(value_and_grad(llama.loss), adamw)`` on a
  one-rank mesh, ``Layout(param_dtype=bf16, reduce_dtype=fp32)``) against the same model as a torch
  ``nn.Module`` (``benchmarks.torch_llama``) with ``fully_shard`` on a one-GPU mesh
  (``MixedPrecisionPolicy(bf16, fp32)``) and ``torch.optim.AdamW`` both ways, ``foreach=True`` (its default,
  the reported ``ratio``) and ``fused=True`` (``ratio_vs_torch_fused_adamw``; functitan's trainer donates its
  state, so its adamw runs the same fused kernel in place): alternating steps after warm-up, medians, and
  MFU against the device table's bf16 peak (``functitan.metrics.peak_flops``) and a measured 8192^3 GEMM;
- pinned-memory async checkpoint staging: how long ``functitan.checkpoint.Checkpointer.save`` blocks the
  loop (GPU -> pinned host copies) and how long the whole save takes, for the params + AdamW state; and for
  the first shape, what a save costs the loop the trainer's way (``checkpoint_loop``: staging deferred to the
  step's fence, steps until the commit, against a synchronous save);
- CUDA memory metrics per side: peak allocated / reserved, allocation retries, OOMs
  (``torch.cuda.memory_stats``);
- long-sequence attention on one device (``attention_check``: 8K-64K tokens, Llama 3 8B's heads, causal and
  with packed documents): the SDPA kernel chosen, time and peak memory, what each context-parallel rank runs;
- the trainer end to end (``functitan train --config configs/debug.toml`` on this device, a checkpoint half
  way, a second run resumed from it): tokens/s, MFU and how far the resumed losses are from the full run's.

Installs nothing; run through ``benchmarks/gpu_check.sh`` (a time limit of 8 minutes) or directly::

    python -m benchmarks.gpu_check --out benchmarks/results/gpu_check.json
    python -m benchmarks.gpu_check --dry-run       # CPU, tiny shapes, a few steps: checks the script itself

``--dry-run`` runs every part on the CPU with tiny shapes (same code path, gloo, bf16) in under a minute and
writes ``benchmarks/results/gpu_check_dry_run.json``, which git ignores: it checks the script, it measures nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import _common
from benchmarks.torch_llama import from_functional
from functitan import metrics as M
from functitan import optim
from functitan.checkpoint import Checkpointer
from functitan.mesh import make_mesh
from functitan.random import fold_in, key
from functitan.sharding import Layout, default_rules, place
from functitan.step import make_train_step
from functitan.train_state import TrainState
from functitan.transforms import value_and_grad
from models import llama

RESULTS = Path(__file__).parent / "results"
LR, B1, B2, EPS, WD = 3e-4, 0.9, 0.95, 1e-8, 0.1
# (config, layers, batch, seq): widths of the published models, depth cut so params + AdamW + activations fit
SHAPES = {"1b": ("llama3_1b", 4, 4, 2048), "8b": ("llama3_8b", 2, 2, 2048)}
DRY = {"1b": ("llama3_1b", 2, 2, 32), "8b": ("llama3_8b", 1, 1, 32)}  # tiny widths below


def _config(name: str, dry: bool) -> tuple[llama.LlamaConfig, int, int]:
    flavor, layers, batch, seq = (DRY if dry else SHAPES)[name]
    over: dict[str, Any] = {"n_layers": layers, "max_seq_len": max(seq, 64)}
    if dry:  # keep the head / kv ratios, shrink the widths
        over.update(vocab_size=512, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128 if name == "1b" else 192)
    return llama.config(flavor, **over), batch, seq


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"note": "CUDA memory metrics need a CUDA device"}
    s = torch.cuda.memory_stats(device)
    return {
        "peak_allocated_gib": s.get("allocated_bytes.all.peak", 0) / 2**30,
        "peak_reserved_gib": s.get("reserved_bytes.all.peak", 0) / 2**30,
        "alloc_retries": s.get("num_alloc_retries", 0),
        "ooms": s.get("num_ooms", 0),
        "device_total_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
    }


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def functitan_side(
    cfg: llama.LlamaConfig, full: Any, batch: dict, device: torch.device
) -> tuple[Callable[[], float], Callable[[], Any]]:
    mesh = make_mesh(dp_shard=1, device=device.type)
    layout = Layout(mesh, default_rules(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    params = place(full, llama.specs(cfg), layout.rules, mesh)
    opt = optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    box = [TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=key(0))]
    # donate: the trainer's step (adamw updates the buffers in place in one fused pass)
    step = make_train_step(value_and_grad(functools.partial(llama.loss, cfg=cfg, layout=layout)), opt, donate=True)

    def run(fence: Callable[[], None] | None = None) -> float:
        box[0], out = step(box[0], batch, before_update=fence)
        return out["loss"]

    return run, lambda: {"params": box[0].params, "opt_state": box[0].opt_state}


def torch_side(
    cfg: llama.LlamaConfig, full: Any, batch: dict, device: torch.device, *, fused: bool = False
) -> Callable[[], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = from_functional(full, cfg, device=device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    groups: dict[bool, list] = {}
    for name, p in model.named_parameters():
        groups.setdefault(optim.default_decay_mask(name, p), []).append(p)
    opt = torch.optim.AdamW(
        [{"params": ps, "weight_decay": WD if d else 0.0} for d, ps in groups.items()],
        lr=LR,
        betas=(B1, B2),
        eps=EPS,
        **({"fused": True} if fused else {"foreach": True}),
    )
    params = [p for ps in groups.values() for p in ps]

    def run() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(batch["inputs"], batch["targets"])
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        out = torch.stack([loss.detach().float(), norm.float()]).tolist()  # one host sync, as functitan's
        opt.step()
        return out[0]

    return run


def _alternate(
    fns: dict[str, Callable[[], Any]], steps: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + steps):
        for k in fns if r % 2 == 0 else reversed(list(fns)):
            _sync(device)
            t0 = time.perf_counter()
            fns[k]()
            _sync(device)
            if r >= warmup:
                times[k].append(time.perf_counter() - t0)
    return times


def check_shape(
    name: str,
    device: torch.device,
    *,
    steps: int,
    warmup: int,
    dry: bool,
    ckpt_dir: str,
    profile_dir: str | None,
    loop_cost: bool = False,
) -> dict[str, Any]:
    cfg, batch_size, seq = _config(name, dry)
    full = llama.init(cfg, fold_in(key(0), "params"), device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq + 1), generator=g).to(device)
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    fpt = M.transformer_flops_per_token(
        n_params=llama.num_params(cfg, embedding=False),
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        seq_len=seq,
    )
    peak = M.peak_flops(device, torch.bfloat16)
    out: dict[str, Any] = {
        "config": {
            "flavor": (DRY if dry else SHAPES)[name][0],
            "n_layers": cfg.n_layers,
            "dim": cfg.dim,
            "ffn_dim": cfg.ffn_dim,
            "vocab": cfg.vocab_size,
            "batch": batch_size,
            "seq": seq,
            "params": llama.num_params(cfg),
        },
        "peak": {"value": peak.value, "source": peak.source},
        "flops_per_token": fpt,
    }
    _reset_memory(device)
    fn_f, state_of = functitan_side(cfg, full, batch, device)
    fn_f()
    _sync(device)
    mem_f = _memory(device)
    fn_t = torch_side(cfg, full, batch, device)
    _reset_memory(device)
    fn_t()
    _sync(device)
    mem_t = _memory(device)
    fn_tf = torch_side(cfg, full, batch, device, fused=True)
    del full
    fn_tf()
    sides = {"functitan": fn_f, "torch": fn_t, "torch_fused": fn_tf}
    times = _alternate(sides, steps, warmup, device)
    if profile_dir:
        out["profile"] = _guarded(functools.partial(_profile, sides, device, profile_dir, name))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens_per_step = batch_size * seq
    out["median_step_s"] = med
    out["step_s"] = times
    out["ratio"] = med["functitan"] / med["torch"]  # vs torch.optim.AdamW's default (foreach)
    out["ratio_vs_torch_fused_adamw"] = med["functitan"] / med["torch_fused"]
    out["per_step_ratios"] = [a / b for a, b in zip(times["functitan"], times["torch"])]
    out["mfu"] = {k: (fpt * tokens_per_step / v / peak.value if peak.value else None) for k, v in med.items()}
    out["tflops"] = {k: fpt * tokens_per_step / v / 1e12 for k, v in med.items()}
    out["memory"] = {"functitan": mem_f, "torch": mem_t}
    del fn_t, fn_tf, sides
    _reset_memory(device)
    out["checkpoint"] = _guarded(lambda: _checkpoint_staging(state_of(), device, ckpt_dir, repeats=2))
    if loop_cost:
        out["checkpoint_loop"] = _guarded(lambda: _checkpoint_loop(fn_f, state_of, device, ckpt_dir, saves=2))
    return out


def _profile(fns: dict[str, Callable[[], Any]], device: torch.device, out_dir: str, name: str) -> dict[str, Any]:
    """Operator tables of 3 steps per side (device time and host time): where the two steps differ."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    files = {}
    for side, fn in fns.items():
        _sync(device)
        with profile(activities=acts) as prof:
            for _ in range(3):
                fn()
            _sync(device)
        ka = prof.key_averages()
        path = Path(out_dir) / f"profile_{name}_{side}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            ka.table(sort_by=sort, row_limit=45, max_name_column_width=70)
            + "\n\nby host time\n"
            + ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
        )
        files[side] = str(path)
    return {"tables": files}


def trainer_check(work_dir: str, *, steps: int, device: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The trainer as a user types it, on this device: ``functitan train --config configs/debug.toml`` for
    ``steps`` steps with a checkpoint half way, then a second run resumed from that checkpoint alone. Reports
    loss, tokens/s and MFU from ``metrics.jsonl`` and how far the resumed run's losses are from the
    uninterrupted run's (0.0: bit-exact). ``extra`` overrides go after the config (the dry run's short rows)."""
    half = steps // 2
    base = [
        sys.executable,
        "-m",
        "functitan.train",
        "--config",
        str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml"),
        "--model.name=models.llama",  # a module path: the checkout need not be pip-installed
        f"--training.steps={steps}",
        f"--training.device={device}",
        "--metrics.log_every=1",
        f"--metrics.run_dir={work_dir}",
        "--checkpoint.enable=true",
        f"--checkpoint.interval={half}",
        *extra,
    ]
    out: dict[str, Any] = {"steps": steps, "resumed_at": half}
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in ("full", "resumed"):
        if name == "resumed":  # only the half-way checkpoint of the full run: the resumed run starts there
            src = Path(work_dir) / "full" / "checkpoints" / str(half)
            shutil.copytree(src, Path(work_dir) / name / "checkpoints" / str(half))
        t0 = time.perf_counter()
        proc = subprocess.run([*base, f"--metrics.run_name={name}"], capture_output=True, text=True, timeout=300)
        out[f"{name}_wall_s"] = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"functitan train ({name}) exited {proc.returncode}: {proc.stderr[-3000:]}")
        lines = (Path(work_dir) / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [r for r in map(json.loads, lines) if "loss" in r]
    full, resumed = ({r["step"]: r for r in runs[k]} for k in ("full", "resumed"))
    later = [full[k] for k in sorted(full) if k > 2]  # after the first steps' warm-up
    out.update(
        first_loss=full[1]["loss"],
        last_loss=full[steps]["loss"],
        resumed_steps=sorted(resumed),
        resume_max_abs_loss_diff=max(abs(resumed[k]["loss"] - full[k]["loss"]) for k in resumed),
        median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in later),
        median_mfu_percent=statistics.median(r["mfu"] for r in later),
        peak_memory={k: v for k, v in full[steps].items() if k.startswith("mem_")},
    )
    return out


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one part of the check; a failure is recorded (with its traceback) instead of losing the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a device run is one shot: keep every result that was measured
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


# long-sequence attention on one device (Llama 3 8B's heads: 32 query, 8 kv, head_dim 128), causal and with
# packed documents: the kernel SDPA picks and the memory each takes (what a cp rank runs on its chunks)
ATTENTION_SEQS, ATTENTION_DRY_SEQS = (8192, 32768, 65536), (64, 128)
KERNELS = ("flash", "efficient", "cudnn", "math")  # substrings of the SDPA kernels' operator names


def attention_check(device: torch.device, *, dry: bool, repeats: int = 3) -> dict[str, Any]:
    """``functitan._attention.attention`` (what ``Layout.attention`` runs on one device) forward + backward in
    bf16 at long sequences: the kernel chosen (from the profiler's operator names), the median time and the peak
    memory, causal and with ``segment_ids`` (8 packed documents: an explicit mask, so not the flash kernel)."""
    from torch.profiler import ProfilerActivity, profile

    from functitan._attention import attention

    heads, kv, hd = (4, 2, 16) if dry else (32, 8, 128)
    out: dict[str, Any] = {"heads": heads, "kv_heads": kv, "head_dim": hd, "seqs": {}}
    for seq in ATTENTION_DRY_SEQS if dry else ATTENTION_SEQS:
        row: dict[str, Any] = {}
        for case in ("causal", "documents"):
            try:
                g = torch.Generator(device=device).manual_seed(0)
                q, k, v = (
                    torch.randn(1, h, seq, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
                    for h in (heads, kv, kv)
                )
                segments = (torch.arange(seq, device=device) * 8 // seq)[None] if case == "documents" else None

                def step() -> None:
                    attention(q, k, v, segment_ids=segments).sum().backward()

                step()  # warm-up (and the kernel's workspace)
                _reset_memory(device)
                times = []
                for _ in range(repeats):
                    _sync(device)
                    t0 = time.perf_counter()
                    step()
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    step()
                    _sync(device)
                ops = {e.key for e in prof.key_averages() if "attention" in e.key.lower()}
                kernel = next((n for n in KERNELS if any(n in o.lower() for o in ops)), "unknown")
                row[case] = {"kernel": kernel, "ops": sorted(ops), "median_s": statistics.median(times)}
                row[case].update(_memory(device))
            except torch.OutOfMemoryError as e:
                row[case] = {"error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}
            finally:
                q = k = v = None  # type: ignore[assignment]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        out["seqs"][str(seq)] = row
    return out


def gemm_peak(device: torch.device, *, n: int, repeats: int = 10) -> dict[str, Any]:
    """Measured bf16 matmul rate (n x n x n, after warm-up): the ceiling MFU is also reported against."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    rates = []
    for r in range(3 + repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if r >= 3:
            rates.append(2 * n**3 / (time.perf_counter() - t0))
    return {"n": n, "median_flops": statistics.median(rates), "min_flops": min(rates), "max_flops": max(rates)}


def _checkpoint_staging(tree: Any, device: torch.device, ckpt_dir: str, *, repeats: int) -> dict[str, Any]:
    """Seconds ``Checkpointer.save`` blocks (device -> pinned host staging) and the whole save takes."""
    blocked, total = [], []
    nbytes = sum(
        x.numel() * x.element_size() for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)
    )
    with Checkpointer() as ck:
        for i in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            handle = ck.save(os.path.join(ckpt_dir, f"step_{i}"), tree)
            blocked.append(time.perf_counter() - t0)
            handle.wait()
            total.append(time.perf_counter() - t0)
            shutil.rmtree(os.path.join(ckpt_dir, f"step_{i}"), ignore_errors=True)  # the device disk is small
    return {
        "bytes": nbytes,
        "blocked_s": blocked,
        "total_s": total,
        "first_blocked_s": blocked[0],  # allocates (and pins) the staging buffers
        "reuse_blocked_s": min(blocked[1:]),  # what every later save costs the loop
        "median_total_s": statistics.median(total),
        "first_staging_gb_per_s": nbytes / blocked[0] / 1e9,
        "pinned": device.type == "cuda",
        "note": "device -> pinned copies are queued on the compute stream: a reused save blocks only to enqueue them",
    }


def _checkpoint_loop(
    step: Callable[..., float], state_of: Callable[[], Any], device: torch.device, ckpt_dir: str, *, saves: int
) -> dict[str, Any]:
    """What a save costs the training loop, the trainer's way: staging deferred to the step's fence (on CUDA a
    side stream's copies into pinned buffers), steps running until the save has committed.

    ``lost_s`` = (the save call + every step until the commit) - as many plain steps (the median of 3 right
    before); ``lost_over_sync_save`` divides by a synchronous save of the same state (issue 14's target: <= 0.1
    with the write off the compute path).
    """
    with Checkpointer() as ck:
        ck.save(os.path.join(ckpt_dir, "loop_warm"), state_of(), defer_staging=True)  # allocates, pins the buffers
        step(ck.staged)
        ck.wait()
        shutil.rmtree(os.path.join(ckpt_dir, "loop_warm"), ignore_errors=True)
        sync, lost, call, in_flight = [], [], [], []
        for i in range(saves):
            path = os.path.join(ckpt_dir, f"loop_{i}")
            plain = []
            for _ in range(3):
                _sync(device)
                t0 = time.perf_counter()
                step()
                _sync(device)
                plain.append(time.perf_counter() - t0)
            _sync(device)
            t0 = time.perf_counter()
            handle = ck.save(path, state_of(), defer_staging=True)
            call.append(time.perf_counter() - t0)
            k = 0
            while True:
                step(ck.staged)
                k += 1
                if handle.done():
                    break
            _sync(device)
            lost.append(time.perf_counter() - t0 - k * statistics.median(plain))
            in_flight.append(k)
            ck.wait()
            shutil.rmtree(path, ignore_errors=True)
            _sync(device)
            t0 = time.perf_counter()
            ck.save_sync(path, state_of())
            sync.append(time.perf_counter() - t0)
            shutil.rmtree(path, ignore_errors=True)  # the device disk is small
    return {
        "call_s": call,
        "lost_s": lost,
        "steps_in_flight": in_flight,
        "sync_save_s": sync,
        "lost_over_sync_save": statistics.median(lost) / statistics.median(sync),
        "call_over_sync_save": statistics.median(call) / statistics.median(sync),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, few steps: checks the script")
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per side (default 10; dry run 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per side (default 3; dry run 1)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining shapes past this many seconds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-trainer", action="store_true", help="skip the end-to-end trainer run and resume")
    ap.add_argument("--profile", default=None, metavar="DIR", help="also write per-side operator tables to DIR")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    dry = a.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; run with --dry-run to check the script on the CPU")
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    steps, warmup = a.steps or (3 if dry else 10), a.warmup or (1 if dry else 3)
    out: dict[str, Any] = {
        "dry_run": dry,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shapes": {},
        "skipped": [],
    }
    path = a.out or str(RESULTS / ("gpu_check_dry_run.json" if dry else "gpu_check.json"))
    out["gemm_peak"] = _guarded(lambda: gemm_peak(device, n=256 if dry else 8192))
    out["attention"] = _guarded(lambda: attention_check(device, dry=dry))
    _common.write_json(path, out)
    for seq, row in out["attention"].get("seqs", {}).items():
        print(
            f"attention at seq {seq}: "
            + "; ".join(
                f"{case} {r['kernel']} {r['median_s'] * 1e3:.1f} ms"
                + (f", peak {r['peak_allocated_gib']:.2f} GiB" if "peak_allocated_gib" in r else "")
                if "error" not in r
                else f"{case} {r['error']}"
                for case, r in row.items()
            ),
            flush=True,
        )
    with tempfile.TemporaryDirectory(prefix="functitan_gpu_check_") as tmp:
        for name in a.shapes.split(","):
            if time.perf_counter() - t_start > a.budget_s:
                out["skipped"].append(name)
                continue
            t0 = time.perf_counter()
            run = functools.partial(
                check_shape,
                name,
                device,
                steps=steps,
                warmup=warmup,
                dry=dry,
                ckpt_dir=os.path.join(tmp, name),
                profile_dir=a.profile,
                loop_cost=name == a.shapes.split(",")[0],  # the first (smallest) shape: its saves take seconds
            )
            out["shapes"][name] = r = _guarded(run)
            r["wall_s"] = time.perf_counter() - t0
            _common.write_json(path, out)  # what was measured so far survives a later failure or the time limit
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if "error" in r:
                continue
            measured = out["gemm_peak"].get("median_flops")
            if measured:
                r["mfu_vs_measured_gemm"] = {
                    k: r["flops_per_token"] * r["config"]["batch"] * r["config"]["seq"] / v / measured
                    for k, v in r["median_step_s"].items()
                }
            mfu = r["mfu"]["functitan"]
            print(
                f"{name}: functitan {r['median_step_s']['functitan'] * 1e3:.1f} ms, torch {r['median_step_s']['torch'] * 1e3:.1f} ms "
                f"(fused AdamW {r['median_step_s']['torch_fused'] * 1e3:.1f} ms), ratio {r['ratio']:.3f} "
                f"({r['ratio_vs_torch_fused_adamw']:.3f}), MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'}; checkpoint blocks "
                f"{r['checkpoint'].get('first_blocked_s', float('nan')) * 1e3:.1f} ms (first), "
                f"{r['checkpoint'].get('reuse_blocked_s', float('nan')) * 1e3:.1f} ms (reused) of "
                f"{r['checkpoint'].get('median_total_s', float('nan')) * 1e3:.1f} ms",
                flush=True,
            )
            if "lost_over_sync_save" in r.get("checkpoint_loop", {}):
                loop = r["checkpoint_loop"]
                print(
                    f"{name}: a save costs the loop {loop['lost_over_sync_save']:.3f} of a synchronous save "
                    f"(steps in flight {loop['steps_in_flight']}); the call {loop['call_over_sync_save']:.3f}",
                    flush=True,
                )
        if not a.no_trainer:
            out["trainer"] = _guarded(
                functools.partial(
                    trainer_check,
                    os.path.join(tmp, "trainer"),
                    steps=4 if dry else 60,
                    device=device.type,
                    # the debug config's 8 x 256 tokens take ~3 s a step on 2 CPU cores: the dry run checks
                    # the path (the CLI, a save, a resume), not the speed, on 8 x 32
                    extra=("--training.seq_len=32",) if dry else (),
                )
            )
            tr = out["trainer"]
            if "error" not in tr:
                print(
                    f"trainer: loss {tr['first_loss']:.3f} -> {tr['last_loss']:.3f} in {tr['steps']} steps, "
                    f"{tr['median_tokens_per_s']:.0f} tok/s; resumed at {tr['resumed_at']}: max |loss diff| "
                    f"{tr['resume_max_abs_loss_diff']:.2e}",
                    flush=True,
                )
    out["wall_s"] = time.perf_counter() - t_start
    out["environment"] = _common.environment(torch.get_num_threads(), device)
    print(f"wrote {_common.write_json(path, out)} ({out['wall_s']:.0f} s)")
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
