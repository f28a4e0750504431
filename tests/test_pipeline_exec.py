"""The pipeline executor: every schedule on PP 2 and PP 4 (and PP x FSDP) trains like one process.

Each distributed run trains the tiny Llama for 5 steps (AdamW, clipping that binds) under every schedule in
turn and returns the losses, the full gradient norms and the final params; the reference is
``accumulate(value_and_grad(llama.loss), microbatches)`` in this process. fp32; the pipeline sums the
microbatch gradients in another order (scaled loss per microbatch, FSDP reduce-scatters), and AdamW's
m / sqrt(v) amplifies rounding on tiny gradients, so losses and norms agree to 2e-5 / 1e-4 and params to
2e-4 / 1e-3 (absolute / relative; see PARAM_TOL).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from functitan import optim, pipeline
from functitan.mesh import make_mesh
from functitan.random import PRNGKey
from functitan.sharding import Layout, default_rules
from functitan.step import make_train_step
from functitan.train_state import TrainState
from functitan.transforms import accumulate, value_and_grad
from functitan.tree import flatten_with_names
from models import llama

CFG = llama.config("debug", dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
SEQ, BATCH, STEPS, LR, MAX_NORM = 16, 8, 5, 1e-2, 0.5
SCHEDULES = pipeline.SCHEDULE_NAMES
TOL = dict(atol=2e-5, rtol=1e-4)
# params: one embedding row of a token seen once (index 10) is AdamW-amplified rounding: 1.06e-4 off with the
# per-contraction TP input reduces, 1.27e-4 with q/k/v's summed first (Layout.einsums), against 1.13e-4 allowed
# at 1e-4 / 1e-3; every other element agrees to < 1e-5
PARAM_TOL = dict(atol=2e-4, rtol=1e-3)


def _schedule(name: str, pp: int, m: int) -> pipeline.Schedule:
    return pipeline.make_schedule(name, pp, m)


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def _init() -> dict:
    return llama.init(CFG, PRNGKey(0))


def _reference(m: int):
    params = _init()
    loss_fn = lambda p, b: llama.loss(p, b, CFG)  # noqa: E731
    opt = optim.adamw(LR)
    step = make_train_step(accumulate(value_and_grad(loss_fn), m), opt, max_norm=MAX_NORM)
    state = TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=0)
    losses, norms = [], []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    return losses, norms, {n: p.detach() for n, p in flatten_with_names(state.params)[0]}


# ----------------------------------------------------------------------------------------------- workers


def _train_schedules(
    pp: int, m: int, names: tuple[str, ...], dp_shard: int = 1, tp: int = 1, sp: bool = False, reshard: bool = True
) -> dict:
    """On every rank: for each schedule, 5 pipelined steps; returns {name: (losses, norms, params by name)}."""
    mesh = make_mesh(pp=pp, dp_shard=dp_shard, tp=tp)
    rules = default_rules(sequence_parallel=sp)
    layout = Layout(pipeline.stage_mesh(mesh), pipeline.stage_rules(rules), reshard_after_forward=reshard)
    model = llama.stage_model(CFG, layout, seq_len=SEQ)
    out = {}
    for name in names:
        stages = pipeline.make_stages(model, _schedule(name, pp, m), mesh)
        params = pipeline.place_stages(_init(), llama.specs(CFG), rules, stages)
        opt = optim.adamw(LR)
        # the step's norm (reported and used to clip) spans every stage through the pp group
        step = make_train_step(pipeline.pipeline_grad_fn(stages), opt, max_norm=MAX_NORM, norm_across=stages.pp_group)
        state = TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=0)
        losses, norms = [], []
        dp, dp_rank = layout.dp_size, layout.dp_rank
        for batch in _batches():
            local = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
            state, metrics = step(state, local)
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        full = {n: p.full_tensor().detach() for n, p in flatten_with_names(state.params)[0]}
        out[name] = (losses, norms, full)
    return out


def _merge(results: list[dict], name: str):
    losses, norms = results[0][name][0], results[0][name][1]
    params: dict[str, torch.Tensor] = {}
    for r in results:
        assert r[name][0] == pytest.approx(losses, abs=1e-6)  # every pp rank reports the same loss
        params.update(r[name][2])
    return losses, norms, params


def _check(results: list[dict], name: str, reference) -> None:
    ref_losses, ref_norms, ref_params = reference
    assert ref_norms[0] > MAX_NORM  # clipping binds, so a wrong norm would change the params
    losses, norms, params = _merge(results, name)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
    assert params.keys() == ref_params.keys()
    for n, p in params.items():
        torch.testing.assert_close(p, ref_params[n], **PARAM_TOL, msg=lambda msg, n=n: f"{name}, {n}: {msg}")


@pytest.fixture(scope="module")
def reference4():
    return _reference(4)


@pytest.fixture(scope="module")
def reference8():
    return _reference(8)


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _pp2_worker() -> dict:
    """One PP 2 run for several tests: every schedule's training, the rank trees, the error messages."""
    errors = {"tied": _error(_tied_on_loop), "degree": _error(_wrong_degree)}
    return {
        "train": _train_schedules(2, 4, SCHEDULES),
        "trees": _rank_trees("zb_v"),
        "errors": errors,
        "timeline": _timeline("zb_h1"),
        "sums": {name: _sums_both_ways(name) for name in ("1f1b", "interleaved_1f1b")},
    }


