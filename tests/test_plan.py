"""functitan.plan: traced per-rank peaks against real gloo runs, the CLI as typed, its bad-input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import PLAN_TINY, cli

from functitan.config import parse_config
from functitan.job_config import JobConfig, ModelConfig
from functitan.plan import Candidate, job_config, model_shape, predict, young_heap
from functitan.plan._cli import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 32, 8

# FSDP, HSDP, TP+SP, PP (1F1B, ZB-V, ZB-H1), remat none/selective/full, bf16 params, accumulation, no reshard
LAYOUTS = [
    Candidate(dp_shard=4, remat="none", param_dtype="float32"),
    Candidate(dp_shard=4, remat="selective", param_dtype="bfloat16", microbatches=2),
    Candidate(dp_replicate=2, dp_shard=2, remat="full", param_dtype="float32"),
    Candidate(dp_shard=2, tp=2, remat="none", param_dtype="bfloat16"),
    Candidate(tp=4, remat="selective", param_dtype="float32", microbatches=2),
    Candidate(dp_shard=2, pp=2, schedule="1f1b", microbatches=2, remat="none", param_dtype="float32"),
    Candidate(
        dp_shard=2, pp=2, schedule="zb_v", stages_per_rank=2, microbatches=4, remat="full", param_dtype="float32"
    ),
    Candidate(dp_shard=4, reshard_after_forward=False, microbatches=2, param_dtype="bfloat16"),
    Candidate(tp=2, pp=2, schedule="zb_h1", microbatches=2, remat="none", param_dtype="float32"),
]
# context parallel: FSDP over dp_shard x cp, cp beside TP + SP and PP, each attention, remat (the K/V re-gathered)
CP_LAYOUTS = [
    Candidate(dp_shard=2, cp=2, remat="none", param_dtype="float32"),
    Candidate(cp=4, remat="none", param_dtype="float32"),
    Candidate(cp=2, tp=2, remat="selective", param_dtype="float32"),
    Candidate(dp_shard=2, cp=2, cp_attention="ring", remat="none", param_dtype="float32"),
    Candidate(cp=2, pp=2, schedule="1f1b", microbatches=2, cp_attention="ulysses", remat="full", param_dtype="float32"),
]


# mixture of experts (Qwen3-MoE, 4 blocks of 8 experts): expert parallelism over what it borrows from dp_shard,
# beside TP + SP and full remat, and MoE stages in a pipeline. A fake tensor has no values to route by: the trace
# gives its rank the plan's allowance over a balanced load (MOE_LOAD); the real steps route by their random router
MOE = {"n_layers": 4}
MOE_LAYOUTS = [  # (fsdp4 without ep, measured once: +0.24%, the dense families' path)
    Candidate(dp_shard=4, ep=2, remat="none", param_dtype="float32"),
    Candidate(dp_shard=4, ep=4, remat="none", param_dtype="float32"),
    Candidate(dp_shard=4, ep=2, remat="full", param_dtype="float32"),
    Candidate(dp_shard=2, ep=2, tp=2, remat="none", param_dtype="float32"),
    Candidate(dp_shard=2, pp=2, schedule="1f1b", microbatches=2, remat="none", param_dtype="float32"),
]


@pytest.fixture(autouse=True)
def _no_process_group():
    # earlier tests may leave this process's one-rank group (make_mesh() in-process); the planner needs its own
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# the other families at world 4, on the layouts the issue found wrong: full remat under FSDP and HSDP (2-4%
# under), FSDP x TP + SP (GPT-2 5% over), plain FSDP (at 4 blocks, extrapolated: 6.9% under before the 3 -> 4
# block traces); pipelining is the Llama test's (its predictions cost 5-7 s each)
FAMILIES = {  # 4 blocks: traced at 3 and 4 and extrapolated (at 2 and 3 GPT-2 was 6.9% under with fsdp4)
    "gpt2": {"n_layers": 4, "tie_embeddings": False},
    "qwen3": {"n_layers": 4, "tie_embeddings": False},
    "llama": {"n_layers": 3, "dim": 96, "n_heads": 6, "n_kv_heads": 2, "ffn_dim": 256},  # the odd Llama
}
FAMILY_LAYOUTS = [
    Candidate(dp_shard=4, remat="none", param_dtype="float32"),
    Candidate(dp_shard=4, remat="full", param_dtype="float32"),
    Candidate(dp_replicate=2, dp_shard=2, remat="full", param_dtype="float32"),
    Candidate(dp_shard=2, tp=2, remat="none", param_dtype="float32"),
]


def _base(name: str = "llama", overrides: dict = PLAN_TINY) -> JobConfig:
    return JobConfig(model=ModelConfig(name=name, flavor="debug", overrides=overrides))


def _model(name: str = "llama", overrides: dict = PLAN_TINY):
    from functitan.model import load_model

    model = load_model(name)
    return model, model.config("debug", **overrides)


def _measured_peaks(cases):
    """On each gloo rank: MemTracker's peak of one real train step per (family, overrides, layout), the trainer's
    functions on gloo."""
    import torch.distributed as dist

    from functitan.mesh import make_mesh
    from functitan.plan import build_step, step_peak, young_heap

    out = []
    with young_heap():  # one full garbage collection for all the cases, not one per step
        for name, overrides, c in cases:
            model, mcfg = _model(name, overrides)
            cfg = job_config(_base(name, overrides), c, batch_size=BATCH, seq_len=SEQ)
            mesh = make_mesh(
                dp_replicate=c.dp_replicate, dp_shard=c.dp_shard, tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep, device="cpu"
            )
            state, step, batch = build_step(cfg, model, mcfg, mesh, fake=False)
            out.append(step_peak(state, step, batch)[0])
            dist.barrier()
    return out


def _errors(gloo, cases, moe_load: float = 1.0) -> list[tuple[str, float, float, float]]:
    """``(case, predicted, measured worst rank, signed error)`` per case: the planner's prediction for CPU ranks
    (gloo's buffers counted; ``moe_load``: its routing allowance under ep), against every rank's real peak."""
    measuring = gloo.submit(_measured_peaks, 4, cases, timeout=900)  # the ranks measure while this predicts
    predicted = []
    with young_heap():
        for name, overrides, c in cases:
            model, mcfg = _model(name, overrides)
            shape = model_shape(model, mcfg, SEQ)
            base = _base(name, overrides)
            p = predict(base, model, mcfg, shape, c, batch_size=BATCH, seq_len=SEQ, backend="gloo", moe_load=moe_load)
            predicted.append(p.peak)
    per_rank = measuring()
    rows = []
    for i, ((name, _, c), p) in enumerate(zip(cases, predicted)):
        m = max(r[i] for r in per_rank)
        rows.append((f"{name} {c.label()}", p, m, (p - m) / m))
        print(f"{rows[-1][0]:<48} predicted {p:>10.0f} measured {m:>10.0f} error {100 * rows[-1][3]:+.2f}%")
    return rows


def test_predicted_peak_matches_real_runs(gloo):
    """Llama on nine layouts (FSDP, HSDP, TP + SP, PP 1F1B / ZB-V / ZB-H1, every remat, bf16, accumulation, no
    reshard): within 3% of the worst rank's real peak, and never more than 1% under it. (Before the trace counted
    the receive buffer of functitan's gloo reduce-scatter, FSDP layouts were up to 9% under.)"""
    rows = _errors(gloo, [("llama", PLAN_TINY, c) for c in LAYOUTS])
    assert all(-0.01 <= err <= 0.03 for *_, err in rows), rows


def test_predicted_peaks_of_three_families_hold_the_bounds(gloo):
    """GPT-2 and Qwen3 at 4 blocks and the issue's odd Llama (3 layers, dim 96, 6 / 2 heads) on four layouts each:
    within 3%, never more than 1% under the worst rank (full remat was 2-9% under, GPT-2's fsdp2 x tp2+sp 5%
    over)."""
    rows = _errors(gloo, [(name, ov, c) for name, ov in FAMILIES.items() for c in FAMILY_LAYOUTS])
    assert all(-0.01 <= err <= 0.03 for *_, err in rows), rows


def test_predicted_peaks_of_context_parallel_layouts_hold_the_bounds(gloo):
    """Llama under cp 2 x fsdp 2, cp 4, cp 2 x tp 2 + SP, ring, and pp 2 x cp 2 Ulysses with full remat: within 3%
    of the worst rank's real peak, never more than 1% under it (the issue asks 5%)."""
    rows = _errors(gloo, [("llama", PLAN_TINY, c) for c in CP_LAYOUTS])
    assert all(-0.01 <= err <= 0.03 for *_, err in rows), rows


def test_predicted_peaks_of_moe_layouts_hold_the_bounds(gloo):
    """Qwen3-MoE under fsdp 4 x ep 2 (with and without full remat), ep 4, ep 2 x tp 2 + SP and pp 2: within
    5% of the worst rank's real peak (the issue's bound), never more than 1% under it, and never under it at all
    under ep. A balanced trace was 0.28-0.92% under every ep layout: a real step's busiest ep rank received up to
    1.36x (ep 2) and 1.56x (ep 4) its share of a layer's rows; the plan's allowance (MOE_LOAD, 1.25x on the
    traced rank) gave +4.59, +4.28, +0.71, +3.23% and pp 2 (no ep) -0.01%."""
    from functitan.plan import MOE_LOAD

    rows = _errors(gloo, [("qwen3_moe", MOE, c) for c in MOE_LAYOUTS], moe_load=MOE_LOAD)
    assert all(-0.01 <= err <= 0.05 for *_, err in rows), rows
    assert all(err >= 0 for c, (*_, err) in zip(MOE_LAYOUTS, rows) if c.ep > 1), rows


def test_under_ep_a_rank_holds_the_dense_params_of_fsdp_without_ep_traced_and_by_formula():
    """Expert parallelism borrows ranks from dp_shard; the dense params stay FSDP-sharded over the whole dp_shard
    (torchtitan's layout), so a rank's params equal fsdp 4's under ep 2 and ep 4. Before, the dense params were
    sharded over what ep left: ep 4 held 1.9x and ep 2 1.3x fsdp 4's bytes, traced and in the screen's formula."""
    from functitan.plan._cost import analytic_memory
    from functitan.plan._plan import model_dims
    from functitan.plan._trace import trace_rank

    model, mcfg = _model("qwen3_moe", MOE)
    dims = model_dims(model, mcfg, model_shape(model, mcfg, SEQ))
    held = {}
    for ep in (1, 2, 4):
        c = Candidate(dp_shard=4, ep=ep, remat="none", param_dtype="float32")
        cfg = job_config(_base("qwen3_moe", MOE), c, batch_size=BATCH, seq_len=SEQ)
        formula = analytic_memory(c, dims, seq_len=SEQ, batch_size=BATCH, blocks=MOE["n_layers"])["params"]
        held[ep] = (trace_rank(cfg, model, mcfg, world=4, rank=0).params, formula)
    assert held[1][0] == held[2][0] == held[4][0]  # 281,920 bytes (ep 2: 366,720 and ep 4: 536,320 before)
    assert all(abs(f - t) <= 0.005 * t for t, f in held.values()), held


def test_a_tensor_parallel_steps_measured_peak_is_the_same_every_run(gloo):
    """The measured side of the bounds above: GPT-2 under fsdp2 x tp2 + SP, stepped five times per rank, peaks
    at the same bytes each time. Gloo's collectives released their tensors on a worker thread after ``wait()``
    returned, so an SP shard's contiguous copy lived on for a few ops or not: one run in two moved some rank's
    peak by 16-48 KiB (-1.55% against the prediction, outside the bound). ``_collectives.all_gather_now``."""
    case = ("gpt2", FAMILIES["gpt2"], Candidate(dp_shard=2, tp=2, remat="none", param_dtype="float32"))
    per_rank = gloo.submit(_measured_peaks, 4, [case] * 5, timeout=900)()
    assert all(len(set(peaks)) == 1 for peaks in per_rank), per_rank


def test_young_heap_collects_once_and_a_nested_block_keeps_the_outer_freeze():
    """Every traced or measured step collects garbage first; inside ``young_heap`` the heap that was alive before
    is frozen out of those collections (a full one took 0.2-0.5 s, a fifth of this file's CPU). A nested block (a
    prediction inside a plan or a test's loop) must not unfreeze the outer block's heap, and the outermost block
    leaves nothing frozen."""
    import gc

    assert gc.get_freeze_count() == 0
    with young_heap():
        frozen = gc.get_freeze_count()  # a frozen object that is freed leaves the count: it only shrinks a little
        assert frozen > 0
        with young_heap():
            assert frozen // 2 < gc.get_freeze_count() <= frozen
        assert frozen // 2 < gc.get_freeze_count() <= frozen  # the nested block did not unfreeze
    assert gc.get_freeze_count() == 0


def test_plan_help():
    r = cli("plan", "--help")
    assert r.returncode == 0
    assert "--global-batch-tokens" in r.stdout and "--calibrate" in r.stdout and "--measure" in r.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--device", "tpu9"],
            "--device='tpu9' is not in the device table; choose one of ['a100', 'cpu', 'h100', 'h200']",
        ),
        (["--model.name", "nosuchmodel"], "model.name='nosuchmodel' is not an installed model"),
        (
            [
                "--model.flavor",
                "llama3_405b",
                "--device",
                "a100",
                "--nodes",
                "1",
                "--gpus-per-node",
                "1",
                "--global-batch-tokens",
                "8192",
                "--seq-len",
                "8192",
                "--top",
                "1",
            ],
            "no layout fits in 79.2 GiB per device (a100) with 10% of 73.2 GiB usable left free; the smallest needs",
        ),
        (
            ["--gpus-per-node", "7", "--global-batch-tokens", "2048", "--seq-len", "256"],
            "no layout uses all 7 devices (1 x 7)",
        ),
        (["--top", "0"], "--top=0: show at least one candidate, e.g. --top 4"),
    ],
)
def test_plan_bad_input(argv, message, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "0"], "--seq-len=0: must be >= 1"),
        (["--seq-len=-8"], "--seq-len=-8: must be >= 1"),
        (["--seq-len", "abc"], "--seq-len='abc' is not a valid int"),
        (["--global-batch-tokens", "0"], "--global-batch-tokens=0: must be >= 1"),
        (["--nodes", "0"], "--nodes=0 --gpus-per-node=8: both must be >= 1"),
        (["--measure", "-1", "--device", "cpu"], "--measure=-1: the steps to train each top candidate"),
        (["--moe-load", "0.5"], "--moe-load=0.5: the busiest ep rank's routed rows over the mean, >= 1, e.g. 1.25"),
        (["--moe-load", "inf"], "--moe-load=inf: the busiest ep rank's routed rows over the mean, >= 1, e.g. 1.25"),
        # argparse took --gpus for --gpus-per-node and planned 490 lines into a self-contradicting error
        (["--gpus", "8"], "unrecognized arguments: --gpus 8"),
        (["--node=2"], "unrecognized arguments: --node=2"),
        # every trace failed on the 8192 default above the debug model's 1024, then said the smallest needs 6 GiB
        (
            ["--seq-len", "8192"],
            "--seq-len=8192 exceeds model.max_seq_len=1024 of llama debug; use --seq-len 1024 or less",
        ),
        # an H100 plan measured here trained on this machine's CPU and died with a traceback per rank
        (["--measure", "2"], "--measure 2 trains the top layouts here, on this machine's CPU (gloo); a plan for"),
    ],
)
def test_plan_bad_input_is_one_line_before_any_tracing(argv, message, capsys, monkeypatch):
    """Issue 30's bad inputs through the ``functitan`` entry point: one line, exit 2, and no tracing begun."""
    import functitan.cli
    import functitan.plan._plan as planner

    def no_trace(*args, **kwargs):
        raise AssertionError("traced a layout for bad input")

    monkeypatch.setattr(planner, "predict", no_trace)
    assert functitan.cli.main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith("functitan: error: ")
    assert "Traceback" not in captured.err and captured.out == ""


