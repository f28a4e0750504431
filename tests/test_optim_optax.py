"""optax's combinators and optimizers (functitan/optim/_combinators.py, _adafactor.py, join_schedules) against
reference numbers computed here, leaf by leaf in float64, from optax's documented semantics."""

import math

import optree
import pytest
import torch

from functitan import optim


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "w": torch.randn(4, 6, generator=g, dtype=torch.float64),
        "norm": torch.randn(3, generator=g, dtype=torch.float64),
    }


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in _params().items()}


def _run(opt, steps, params=None, between=None):
    params = params or _params()
    state = opt.init(params)
    outs = []
    for t in range(steps):
        if between:
            state = between(t, state)
        updates, state = opt.update(_grads(t), state, params)
        outs.append(updates)
        params = optim.apply_updates(params, updates)
    return params, outs, state


# ------------------------------------------------------------------ references (plain per-leaf loops)


def _ref_adamw(p, grads, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """One leaf through ``len(grads)`` AdamW steps; ``lr`` a list (one rate per step)."""
    m, v, out = torch.zeros_like(p), torch.zeros_like(p), []
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = -lr[t - 1] * ((m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * p)
        out.append(u)
        p = p + u
    return p, out


def test_masked_adamw_updates_only_selected_leaves_and_passes_the_rest():
    opt = optim.masked(optim.adamw(1e-2, weight_decay=0.1, mask=None), lambda name, p: name != "norm")
    params, outs, state = _run(opt, 4)
    for k in ("emb", "w"):
        ref, _ = _ref_adamw(_params()[k], [_grads(t)[k] for t in range(4)], [1e-2] * 4, wd=0.1)
        torch.testing.assert_close(params[k], ref, rtol=0, atol=1e-12)
    for t in range(4):  # unmasked: the gradient itself, as optax.masked
        torch.testing.assert_close(outs[t]["norm"], _grads(t)["norm"], rtol=0, atol=0)
    # the inner state holds the two selected leaves only, in the params' tree (None for the other, as optax)
    assert len(optree.tree_leaves(state.inner_state[0].mu)) == 2 and state.inner_state[0].mu["norm"] is None


def test_multi_transform_runs_one_optimizer_per_label():
    labels = {"emb": "sgd", "w": "adam", "norm": "frozen"}
    opt = optim.multi_transform(
        {"adam": optim.adamw(1e-2, weight_decay=0.0), "sgd": optim.sgd(0.5, momentum=0.9), "frozen": optim.scale(0.0)},
        labels,
    )
    params, _, _ = _run(opt, 3)
    ref_w, _ = _ref_adamw(_params()["w"], [_grads(t)["w"] for t in range(3)], [1e-2] * 3)
    torch.testing.assert_close(params["w"], ref_w, rtol=0, atol=1e-12)
    p, buf = _params()["emb"], torch.zeros(5, 3, dtype=torch.float64)
    for t in range(3):
        buf = 0.9 * buf + _grads(t)["emb"]
        p = p - 0.5 * buf
    torch.testing.assert_close(params["emb"], p, rtol=0, atol=1e-12)
    torch.testing.assert_close(params["norm"], _params()["norm"], rtol=0, atol=0)
    with pytest.raises(
        ValueError, match=r"param_labels gives 'norm' the label 'nope', which is not one of the transforms \['adam'\]"
    ):
        optim.multi_transform({"adam": optim.adamw(1e-2)}, lambda n, p: "adam" if n != "norm" else "nope").init(
            _params()
        )


def test_inject_hyperparams_reads_schedules_and_takes_overrides_in_the_state():
    sched = lambda s: 1e-2 / (1 + s)  # noqa: E731
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=sched, weight_decay=0.1, mask=None)

    def halve_wd(t, state):
        if t == 2:
            state.hyperparams["weight_decay"].fill_(0.05)
        return state

    params, _, state = _run(opt, 4, between=halve_wd)
    assert math.isclose(float(state.hyperparams["learning_rate"]), 1e-2 / 4)
    # reference: AdamW with lr 1e-2/(1+t), decay 0.1 for steps 0-1 and 0.05 after
    for k in _params():
        p, m, v = _params()[k], 0.0, 0.0
        for t in range(4):
            g = _grads(t)[k]
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            step = t + 1
            wd = 0.1 if t < 2 else 0.05
            p = p - sched(t) * ((m / (1 - 0.9**step)) / ((v / (1 - 0.999**step)).sqrt() + 1e-8) + wd * p)
        torch.testing.assert_close(params[k], p, rtol=0, atol=1e-12)


def test_apply_every_emits_the_sum_every_k_steps():
    _, outs, _ = _run(optim.apply_every(3), 6)
    for t in range(6):
        want = (
            sum(_grads(s)["w"] for s in range(t - 2, t + 1)) if t % 3 == 2 else torch.zeros(4, 6, dtype=torch.float64)
        )
        torch.testing.assert_close(outs[t]["w"], want, rtol=0, atol=1e-12)


def test_multi_steps_applies_the_inner_optimizer_to_the_window_mean():
    params, outs, state = _run(optim.multi_steps(optim.adamw(1e-2, weight_decay=0.1, mask=None), 3), 6)
    means = [sum(_grads(s)["w"] for s in range(w, w + 3)) / 3 for w in (0, 3)]
    ref, ref_updates = _ref_adamw(_params()["w"], means, [1e-2] * 2, wd=0.1)
    torch.testing.assert_close(params["w"], ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(outs[2]["w"], ref_updates[0], rtol=0, atol=1e-12)
    assert torch.count_nonzero(outs[0]["w"]) == 0 and torch.count_nonzero(outs[4]["w"]) == 0
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0


def test_ema_of_updates_and_of_params():
    _, outs, _ = _run(optim.ema(0.9), 3)
    e = torch.zeros(3, dtype=torch.float64)
    for t in range(3):
        e = 0.9 * e + 0.1 * _grads(t)["norm"]
        torch.testing.assert_close(outs[t]["norm"], e / (1 - 0.9 ** (t + 1)), rtol=0, atol=1e-12)
    pe = optim.param_ema(0.5)
    s = pe.init({"x": torch.ones(2)})
    for v in (3.0, 5.0):
        s = pe.update({"x": torch.full((2,), v)}, s)
    torch.testing.assert_close(s.ema["x"], torch.full((2,), 0.5 * (0.5 * 1 + 0.5 * 3) + 0.5 * 5))


def test_lion_matches_the_paper_update():
    params, _, _ = _run(optim.lion(1e-3, b1=0.9, b2=0.99, weight_decay=0.1, mask=None), 3)
    for k in _params():
        p, m = _params()[k], torch.zeros_like(_params()[k])
        for t in range(3):
            g = _grads(t)[k]
            c = torch.sign(0.9 * m + 0.1 * g)
            m = 0.99 * m + 0.01 * g
            p = p - 1e-3 * (c + 0.1 * p)
        torch.testing.assert_close(params[k], p, rtol=0, atol=1e-12)


def _ref_adafactor(p, grads, lr, min_dim, decay_rate=0.8, eps=1e-30, clip=1.0):
    """optax.adafactor (no momentum, no decay) on one leaf, written out with explicit row/column loops."""
    factored = p.ndim == 2 and min(p.shape) >= min_dim
    vr, vc, v = torch.zeros(p.shape[0], dtype=p.dtype), torch.zeros(p.shape[-1], dtype=p.dtype), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        rho = 1 - t ** (-decay_rate)
        g2 = g * g + eps
        if factored:  # d1 = the larger dim (cols here: shape (4, 6)), d0 = rows
            vr = rho * vr + (1 - rho) * torch.stack([g2[i].mean() for i in range(p.shape[0])])
            vc = rho * vc + (1 - rho) * torch.stack([g2[:, j].mean() for j in range(p.shape[1])])
            u = torch.empty_like(p)
            for i in range(p.shape[0]):
                for j in range(p.shape[1]):
                    u[i, j] = g[i, j] / math.sqrt(vr[i] / vr.mean() * vc[j])
        else:
            v = rho * v + (1 - rho) * g2
            u = g / v.sqrt()
        rms = u.pow(2).mean().sqrt()
        u = u / max(1.0, float(rms) / clip)
        u = u * lr * max(float(p.pow(2).mean().sqrt()), 1e-3)
        p = p - u
    return p


def test_adafactor_matches_a_reference_with_factored_and_full_moments():
    params, _, state = _run(optim.adafactor(0.1, min_dim_size_to_factor=4), 3)
    assert state[0].v_row["w"].shape == (4,) and state[0].v_col["w"].shape == (6,) and state[0].v["w"].numel() == 0
    for k in _params():
        ref = _ref_adafactor(_params()[k], [_grads(t)[k] for t in range(3)], 0.1, min_dim=4)
        torch.testing.assert_close(params[k], ref, rtol=1e-10, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


def test_join_schedules_restarts_each_piece_at_its_boundary():
    s = optim.join_schedules([optim.constant(1.0), lambda t: 1.0 / (1 + t), optim.constant(0.1)], [10, 15])
    assert [s(t) for t in (0, 9, 10, 11, 14, 15, 99)] == [1.0, 1.0, 1.0, 0.5, 0.2, 0.1, 0.1]
    with pytest.raises(ValueError, match="2 schedules need 1 increasing boundaries, got"):
        optim.join_schedules([optim.constant(1.0), optim.constant(2.0)], [])


def _sharded_worker():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    full = {k: v.float() for k, v in _params().items()}
    params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    out = {}
    for name, opt in _OPTS.items():
        p, state = params, opt.init(params)
        for t in range(3):
            g = {k: distribute_tensor(v.float(), mesh, [Shard(0)]) for k, v in _grads(t).items()}
            u, state = opt.update(g, state, p)
            p = optim.apply_updates(p, u)
        assert all(isinstance(x, DTensor) and x.placements == (Shard(0),) for x in p.values()), name
        out[name] = {k: x.full_tensor() for k, x in p.items()}
    return out


_OPTS = {
    "masked_adamw": optim.masked(optim.adamw(1e-2, mask=None), lambda n, p: n != "norm"),
    "lion": optim.lion(1e-3),
    "adafactor": optim.adafactor(0.1, min_dim_size_to_factor=2),
    "multi_steps": optim.multi_steps(optim.adamw(1e-2), 2),
    "ema": optim.chain(optim.ema(0.9), optim.scale(-0.1)),
}


def test_every_new_optimizer_keeps_fsdp_placements_and_matches_one_process(gloo):
    results = gloo.run(_sharded_worker, 2, timeout=120)
    for name, opt in _OPTS.items():
        p = {k: v.float() for k, v in _params().items()}
        state = opt.init(p)
        for t in range(3):
            u, state = opt.update({k: v.float() for k, v in _grads(t).items()}, state, p)
            p = optim.apply_updates(p, u)
        for k in p:
            torch.testing.assert_close(
                results[0][name][k], p[k], rtol=1e-5, atol=1e-6, msg=lambda m, n=name, k=k: f"{n}/{k}: {m}"
            )


# ------------------------------------------------------------------ under torch.compile
# Step counters stay 0-d tensors in the graph (branches become torch.where, as optax's lax.cond): one graph,
# no break, reused every step, and the same numbers as eager.

SCHED = optim.warmup_cosine(1e-2, 2, 10)
COMPILED = {
    "lion": lambda: optim.lion(SCHED, weight_decay=0.1),
    "adafactor": lambda: optim.adafactor(1e-2, min_dim_size_to_factor=2),
    "ema": lambda: optim.chain(optim.ema(0.9), optim.scale_by_learning_rate(0.1)),
    "apply_every": lambda: optim.chain(optim.sgd(0.1), optim.apply_every(2)),
    "multi_steps": lambda: optim.multi_steps(optim.adamw(SCHED), 2),
    "inject_hyperparams": lambda: optim.inject_hyperparams(optim.adamw)(learning_rate=SCHED, weight_decay=0.1),
    "inject_static": lambda: optim.inject_hyperparams(optim.sgd, static_args="momentum")(
        learning_rate=0.1, momentum=0.9
    ),
}


def _compiled_run(opt, compile, steps=4):
    def step(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    fn = torch.compile(step, backend="aot_eager") if compile else step
    params = _params()
    state = opt.init(params)
    for t in range(steps):
        params, state = fn(_grads(t), state, params)
    return params, state


def _assert_one_graph():
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_combinators_compile_to_one_graph_and_equal_eager(name):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled, state = _compiled_run(COMPILED[name](), "aot_eager")
    _assert_one_graph()  # four steps, one graph: the counters did not specialise it
    eager, _ = _compiled_run(COMPILED[name](), False)
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=0, atol=1e-12)
    if name == "multi_steps":
        assert (int(state.mini_step), int(state.gradient_step)) == (0, 2)


def test_param_ema_with_warmup_compiles_and_equals_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pe = optim.param_ema(0.9, warmup=True)
    compiled_update = torch.compile(pe.update, backend="aot_eager")
    a = b = pe.init(_params())
    for t in range(3):
        a, b = pe.update(_grads(t), a), compiled_update(_grads(t), b)
    _assert_one_graph()
    for k in a.ema:
        torch.testing.assert_close(b.ema[k], a.ema[k], rtol=0, atol=1e-12)