def _sums_both_ways(schedule_name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One step's loss and grads as the executor sums them (pure PP: in ``.grad`` by the engine), and with the
    Python sums (``_foreach_add``) that DTensor leaves and W use, on the same params and batch."""
    from functitan.pipeline import _executor

    mesh = make_mesh(pp=2)
    model = llama.stage_model(CFG, Layout(pipeline.stage_mesh(mesh)), seq_len=SEQ)
    stages = pipeline.make_stages(model, _schedule(schedule_name, 2, 4), mesh)
    params = pipeline.place_stages(_init(), llama.specs(CFG), default_rules(), stages)
    grad_fn = pipeline.pipeline_grad_fn(stages)
    out = []
    for into_grad in (True, False):
        init = _executor._Run.__init__

        def forced(self, *args, init=init, into_grad=into_grad):
            init(self, *args)
            self.into_grad = into_grad

        _executor._Run.__init__ = forced  # type: ignore[method-assign]
        try:
            loss, grads = grad_fn(params, _batches()[0])
        finally:
            _executor._Run.__init__ = init  # type: ignore[method-assign]
        out.append([loss] + [g.to_local() for _, g in flatten_with_names(grads)[0]])
    return out[0], out[1]


def _timeline(schedule_name: str):
    """One step with a timeline: this rank's spans, its actions in schedule order, the idle and wait fractions."""
    mesh = make_mesh(pp=2)
    model = llama.stage_model(CFG, Layout(pipeline.stage_mesh(mesh)), seq_len=SEQ)
    stages = pipeline.make_stages(model, _schedule(schedule_name, 2, 4), mesh)
    params = pipeline.place_stages(_init(), llama.specs(CFG), default_rules(), stages)
    timeline: list[pipeline.StepTimeline] = []
    pipeline.pipeline_grad_fn(stages, timeline=timeline)(params, _batches()[0])
    (step,) = timeline
    return step, stages.schedule.actions[stages.pp_rank], step.idle_fraction, step.wait_fraction


@pytest.fixture(scope="module")
def pp2(gloo):
    return gloo.run(_pp2_worker, 2)


def _world4_worker() -> dict:
    """One 4-process run for the 4-rank layouts: PP 4 (every schedule), PP 2 x FSDP 2, PP 2 x TP 2 (+ SP)."""
    return {
        "pp4": _train_schedules(4, 8, SCHEDULES),
        # reshard-after-forward re-gathers in each backward pass, so B/W schedules run with it too
        "fsdp": _train_schedules(2, 4, SCHEDULES, dp_shard=2),
        "selective_error": _error(_zb_with_selective_remat),
        "tp": _train_schedules(2, 4, SCHEDULES, tp=2),
        "tp+sp": _train_schedules(2, 4, ("zb_v",), tp=2, sp=True),
    }


@pytest.fixture(scope="module")
def world4(gloo):
    return gloo.run(_world4_worker, 4)


@pytest.mark.parametrize("name", SCHEDULES)
def test_pp2_trains_like_one_process(name, pp2, reference4):
    _check([r["train"] for r in pp2], name, reference4)


@pytest.mark.parametrize("name", SCHEDULES)
def test_pp4_trains_like_one_process(name, world4, reference8):
    _check([r["pp4"] for r in world4], name, reference8)


@pytest.mark.parametrize("name", SCHEDULES)
def test_pp2_x_fsdp2_trains_like_one_process(name, world4, reference4):
    assert "splits the backward into B and W" in world4[0]["selective_error"]
    assert "build the Layout with remat 'none' or 'full'" in world4[0]["selective_error"]
    results = [r["fsdp"] for r in world4]  # ranks 0, 1: stage-0 side (dp_shard 0, 1); ranks 2, 3: the other
    _check(results, name, reference4)
    w = "layers.0.mlp.w_up"  # the dp replicas of one pipeline rank gathered the same full params
    torch.testing.assert_close(results[0][name][2][w], results[1][name][2][w], atol=0, rtol=0)


@pytest.mark.parametrize(("layout", "name"), [*(("tp", n) for n in SCHEDULES), ("tp+sp", "zb_v")])
def test_pp2_x_tp2_trains_like_one_process(layout, name, world4, reference4):
    # with sequence parallelism the activations between stages are (microbatch, seq / tp, embed) shards
    _check([r[layout] for r in world4], name, reference4)


# ----------------------------------------------------------------------------------------------- stages


def test_balance_gives_the_heavy_last_stage_fewer_blocks():
    assert pipeline.balance(1.0, 8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    assert pipeline.balance(1.0, 8, 2, last_cost=2.0) == (range(0, 5), range(5, 8))
    assert pipeline.balance([1, 1, 1, 1, 1, 1, 4], 7, 3, first_cost=1.0) == (range(0, 3), range(3, 6), range(6, 7))
    with pytest.raises(ValueError, match=r"cannot split 3 blocks into 4 non-empty pipeline stages; use at most 3"):
        pipeline.balance(1.0, 3, 4)


def test_llama_costs_put_the_head_on_a_shorter_last_stage():
    big_vocab = dataclasses.replace(CFG, vocab_size=4096)
    model = llama.stage_model(big_vocab, Layout(), seq_len=SEQ)
    assert model.last_cost > 3 * model.block_cost  # a 4096-row head outweighs 3 blocks of dim 32
    layers = pipeline.balance(model.block_cost, 8, 2, first_cost=model.first_cost, last_cost=model.last_cost)
    assert len(layers[1]) < len(layers[0])


def test_blocks_per_rank_sums_the_default_cut_over_each_rank_s_stages():
    # the planner sizes pipeline ranks with blocks_per_rank; make_stages cuts by balanced_layers: one cut
    model = pipeline.StageModel(
        first=None, blocks=None, last=None, activation=None, n_blocks=10, first_cost=1.0, last_cost=3.0
    )
    four = (range(0, 3), range(3, 7), range(7, 9), range(9, 10))
    assert pipeline.balanced_layers(model, 4) == four
    assert pipeline.blocks_per_rank(model, pipeline.one_f_one_b(pp=2, m=4)) == (6, 4)
    assert pipeline.blocks_per_rank(model, pipeline.interleaved_1f1b(pp=2, v=2, m=4)) == (5, 5)  # stages 0, 2 | 1, 3
    assert pipeline.blocks_per_rank(model, pipeline.zb_v(pp=2, m=4)) == (4, 6)  # V: stages 0, 3 | 1, 2


def _rank_trees(schedule_name: str):
    mesh = make_mesh(pp=2)
    model = llama.stage_model(CFG, Layout(pipeline.stage_mesh(mesh)), seq_len=SEQ)
    stages = pipeline.make_stages(model, _schedule(schedule_name, 2, 4), mesh)
    params = pipeline.place_stages(_init(), llama.specs(CFG), default_rules(), stages)
    named = flatten_with_names(params)[0]
    return (
        stages.local,
        [str(i) for s in stages.local for i in stages.layers[s]],
        sorted({n.split(".")[0] for n, _ in named}),
        named[0][1].device_mesh.mesh_dim_names,
    )


def test_each_rank_holds_only_its_stages_params(pp2):
    (s0, l0, k0, axes), (s1, l1, k1, _) = (r["trees"] for r in pp2)
    assert (s0, s1) == ((0, 3), (1, 2))  # V placement
    assert l0 == ["0", "1", "6", "7"] and l1 == ["2", "3", "4", "5"]
    assert k0 == ["embed", "layers", "norm", "output"] and k1 == ["layers"]  # the V puts first and last on rank 0
    assert axes == ("dp_replicate",)  # the stage mesh (no pp) without its size-1 axes: its first axis alone


def _tied_on_loop():
    mesh = make_mesh(pp=2)
    model = llama.stage_model(dataclasses.replace(CFG, tie_embeddings=True), Layout(), seq_len=SEQ)
    pipeline.make_stages(model, pipeline.one_f_one_b(pp=2, m=2), mesh)


def _zb_with_selective_remat():
    mesh = make_mesh(pp=2, dp_shard=2)
    layout = Layout(pipeline.stage_mesh(mesh), pipeline.stage_rules(default_rules()), remat="selective")
    model = llama.stage_model(CFG, layout, seq_len=SEQ)
    pipeline.make_stages(model, pipeline.zb_v(pp=2, m=4), mesh)


def _wrong_degree():
    mesh = make_mesh(pp=2)
    pipeline.make_stages(llama.stage_model(CFG, Layout(), seq_len=SEQ), pipeline.one_f_one_b(pp=4, m=4), mesh)


def test_timeline_spans_every_action_with_its_wait_and_cpu_time(pp2):
    waited = 0.0
    for step, actions, idle, wait in (r["timeline"] for r in pp2):
        assert [s.action for s in step.spans] == list(actions)
        assert step.start <= step.spans[0].start and step.spans[-1].end <= step.end
        assert all(s.end >= s.start and s.wait >= 0 and s.cpu >= 0 for s in step.spans)
        assert sum(s.cpu for s in step.spans if s.action.kind == "F") > 0
        assert 0 <= wait <= idle < 1
        waited += sum(s.wait for s in step.spans)
    assert waited > 0  # rank 1 waits for its first activation, rank 0 for its first gradient


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_engine_sums_microbatch_grads_bit_for_bit_like_python(name, pp2):
    """Pure PP sums BW's gradients in ``.grad`` (AccumulateGrad): the same sums in the same order as the
    executor's Python ``_foreach_add``, so the same bits."""
    for r in pp2:
        engine, python = r["sums"][name]
        assert len(engine) == len(python) > 1
        for a, b in zip(engine, python):
            assert torch.equal(a, b)
            assert a.abs().sum() > 0


def test_errors_name_the_fix(pp2):
    errors = pp2[0]["errors"]
    assert "tied embeddings), which schedule '1f1b' puts on ranks 0 and 1; untie them" in errors["tied"]
    assert errors["degree"] == (
        "schedule '1f1b' is for pp=4 ranks but the mesh has pp=2; build the mesh with make_mesh(pp=4, ...) or the "
        "schedule for pp=2"
    )