def test_default_seq_len_is_capped_at_the_models_maximum(monkeypatch):
    """The 8192 default of a GPU plan is above the debug model's max_seq_len=1024: it plans at 1024 and says so
    (it traced every layout at 8192, each failing, and ended in 'no layout fits')."""
    import functitan.plan._plan as planner
    from functitan.plan import Cluster, device

    def fake_trace(job, c, mem, blocks):
        t = planner.step_time(c, job.cluster, {}, flops_per_token=1.0, tokens=1, n_blocks=1)
        return planner.Row(cand=c, peak=1.0, parts={}, analytic=mem, time=t, fits=True)

    monkeypatch.setattr(planner, "_traced_row", fake_trace)
    result = planner.plan(
        model_name="llama", flavor="debug", overrides={}, cluster=Cluster(device=device("h100"), nodes=1, per_node=8)
    )
    assert result.cfg.training.seq_len == 1024
    assert result.cfg.training.batch_size == 8 * 8  # 8 sequences per device
    assert "--seq-len: 1024 (the default 8192 capped at model.max_seq_len)" in result.assumptions


def test_plan_writes_a_config_the_trainer_runs(tmp_path, gloo):
    out = tmp_path / "plan.toml"
    assert (
        plan_main(
            [
                "--device",
                "cpu",
                "--gpus-per-node",
                "1",
                "--global-batch-tokens",
                "512",
                "--seq-len",
                "64",
                "--model.n_layers=2",
                "--model.dim=64",
                "--model.n_heads=4",
                "--model.ffn_dim=128",
                "--top",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    cfg = parse_config(JobConfig, ["--config", str(out)])
    assert cfg.model.overrides["n_layers"] == 2 and cfg.training.batch_size == 8 and cfg.training.seq_len == 64
    # the trainer as `functitan train --config plan.toml` runs it (the CLI's own process start is tested in
    # test_train.py): on a pool rank, which already paid for torch and its group
    argv = ["--config", str(out), "--training.steps=2", f"--metrics.run_dir={tmp_path}"]
    assert gloo.run(_train_from_argv, 1, argv) == [2]


def _train_from_argv(argv: list[str]) -> int:
    from functitan.train import run

    return run(parse_config(JobConfig, argv))["state"].step


def test_top_shows_fewer_rows_but_recommends_the_same_layout(monkeypatch):
    """``--top`` only chooses how many rows to show: a smaller one traces as many candidates (MIN_TRACED), so
    the recommendation cannot change with it (it did: --top 3 traced fewer than --top 8 and recommended other
    microbatches). Traces are stubbed: the n-th traced candidate is the n-th fastest from the last, so the
    fastest is the last one a smaller budget would have traced."""
    import functitan.plan._plan as planner
    from functitan.plan import Cluster, device

    def run(top: int):
        traced = []

        def fake_trace(job, c, mem, blocks):
            traced.append(c.label())
            t = planner.step_time(c, job.cluster, {}, flops_per_token=1.0, tokens=1, n_blocks=1)._replace(
                total=10.0 - len(traced)
            )
            return planner.Row(cand=c, peak=1.0, parts={}, analytic=mem, time=t, fits=True)

        monkeypatch.setattr(planner, "_traced_row", fake_trace)
        cluster = Cluster(device=device("h100"), nodes=1, per_node=4)
        result = planner.plan(
            model_name="llama", flavor="debug", overrides=PLAN_TINY, cluster=cluster, global_batch_tokens=BATCH * SEQ,
            seq_len=SEQ, top=top, log=lambda *a: None,
        )  # fmt: skip
        return result, traced

    (one, traced_one), (four, traced_four) = run(1), run(4)
    assert len(one.rows) == 1 and len(four.rows) == 4
    assert traced_one == traced_four and len(traced_one) == planner.MIN_TRACED
    assert one.rows[0].cand == four.rows[0].cand and one.rows[0].cand.label() == traced_one[-1]
    assert one.cfg == four.cfg


def _row(label: str, step_s: float, peak_gib: float, limit: float):
    """A synthetic traced row: ``label`` names it (through the microbatch count), no tracing."""
    from functitan.plan import Cluster, Row, device
    from functitan.plan._cost import step_time

    c = Candidate(dp_shard=8, microbatches=int(label))
    t = step_time(c, Cluster(device=device("h100"), nodes=1, per_node=8), {}, flops_per_token=1.0, tokens=1, n_blocks=1)
    peak = peak_gib * 2**30
    return Row(cand=c, peak=peak, parts={}, analytic={"total": peak}, time=t._replace(total=step_s), fits=peak <= limit)


def test_ties_go_to_headroom_and_the_margin_is_never_recommended():
    """Issue 30's 8B choice: FSDP 8 without remat at 73.35 of 73.6 GiB usable won over a layout at 49 GiB with
    the same predicted time. Now a layout inside the margin is 'tight' and never first, and step times within
    the cost model's error (TIME_TOLERANCE) are a tie broken toward the most headroom."""
    from functitan.plan import Plan, device, rank, table
    from functitan.plan._cost import TIME_TOLERANCE

    usable = device("h100").usable  # 73.6 GiB
    limit = usable * 0.9
    rows = [
        _row("1", 1.00, 60.0, limit),  # fastest that fits, 13.6 GiB free
        _row("2", 1.03, 40.0, limit),  # 3% slower (a tie): 33.6 GiB free
        _row("3", 0.99, 73.35, limit),  # fastest of all, 0.25 GiB free: inside the 10% margin
        _row("4", 1.20, 10.0, limit),  # 20% slower: not a tie whatever its headroom
        _row("5", 0.90, 80.0, limit),  # does not fit at all
    ]
    assert TIME_TOLERANCE == 0.05
    order = [r.cand.microbatches for r in rank(rows, tolerance=TIME_TOLERANCE)]
    assert order == [2, 1, 4, 5, 3]  # fitting by (tie -> headroom), then the rest by time
    assert [r.cand.microbatches for r in rank(rows, tolerance=0.0)] == [1, 2, 4, 5, 3]
    # headroom counts up to twice the margin (plan's comfortable peak: usable less 20%, 58.9 GiB): beyond it
    # the faster of a tie goes first (60 GiB is under it: the tie above still goes to 40 GiB)
    comfortable = usable * 0.8
    assert [r.cand.microbatches for r in rank(rows, comfortable=comfortable)] == [2, 1, 4, 5, 3]
    roomy = [_row("6", 1.00, 50.0, limit), _row("7", 1.03, 20.0, limit)]
    assert [r.cand.microbatches for r in rank(roomy, comfortable=comfortable)] == [6, 7]
    assert [r.cand.microbatches for r in rank(roomy)] == [7, 6]
    shown = table(Plan(rows=rank(rows), pruned=None, screened=5, over_memory=0, cfg=None, assumptions=[],
                       seconds=0, cpu_seconds=0, usable=usable, margin=0.1))  # fmt: skip
    lines = {ln.split()[1] + ln.split()[2]: ln for ln in shown.splitlines() if ln[:2].strip().isdigit()}
    assert lines["fsdp8m2"].split()[7:10] == ["33.60", "45.7%", "yes"]  # headroom GiB, % of usable, fits
    assert lines["fsdp8m3"].split()[7:10] == ["0.25", "0.3%", "tight"]
    assert lines["fsdp8m5"].split()[7:10] == ["-6.40", "-8.7%", "NO"]
    assert "recommended: fsdp8 m2 remat=none bf16" in shown


def test_plan_keeps_the_margin_free(monkeypatch):
    """``plan(margin=...)`` decides what fits: the fastest traced layout at 95% of usable memory is recommended
    with no margin and passed over with the default 10%."""
    import functitan.plan._plan as planner
    from functitan.plan import Cluster, device

    def fake_trace(job, c, mem, blocks):
        first = not traced
        traced.append(c)
        peak = job.cluster.device.usable * (0.95 if first else 0.5)
        t = planner.step_time(c, job.cluster, {}, flops_per_token=1.0, tokens=1, n_blocks=1)
        return planner.Row(cand=c, peak=peak, parts={}, analytic=mem, time=t._replace(total=1.0 + 0.1 * len(traced)),
                           fits=peak <= job.limit)  # fmt: skip

    monkeypatch.setattr(planner, "_traced_row", fake_trace)
    cluster = Cluster(device=device("h100"), nodes=1, per_node=4)
    chosen = []
    for margin in (0.0, planner.MARGIN):
        traced: list = []
        result = planner.plan(
            model_name="llama", flavor="debug", overrides=PLAN_TINY, cluster=cluster, global_batch_tokens=BATCH * SEQ,
            seq_len=SEQ, margin=margin, log=lambda *a: None,
        )  # fmt: skip
        chosen.append((result.rows[0].cand == traced[0], result.margin))
    assert chosen == [(True, 0.0), (False, 0.1)]


@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[3], LAYOUTS[2]], ids=lambda c: c.label())
def test_live_bytes_counts_what_memtracker_counts(layout):
    """The planner's tracker (a third cheaper per op), alone and as the trace's one dispatch mode (which also
    answers host reads and counts ops and collectives), gives torch's MemTracker's peak to the byte on one traced
    step (meta tensors): FSDP with selective remat and accumulation, TP + SP (DTensor), HSDP with full remat."""
    from functitan.plan import build_step, step_peak
    from functitan.plan._trace import _HostReads, _live_step, _OnMeta, _StepMode, rank_mesh

    model, mcfg = _model()
    cfg = job_config(_base(), layout, batch_size=BATCH, seq_len=SEQ)
    peaks = []
    with young_heap(), rank_mesh(cfg.parallelism, 4, 0) as mesh:
        for tracker in ("memtracker", "live", "step"):  # the planner's one mode: live bytes, host reads, counts
            step_mode = _StepMode(mesh)  # built outside the meta context (it reads the mesh)
            with _OnMeta():
                state, step, batch = build_step(cfg, model, mcfg, mesh, fake=True)
                if tracker == "memtracker":
                    peaks.append(step_peak(state, step, batch, _HostReads(), warm_up=False)[0])
                elif tracker == "live":
                    peaks.append(_live_step(state, step, batch, _HostReads()).peak)
                else:
                    peaks.append(_live_step(state, step, batch, live=step_mode).peak)
                    assert step_mode.ops > 0 and step_mode.comm
    assert peaks[0] == peaks[1] == peaks[2] and peaks[0] > 500_000, peaks


def test_candidates_with_the_same_degrees_share_one_mesh(monkeypatch):
    """A plan keeps its fake world and meshes from one candidate to the next (``_trace.Worlds``): at 16,384 ranks a
    mesh took 0.8 s to build, a third of a 405B candidate's trace. Layouts that differ in remat or microbatches only
    trace on one mesh, a pipeline's last rank restarts the world, and every prediction is the one a fresh world
    gives."""
    import functitan.plan._trace as tracing

    model, mcfg = _model()
    shape, base = model_shape(model, mcfg, SEQ), _base()
    built: list = []
    make = tracing.make_mesh
    monkeypatch.setattr(tracing, "make_mesh", lambda **kw: built.append(kw) or make(**kw))
    cands = [
        Candidate(dp_shard=4, remat="none", param_dtype="float32"),
        Candidate(dp_shard=4, remat="full", param_dtype="float32", microbatches=2),
        Candidate(dp_shard=2, pp=2, schedule="1f1b", microbatches=2, param_dtype="float32"),
        Candidate(dp_shard=4, remat="selective", param_dtype="float32"),
    ]
    with tracing.fake_worlds() as worlds:
        shared = [predict(base, model, mcfg, shape, c, batch_size=BATCH, seq_len=SEQ, worlds=worlds) for c in cands]
    # fsdp4 once for the first two; pp2 on rank 0, then on its last rank (a new world); fsdp4 again on rank 0
    assert [kw["pp"] for kw in built] == [1, 2, 2, 1], built
    fresh = [predict(base, model, mcfg, shape, c, batch_size=BATCH, seq_len=SEQ) for c in cands]
    assert shared == fresh


def test_schedules_that_cut_the_same_stages_share_one_balance():
    """1F1B and ZB-H1 on 4 ranks, interleaved 1F1B and ZB-V on 2 (two stages each) cut the model into the same 4
    stages: the exact balance (a dynamic program, 1.6 s of the 405B screen when each schedule ran its own) runs
    once, and each schedule's blocks per rank are the trainer's."""
    from functitan import pipeline
    from functitan.job_config import ParallelismConfig, build_schedule
    from functitan.plan._predict import _blocks_per_rank, _layers, rank_blocks

    model, mcfg = _model("llama", {**PLAN_TINY, "n_layers": 10})
    shape = model_shape(model, mcfg, SEQ)
    _layers.cache_clear()
    _blocks_per_rank.cache_clear()
    for pp, sched, v in ((4, "1f1b", 1), (4, "zb_h1", 1), (2, "interleaved_1f1b", 2), (2, "zb_v", 2)):
        got = rank_blocks(shape, Candidate(pp=pp, schedule=sched, stages_per_rank=v, microbatches=4))
        par = ParallelismConfig(pp=pp, pipeline_schedule=sched, stages_per_rank=v)
        assert got == pipeline.blocks_per_rank(shape.stage_model, build_schedule(par, pp * v)), (sched, got)
    assert _layers.cache_info().misses == 1, _layers.cache_info()


def test_a_kind_traced_over_memory_is_not_traced_again(monkeypatch):
    """Prune by the traces before tracing more: once a selective-remat layout traces at 3x its formula beyond
    params, grads and optimizer state (as the 405B's did: 111 GiB traced, 51 by formula), a later selective
    layout that the formula so scaled puts over memory is not traced; one it keeps under the limit, and other
    kinds, still are."""
    from collections import Counter

    import functitan.plan._plan as planner
    from functitan.plan import Cluster, device

    traced: list = []

    def fake_trace(job, c, mem, blocks):
        traced.append(c.microbatches)
        states = mem["params"] + mem["grads"] + mem["opt_state"]
        peak = states + (mem["total"] - states) * (3.0 if c.remat == "selective" else 1.0)
        t = planner.step_time(c, job.cluster, {}, flops_per_token=1.0, tokens=1, n_blocks=1)
        return planner.Row(cand=c, peak=peak, parts={}, analytic=mem, time=t, fits=peak <= job.limit)

    monkeypatch.setattr(planner, "_traced_row", fake_trace)

    def entry(n: int, remat: str, total: float):  # a screened candidate: 10 bytes of params, grads, state
        mem = {"params": 4.0, "grads": 4.0, "opt_state": 2.0, "total": total}
        return (Candidate(dp_shard=4, microbatches=n, remat=remat), mem, None, 4)

    cluster = Cluster(device=device("h100"), nodes=1, per_node=4)
    job = planner._Job(None, None, None, None, cluster, 8, 32, 1.0, 100.0, 1.0)  # a 100-byte limit
    fitting = [entry(1, "selective", 50.0), entry(2, "selective", 45.0), entry(3, "full", 60.0),
               entry(4, "selective", 30.0), entry(5, "none", 90.0)]  # fmt: skip
    pruned: Counter = Counter()
    rows = planner._trace_best(job, fitting, len(fitting), 4, pruned, log=lambda *a: None)
    assert traced == [1, 3, 4, 5]  # 2: 10 + 3 x 35 = 115 bytes > 1.05 x the limit; 4: 10 + 3 x 20 = 70 fits
    assert pruned == Counter(
        {"remat=selective: over memory by the formula scaled to the traced layouts of its kind (not traced)": 1}
    )
    assert [r.fits for r in rows] == [False, True, True, True]


def test_the_screen_simulates_a_pipeline_only_when_the_tracing_reaches_it():
    """``_fastest_first`` yields the screen by step time, as a sort would (ties in screen order), but times a
    pipelined layout (a simulation of its schedule) only once the layouts before it by a lower bound (its time
    without the bubble) are out: the 405B screen simulated ~90 schedules (2.5 s) for a tracing that takes a
    dozen layouts."""
    from types import SimpleNamespace

    import functitan.plan._plan as planner

    # (name, pp, time without the bubble, time with it)
    layouts = [("a", 1, 1.0, 1.0), ("p", 2, 2.0, 4.0), ("q", 2, 2.5, 10.0), ("b", 1, 3.0, 3.0),
               ("c", 1, 4.0, 4.0), ("r", 2, 6.0, 7.0), ("d", 1, 5.0, 5.0)]  # fmt: skip
    screen = [(SimpleNamespace(pp=pp, name=name), {}, 1) for name, pp, _, _ in layouts]
    times = {name: (bound, exact) for name, _, bound, exact in layouts}
    simulated: list = []

    def exact(c, mem, blocks):
        if c.pp > 1:
            simulated.append(c.name)
        return c, mem, SimpleNamespace(total=times[c.name][1]), blocks

    def bound(c, mem, blocks):
        return c, mem, SimpleNamespace(total=times[c.name][0]), blocks

    ordered = planner._fastest_first(screen, exact=exact, bound=bound)
    first = [next(ordered)[0].name for _ in range(4)]
    assert first == ["a", "b", "p", "c"] and simulated == ["p", "q"]  # r (at least 6.0) not yet
    assert first + [e[0].name for e in ordered] == ["a", "b", "p", "c", "d", "r", "q"]
    assert simulated == ["p", "q", "r"]


def test_a_fake_world_makes_only_its_ranks_groups(monkeypatch):
    """``DeviceMesh`` makes every group of every axis (``new_group`` is collective for real ranks): 8,192 for a
    tp 2 axis at 16,384 ranks, seconds of each 405B candidate. The planner's fake world makes only the rank's
    own, and its mesh has the groups a real rank's would."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from functitan.plan._trace import rank_mesh

    made: list = []
    real = c10d._new_group_with_tag
    monkeypatch.setattr(c10d, "_new_group_with_tag", lambda *a, **kw: made.append(1) or real(*a, **kw))
    par = job_config(_base(), Candidate(dp_shard=8192, tp=2), batch_size=8192, seq_len=SEQ).parallelism
    with rank_mesh(par, 16384, 5) as mesh:
        assert dist.get_process_group_ranks(mesh["tp"].get_group()) == [4, 5]
        assert dist.get_process_group_ranks(mesh["dp_shard"].get_group()) == list(range(1, 16384, 2))
    assert 0 < len(made) < 20, len(made)  # its own group of each axis and flattened axis (73,730 before)


def test_a_model_file_whose_loss_takes_positional_arguments_is_traced():
    """The planner called ``loss(params, batch, cfg=..., layout=...)`` by keyword; the Model contract (and
    tests/assets/tiny_gpt.py) name them otherwise: ``loss(params, batch, c, layout)``."""
    from functitan.model import load_model
    from functitan.plan import trace_rank

    model = load_model(str(ROOT / "tests" / "assets" / "tiny_gpt.py"))
    mcfg = model.config("debug")
    base = JobConfig(model=ModelConfig(name=str(ROOT / "tests" / "assets" / "tiny_gpt.py"), flavor="debug"))
    cfg = job_config(base, Candidate(dp_shard=2, param_dtype="float32"), batch_size=4, seq_len=16)
    traced = trace_rank(cfg, model, mcfg, world=2, rank=0)
    assert traced.ops > 0 and traced.peak > 0


def test_context_parallel_candidates_keep_enough_tokens_per_rank_and_pass_the_trainers_checks():
    """cp degrees are offered while each cp rank keeps ``min_cp_tokens`` of a sequence, beside every tp, with the
    attentions asked for; the trainer's ``check_model`` prunes what it would refuse (Ulysses' heads over tp x cp),
    under its own message; the candidate's config carries cp and its attention."""
    from functitan.plan._candidates import enumerate_candidates

    model, mcfg = _model()  # 8 heads, 4 kv heads
    kw = dict(world=8, per_node=8, batch_size=8, n_blocks=4, param_dtypes=("float32",), min_cp_tokens=16)
    cands, pruned = enumerate_candidates(model, mcfg, seq_len=64, cp_attentions=("allgather", "ulysses"), **kw)
    assert {c.cp for c in cands} == {1, 2, 4}  # cp 8 would keep 8 tokens a rank
    assert all(c.world == 8 and c.fsdp == c.dp_shard * c.cp for c in cands)
    pairs = {(c.cp, c.tp, c.cp_attention) for c in cands}
    assert {(2, 2, "ulysses"), (4, 1, "ulysses"), (4, 2, "allgather"), (2, 4, "allgather")} <= pairs
    assert (4, 2, "ulysses") not in pairs and (2, 4, "ulysses") not in pairs  # 8 heads, 4 kv heads over 8 ranks
    why = {k: n for k, n in pruned.items() if k.startswith("cp")}
    assert why == {
        "cp > 1 with fewer than 16 tokens of a sequence per cp rank: not offered (a batch split holds as many "
        "tokens per rank without the K/V traffic)": 1,
        "cp=4 x tp=2 ulysses: parallelism.cp_attention=ulysses splits attention's heads over tp=2 x cp=4 = 8 "
        "ranks, but the model has 8 heads and 4 kv heads": 1,
        "cp=2 x tp=4 ulysses: parallelism.cp_attention=ulysses splits attention's heads over tp=4 x cp=2 = 8 "
        "ranks, but the model has 8 heads and 4 kv heads": 1,
    }, why
    short, _ = enumerate_candidates(model, mcfg, seq_len=16, **kw)
    assert {c.cp for c in short} == {1}
    c = next(c for c in cands if (c.cp, c.tp, c.cp_attention, c.dp_shard) == (4, 1, "ulysses", 2))
    par = job_config(_base(), c, batch_size=8, seq_len=64).parallelism
    assert (par.cp, par.cp_attention, par.dp_shard, par.tp) == (4, "ulysses", 2, 1)
    assert c.label().startswith("fsdp2 cp4:ulysses ")


