"""functitan.plan's step-time model: the host term (traced op count x seconds per op) and its calibration."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path

import pytest
from support import PLAN_TINY

from functitan.job_config import JobConfig, ModelConfig
from functitan.plan import Candidate, Cluster, calibrate, device, job_config, model_shape, predict, trace_rank
from functitan.plan._cost import step_time
from functitan.plan._devices import op_time

SEQ, BATCH = 32, 8


@pytest.fixture(autouse=True)
def _no_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _cluster(**dev) -> Cluster:
    base = dataclasses.replace(device("h100"), **dev)
    return Cluster(device=base, nodes=1, per_node=8)


def _t(cluster: Cluster, c: Candidate, ops: float):
    # 1 TFLOP per token x 8192 tokens on 8 ranks: 1 PFLOP per rank, ~2.2 s on an H100 at 45% of peak
    return step_time(c, cluster, {}, flops_per_token=1e12, tokens=8192, n_blocks=4, ops=ops)


def test_host_time_adds_on_a_cpu_and_overlaps_on_a_gpu():
    c = Candidate(dp_replicate=8)
    cpu_like = _cluster(host_async=False, op_s=20e-6)
    assert _t(cpu_like, c, 5000).total - _t(cpu_like, c, 0).total == pytest.approx(5000 * 20e-6)
    gpu = _cluster(op_s=10e-6)  # the H100 default: 10k ops are 0.1 s of host time, under the compute
    assert _t(gpu, c, 10_000).total == pytest.approx(_t(gpu, c, 0).total)
    host_bound = _t(gpu, c, 1e6)  # 10 s of launches: the host paces the step
    assert host_bound.total == pytest.approx(10.0) and host_bound.host == pytest.approx(10.0)


def test_bubble_is_lent_to_ranks_that_share_cores():
    c = Candidate(pp=2, dp_replicate=4, schedule="1f1b", microbatches=2)
    alone = _t(_cluster(host_async=False), c, 1000)
    shared = _t(_cluster(host_async=False, share=2.0), c, 1000)
    assert alone.bubble == pytest.approx(1 / 3)
    assert alone.busy == pytest.approx(alone.work * 1.5)  # 1 / (1 - bubble)
    assert shared.busy == pytest.approx(shared.work)  # the idle third is absorbed by the other rank on the core


def test_traced_op_count_extrapolates_to_the_full_model():
    from functitan.model import load_model

    model = load_model("llama")
    mcfg = model.config("debug", **PLAN_TINY)
    base = JobConfig(model=ModelConfig(name="llama", flavor="debug", overrides=PLAN_TINY))
    c = Candidate(dp_shard=4, param_dtype="float32")
    p = predict(base, model, mcfg, model_shape(model, mcfg, SEQ), c, batch_size=BATCH, seq_len=SEQ)
    cfg = job_config(base, c, batch_size=BATCH, seq_len=SEQ)
    full = trace_rank(cfg, model, mcfg, world=4, rank=0)
    three = trace_rank(cfg, model, dataclasses.replace(mcfg, n_layers=3), world=4, rank=0)
    assert full.ops > three.ops > 0
    assert p.ops == pytest.approx(full.ops)  # traced at 2 and 3 blocks, extended to 4: exact
    # the step time of a candidate grows with the ops it dispatches
    cl = Cluster(device=dataclasses.replace(device("h100"), host_async=False), nodes=1, per_node=4)
    t = step_time(c, cl, p.comm, flops_per_token=1e6, tokens=BATCH * SEQ, n_blocks=4, ops=p.ops)
    t3 = step_time(c, cl, p.comm, flops_per_token=1e6, tokens=BATCH * SEQ, n_blocks=4, ops=three.ops)
    assert t.total - t3.total == pytest.approx((full.ops - three.ops) * cl.device.op_s)


def test_calibrate_fits_the_host_time_per_op():
    here = op_time(0.2, best=False)
    dev = calibrate(device("cpu"), processes=2)
    assert 0 < dev.op_s < 1e-3
    # two processes measure while both run: no faster than one alone at its best, and within reach of it
    assert op_time(0.2) * 0.5 <= dev.op_s <= here * 20
    assert dev.share == max(2 / len(os.sched_getaffinity(0)), 1.0)
    assert "us of host time per op" in dev.source
    assert not dev.host_async


def test_a_traced_fsdp_step_dispatches_no_idle_ops_and_builds_rope_once(monkeypatch):
    """Each op of a trace is ~0.2 ms of fake dispatch (and host time in a real step). FSDP's gathers dispatch
    none that does nothing: no move of dim 0 to 0, no slice of every row, no zero of an empty pad, one
    ``_foreach_copy_`` per bucket instead of a copy per shard; and the RoPE tables are built once per trace, as a
    real step's cache does, not in every block (3,653 ops -> 2,568 here: 726 slices and 114 zeros before)."""
    import functitan.plan._trace as tracing
    from functitan.model import load_model

    ops: Counter = Counter()
    real = tracing._StepMode._call

    def counted(self, func, args, kwargs):
        ops[func.__name__.split(".")[0]] += 1
        return real(self, func, args, kwargs)

    monkeypatch.setattr(tracing._StepMode, "_call", counted)
    model = load_model("llama")
    mcfg = dataclasses.replace(model.config("debug", **PLAN_TINY), n_layers=3)  # every dim divides by 4: no pads
    base = JobConfig(model=ModelConfig(name="llama", flavor="debug", overrides=PLAN_TINY))
    cfg = job_config(base, Candidate(dp_shard=4, param_dtype="float32", microbatches=2), batch_size=BATCH, seq_len=SEQ)
    tracing.trace_rank(cfg, model, mcfg, world=4, rank=0)
    assert ops["zero_"] == 0 and ops["copy_"] == 0 and ops["_foreach_copy_"] == 14, ops  # 14 bucket gathers
    assert ops["slice"] <= 36 and ops["cos"] == 1, ops