def test_llama3_8b_at_131k_tokens_on_64_h100_recommends_context_parallel():
    """Issue 27's case: Llama 3 8B at seq 131,072 on 8 x 8 H100, 16 sequences a step (32K tokens a GPU, as
    torchtitan's 8B at 262K on CP 8). No traced layout without cp fits (a whole sequence's activations per rank);
    the recommendation splits the sequence and keeps the margin (docs/autotune.md shows the table). The plan
    takes seconds: 11 s of CPU here, 32 s before the traces ran on meta tensors (issue 30 asks 15 s for a plan;
    the bound leaves room for a loaded machine)."""
    import functitan.plan._plan as planner
    from functitan.plan import Cluster, device

    seq = 131072
    result = planner.plan(
        model_name="llama", flavor="llama3_8b", overrides={"max_seq_len": seq},
        cluster=Cluster(device=device("h100"), nodes=8, per_node=8), global_batch_tokens=16 * seq, seq_len=seq,
        log=lambda *a: None,
    )  # fmt: skip
    best = result.rows[0]
    assert best.cand.cp > 1 and best.fits and best.peak <= device("h100").usable * (1 - planner.MARGIN), best
    assert not [r.cand.label() for r in result.rows if r.fits and r.cand.cp == 1]
    assert result.cfg.parallelism.cp == best.cand.cp
    assert result.cpu_seconds < 25, result.cpu_seconds