@pytest.mark.parametrize(
    "cand",
    [Candidate(dp_shard=4, param_dtype="float32"), Candidate(dp_shard=2, tp=2, remat="selective", microbatches=2)],
    ids=lambda c: c.label(),
)
def test_a_trace_runs_on_meta_tensors_and_peaks_where_a_fake_tensor_trace_does(cand, monkeypatch):
    """The trace runs the step on meta tensors: the same peak, collectives and op count as under FakeTensorMode
    (the trace before, whose device queries are not ops), at a fraction of the CPU (Llama 3 8B on 8 H100: 17.2 -> 6.4 s). SDPA picks its kernel by
    device and on meta takes the math path, which saves the whole score matrix (this Llama traced 14% high at
    fsdp 4): the trace runs the fused kernel CPU picks, forward and backward, in every block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import functitan.plan._trace as tracing
    from functitan.model import load_model

    kernels: Counter = Counter()
    real = tracing._StepMode._call

    def counted(self, func, args, kwargs):
        if "flash_attention" in func.__name__ or func.__name__.startswith("bmm"):
            kernels[func.__name__.split(".")[0]] += 1
        if func.__name__.startswith("mm") or "flash_attention" in func.__name__:
            kernels["meta" if args[0].device.type == "meta" else "not meta"] += 1
        return real(self, func, args, kwargs)

    monkeypatch.setattr(tracing._StepMode, "_call", counted)
    model = load_model("llama")
    mcfg = model.config("debug", **PLAN_TINY)
    base = JobConfig(model=ModelConfig(name="llama", flavor="debug", overrides=PLAN_TINY))
    cfg = job_config(base, cand, batch_size=BATCH, seq_len=SEQ)
    traced = trace_rank(cfg, model, mcfg, world=4, rank=0)
    calls = mcfg.n_layers * cand.microbatches  # selective remat saves attention's output: no recompute
    assert kernels["_scaled_dot_product_flash_attention_for_cpu"] == calls, kernels
    assert kernels["_scaled_dot_product_flash_attention_for_cpu_backward"] == calls, kernels
    assert kernels["bmm"] == 0 and kernels["not meta"] == 0 and kernels["meta"] > 0, kernels
    with tracing.rank_mesh(cfg.parallelism, 4, 0) as mesh:  # the same step under FakeTensorMode
        mode = tracing._StepMode(mesh)
        with FakeTensorMode():
            state, step, batch = tracing.build_step(cfg, model, mcfg, mesh, fake=True)
            fake = tracing._live_step(state, step, batch, live=mode)
    assert traced.peak == fake.peak and traced.comm == fake.comm, (traced.peak, fake.peak)
    # a fake step also dispatches the lift of each tensor made from Python data (``torch.tensor``): two here
    assert abs(traced.ops - fake.ops) <= 0.01 * fake.ops, (traced.ops, fake.ops)


def test_a_step_that_makes_a_cpu_tensor_is_traced_under_fake_tensors_to_the_same_bytes(tmp_path):
    """A user's model may make a tensor on an explicit device inside its step (``layout.positions`` defaults to
    ``device="cpu"``): on meta tensors that one is a real CPU tensor, and an op that meets both fails. The trace then
    runs under FakeTensorMode, which makes it fake too: the peak of the same model written device-agnostic."""
    from functitan.model import load_model

    src = (Path(__file__).parent / "assets" / "tiny_gpt.py").read_text()
    ln_f = "x = F.layer_norm(x, x.shape[-1:], top"
    assert ln_f in src
    shift = "x = x + torch.zeros(x.shape[-1], device={})\n    "  # the same bytes and ops either way
    peaks = []
    for name, where in (("agnostic", "x.device"), ("on_cpu", '"cpu"')):
        path = tmp_path / f"{name}.py"
        path.write_text(src.replace(ln_f, shift.format(where) + ln_f))
        model = load_model(str(path))
        base = JobConfig(model=ModelConfig(name=str(path), flavor="debug"))
        cfg = job_config(base, Candidate(dp_shard=2, param_dtype="float32"), batch_size=4, seq_len=16)
        t = trace_rank(cfg, model, model.config("debug"), world=2, rank=0)
        peaks.append((t.peak, t.ops))
    # the same bytes; the same ops within the lifts a fake step dispatches (its device queries are not ops)
    assert peaks[0][0] == peaks[1][0] > 0 and abs(peaks[0][1] - peaks[1][1]) <= 0.01 * peaks[0][1], peaks
