import math

import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from functitan import optim
from functitan.mesh import make_mesh
from functitan.tree import flatten_with_names

# --------------------------------------------------------------------------------------------------------
# A small multi-leaf model: embedding, two residual layers (matrix + norm scale), output with bias.


def _init_params(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g, dtype=dtype) * 0.5).requires_grad_()

    return {
        "tok_embeddings": r(11, 6),
        "layers": [{"attn": {"wq": r(6, 6)}, "norm": r(6)} for _ in range(2)],
        "out": {"weight": r(6, 11), "bias": r(11)},
    }


def _loss(p, tokens, targets):
    x = p["tok_embeddings"][tokens]  # (batch, embed)
    for layer in p["layers"]:
        x = x + torch.tanh(x @ layer["attn"]["wq"]) * layer["norm"]
    logits = x @ p["out"]["weight"] + p["out"]["bias"]  # (batch, vocab)
    return torch.nn.functional.cross_entropy(logits, targets)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (8,), generator=g), torch.randint(0, 11, (8,), generator=g)


def _named(params):
    paths, leaves = optree.tree_paths(params), optree.tree_leaves(params)
    return [(".".join(map(str, path)), leaf) for path, leaf in zip(paths, leaves)]


def _run_functional(opt, steps):
    params = _init_params()
    state = opt.init(params)
    for step in range(steps):
        leaves, treedef = optree.tree_flatten(params)
        grads = treedef.unflatten(torch.autograd.grad(_loss(params, *_batch(step)), leaves))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _run_torch(make_opt, steps, make_sched=None):
    params = _init_params()
    named = _named(params)
    opt = make_opt(named)
    sched = make_sched(opt) if make_sched else None
    for step in range(steps):
        opt.zero_grad()
        _loss(params, *_batch(step)).backward()
        opt.step()
        if sched:
            sched.step()
    return dict(named)


def test_adamw_matches_torch_adamw_over_20_steps_fp64():
    peak, wd = 1e-2, 0.1
    schedule = optim.warmup_cosine(peak, warmup_steps=3, total_steps=20, final=1e-3)
    params, state = _run_functional(optim.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd), 20)

    def make_opt(named):
        decay = [p for n, p in named if optim.default_decay_mask(n, p)]
        no_decay = [p for n, p in named if not optim.default_decay_mask(n, p)]
        assert [n for n, p in named if optim.default_decay_mask(n, p)] == [
            "layers.0.attn.wq",
            "layers.1.attn.wq",
            "out.weight",
            "tok_embeddings",
        ]
        groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.95), eps=1e-8)

    def make_sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s) / peak)

    expected = _run_torch(make_opt, 20, make_sched)
    start = dict(_named(_init_params()))
    for name, leaf in _named(params):
        # fp64: the two differ only in rounding order; the params moved by ~1e-1 over 20 steps
        torch.testing.assert_close(leaf, expected[name].detach(), rtol=0, atol=1e-12)
        assert (leaf - start[name]).abs().max() > 1e-3, name
        assert leaf.requires_grad and leaf.is_leaf
    adam_state = state[0]
    assert adam_state.count.dtype == torch.int64 and adam_state.count.shape == () and int(adam_state.count) == 20
    assert int(state[2].count) == 20


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_matches_torch_sgd_over_10_steps(momentum, nesterov):
    params, _ = _run_functional(optim.sgd(0.1, momentum=momentum, nesterov=nesterov), 10)
    expected = _run_torch(
        lambda named: torch.optim.SGD([p for _, p in named], lr=0.1, momentum=momentum, nesterov=nesterov), 10
    )
    for name, leaf in _named(params):
        torch.testing.assert_close(leaf, expected[name].detach(), rtol=0, atol=1e-13)


def test_sgd_nesterov_without_momentum_says_what_to_pass():
    with pytest.raises(ValueError, match=r"nesterov=True\) needs momentum > 0.*momentum=0.9"):
        optim.sgd(0.1, nesterov=True)


def test_apply_updates_is_functional_and_keeps_dtype_and_requires_grad():
    params = {"w": torch.ones(3, dtype=torch.bfloat16, requires_grad=True), "frozen": torch.zeros(2)}
    updates = {"w": torch.full((3,), 1e-3), "frozen": torch.ones(2)}  # fp32 updates on a bf16 param
    new = optim.apply_updates(params, updates)
    assert new["w"].dtype == torch.bfloat16 and new["w"].requires_grad and new["w"].is_leaf
    assert not new["frozen"].requires_grad
    torch.testing.assert_close(new["frozen"], torch.ones(2))
    torch.testing.assert_close(params["w"].detach(), torch.ones(3, dtype=torch.bfloat16))  # input untouched
    assert new["w"] is not params["w"]


def test_init_runs_on_the_meta_device():
    params = {"w": torch.empty(1024, 1024, device="meta"), "b": torch.empty(1024, device="meta")}
    state = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3), optim.sgd(1e-3, momentum=0.9)).init(params)
    adam = state[1][0]
    assert adam.mu["w"].device.type == "meta" and adam.nu["b"].shape == (1024,)
    assert state[2][0].trace["w"].device.type == "meta"


def test_docstring_examples_run():
    import doctest

    from functitan.optim import _base, _combinators, _norm, _transforms

    for module in (_base, _norm, _transforms, _combinators):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_clip_by_global_norm_scales_only_above_max_norm():
    clip = optim.clip_by_global_norm(1.0)
    big = {"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}
    out, _ = clip.update(big, clip.init(big))
    torch.testing.assert_close(out["a"], torch.tensor([0.6]))
    torch.testing.assert_close(out["b"], torch.tensor([[0.8]]))
    assert float(optim.global_norm(out)) == pytest.approx(1.0)
    small = {"a": torch.tensor([0.3]), "b": torch.tensor([[0.4]])}
    out, _ = clip.update(small, ())
    torch.testing.assert_close(out["a"], small["a"])
    zeros = {"a": torch.zeros(2)}
    torch.testing.assert_close(clip.update(zeros, ())[0]["a"], torch.zeros(2))
    with pytest.raises(ValueError, match="max_norm=0: pass a positive norm"):
        optim.clip_by_global_norm(0)


def test_decay_masks_decay_matrices_and_the_specs_spare_vocab_tables():
    m = torch.zeros(4, 4)
    assert optim.default_decay_mask("layers.0.attn.wq", m) and optim.default_decay_mask("tok_embeddings", m)
    assert not optim.default_decay_mask("layers.0.norm", torch.zeros(4))
    from models import llama

    cfg = llama.config("debug", n_layers=1)
    mask = optim.decay_mask_from_specs(llama.specs(cfg))
    params = llama.init(cfg, 0, device="meta")
    decayed = [n for n, p in flatten_with_names(params)[0] if mask(n, p)]
    assert sorted(decayed) == sorted(
        f"layers.0.{k}" for k in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")
    )
    assert mask("layers.7.attn.wq", m)  # a pipeline stage's own names fall back to the rule by shape


def test_decay_mask_tree_with_wrong_structure_names_the_key_path():
    params = {"layers": [{"wq": torch.ones(2, 2), "norm": torch.ones(2)}]}
    opt = optim.add_decayed_weights(0.1, mask={"layers": [{"wq": True, "nrm": False}]})
    with pytest.raises(ValueError, match=r"params and mask differ at 'layers\.0'.*only in the first: \['norm'\]"):
        opt.init(params)
    bad = optim.add_decayed_weights(0.1, mask={"layers": [{"wq": True, "norm": 1}]})
    with pytest.raises(TypeError, match=r"mask for 'layers\.0\.norm' is 1 \(int\)"):
        bad.init(params)


def test_decay_mask_tree_selects_leaves():
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    opt = optim.add_decayed_weights(0.5, mask={"a": True, "b": False})
    updates, _ = opt.update({"a": torch.zeros(2), "b": torch.zeros(2)}, opt.init(params), params)
    torch.testing.assert_close(updates["a"], torch.full((2,), 0.5))
    torch.testing.assert_close(updates["b"], torch.zeros(2))
    with pytest.raises(ValueError, match="needs the params"):
        opt.update(updates, ())


def test_grads_with_another_layout_than_params_raise_with_the_fix():
    mesh = make_mesh(device="cpu")["dp_shard"]
    params = {"w": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])}
    opt = optim.adamw(1e-3)
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"grads leaf 'w' is a plain tensor.*Fix: redistribute grads"):
        opt.update({"w": torch.ones(4, 2)}, state, params)
    with pytest.raises(ValueError, match=r"optimizer state and grads differ at '<root>'.*only in the second: \['v'\]"):
        opt.update({"v": torch.ones(4, 2)}, state, params)
    plain = {"w": torch.ones(4, 2)}  # plain tensors: the fix is the shape, not a redistribution
    with pytest.raises(ValueError, match=r"shape \(3,\).*Fix: give grads the shapes of optimizer state"):
        opt.update({"w": torch.ones(3)}, opt.init(plain), plain)


def test_global_norm_refuses_partial_leaves():
    mesh = make_mesh(device="cpu")["dp_shard"]
    g = {"w": DTensor.from_local(torch.ones(2), mesh, [Partial()])}
    with pytest.raises(ValueError, match=r"leaf 'w' has placements \(Partial\(sum\),\).*redistribute"):
        optim.global_norm(g)


def test_schedules_values_at_chosen_steps():
    cos = optim.warmup_cosine(1.0, warmup_steps=10, total_steps=110, final=0.1)
    assert cos(0) == pytest.approx(0.1)  # warmup start: step 0 already trains
    assert cos(9) == pytest.approx(1.0) and cos(10) == pytest.approx(1.0)  # warmup end
    assert cos(60) == pytest.approx(0.55)  # cosine midpoint: (peak + final) / 2
    assert cos(110) == pytest.approx(0.1) and cos(500) == pytest.approx(0.1)  # end, and after
    lin = optim.warmup_linear(2.0, warmup_steps=4, total_steps=14)
    assert [lin(s) for s in (0, 3, 4, 9, 14)] == pytest.approx([0.5, 2.0, 2.0, 1.0, 0.0])
    w = optim.wsd(1.0, warmup_steps=10, total_steps=100, decay_fraction=0.2)
    assert [w(s) for s in (0, 9, 50, 80, 90, 100)] == pytest.approx([0.1, 1.0, 1.0, 1.0, 0.5, 0.0])
    assert optim.constant(3e-4)(12345) == 3e-4
    no_warmup = optim.warmup_cosine(1.0, warmup_steps=0, total_steps=10)
    assert no_warmup(0) == 1.0 and no_warmup(5) == pytest.approx(0.5)


def test_schedule_errors_say_what_to_pass():
    with pytest.raises(ValueError, match=r"warmup_steps=200 exceeds total_steps=100; pass warmup_steps <= total"):
        optim.warmup_cosine(1e-3, warmup_steps=200, total_steps=100)
    with pytest.raises(ValueError, match=r"peak=-1.*non-negative"):
        optim.warmup_linear(-1, 0, 10)
    with pytest.raises(ValueError, match=r"warmup_steps=-1.*pass warmup_steps >= 0"):
        optim.wsd(1.0, -1, 10)
    with pytest.raises(ValueError, match=r"decay_fraction=1.5.*\[0, 1\]"):
        optim.wsd(1.0, 0, 10, decay_fraction=1.5)
    with pytest.raises(ValueError, match=r"would start at step 50, inside the 60-step warmup"):
        optim.wsd(1.0, 60, 100, decay_fraction=0.5)
    with pytest.raises(ValueError, match=r"final=2.0 is above peak=1.0"):
        optim.warmup_cosine(1.0, 1, 10, final=2.0)
    with pytest.raises(ValueError, match=r"schedule returned -1.0 at step 0"):
        opt = optim.scale_by_learning_rate(lambda step: -1.0)
        opt.update({"a": torch.ones(1)}, opt.init({"a": torch.ones(1)}))


# --------------------------------------------------------------------------------------------------------
# Sharded params: N gloo processes vs the unsharded reference computed here.


def _full_tree(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def _reference(grads_per_step, params, max_norm, opt_factory):
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads_per_step[0].values()))
    clip = optim.clip_by_global_norm(max_norm)
    clipped, _ = clip.update(grads_per_step[0], ())
    opt = opt_factory()
    state = opt.init(params)
    for grads in grads_per_step:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return norm, clipped, params


def _shard_tree(tree, layout):
    return {k: distribute_tensor(v, layout[k][0], layout[k][1]) if k in layout else v for k, v in tree.items()}


def _check_sharded_run(grads_per_step, params, layout, max_norm, opt_factory):
    grads_per_step = [_shard_tree(g, layout) for g in grads_per_step]
    params = {k: v.requires_grad_() for k, v in _shard_tree(params, layout).items()}
    norm = optim.global_norm(grads_per_step[0])
    clipped, _ = optim.clip_by_global_norm(max_norm).update(grads_per_step[0], ())
    opt = opt_factory()
    state = opt.init(params)
    for grads in grads_per_step:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    placements = {}
    for k, p in params.items():
        layouts = [p, clipped[k], state[1][0].mu[k], state[1][0].nu[k]]
        placements[k] = [str(getattr(x, "placements", "plain")) for x in layouts]
        assert p.requires_grad and p.is_leaf, k

    def full(t):  # numpy pickles by value: a tensor would go back through shared memory of an exiting process
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy()

    return float(norm), {k: full(v) for k, v in clipped.items()}, {k: full(v) for k, v in params.items()}, placements


def _adamw_with_clip():
    return optim.chain(optim.clip_by_global_norm(2.0), optim.adamw(1e-2, weight_decay=0.1, mask=None))


_SHAPES_2 = {"w": (6, 4), "uneven": (5, 3), "tiny": (1, 3), "rep": (4,), "col": (3, 5), "plain": (2,)}


def _fsdp_worker(grads_per_step, params, max_norm):
    fsdp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    named = make_mesh(dp_shard=2, device="cpu")  # (pp, dp_replicate, dp_shard, ep, cp, tp) = (1, 1, 2, 1, 1, 1)
    layout = {
        "w": (fsdp, [Shard(0)]),
        "uneven": (fsdp, [Shard(0)]),  # 5 rows over 2 ranks: 3 + 2
        "tiny": (fsdp, [Shard(0)]),  # 1 row: rank 1 holds an empty shard
        "rep": (fsdp, [Replicate()]),  # counted once, not once per rank
        "col": (
            named,
            [Replicate(), Replicate(), Shard(1), Replicate(), Replicate(), Replicate()],
        ),  # another mesh: another group
    }  # "plain" stays a plain tensor, the same on every rank
    return _check_sharded_run(grads_per_step, params, layout, max_norm, _adamw_with_clip)


def _assert_ranks_match_reference(results, reference):
    ref_norm, ref_clipped, ref_params = reference
    for norm, clipped, params, _placements in results:
        assert norm == pytest.approx(ref_norm, rel=1e-12)
        for k in ref_clipped:
            torch.testing.assert_close(torch.from_numpy(clipped[k]), ref_clipped[k], rtol=0, atol=1e-12)
            torch.testing.assert_close(torch.from_numpy(params[k]), ref_params[k].detach(), rtol=0, atol=1e-12)
    return results[0][3]


def test_clip_and_adamw_on_fsdp_shards_equal_the_unsharded_run(gloo):
    grads = [_full_tree(s, _SHAPES_2) for s in range(3)]
    params = _full_tree(10, _SHAPES_2)
    reference = _reference(grads, params, 2.0, _adamw_with_clip)
    assert reference[0] > 2.0  # the clip is active
    results = gloo.run(_fsdp_worker, 2, grads, params, 2.0, timeout=120)
    placements = _assert_ranks_match_reference(results, reference)
    # param, clipped grad, adam mu, adam nu all keep the param's placements
    assert placements["w"] == ["(Shard(dim=0),)"] * 4
    assert placements["rep"] == ["(Replicate(),)"] * 4
    assert placements["col"] == ["(Replicate(), Replicate(), Shard(dim=1), Replicate(), Replicate(), Replicate())"] * 4
    assert placements["plain"] == ["plain"] * 4


_SHAPES_4 = {"w1": (6, 8), "w2": (8, 6), "norm": (5,), "tp_only": (7, 3), "rep": (3,), "sub": (4, 6)}


def _fsdp_tp_worker(grads_per_step, params, max_norm):
    from functitan.optim._norm import _all_reduce_sum

    mesh = make_mesh(dp_shard=2, tp=2, device="cpu")  # (pp, dp_replicate, dp_shard, ep, cp, tp) = (1, 1, 2, 1, 1, 2)
    R = Replicate()
    layout = {
        "w1": (mesh, [R, R, Shard(0), R, R, Shard(1)]),  # FSDP + column TP: reduced over all 4 ranks at once
        "w2": (mesh, [R, R, Shard(1), R, R, Shard(0)]),  # FSDP + row TP: same group as w1
        "norm": (mesh, [R, R, Shard(0), R, R, R]),  # uneven, sharded on dp_shard only: not reduced over tp
        "tp_only": (mesh, [R, R, R, R, R, Shard(0)]),  # 7 rows over tp=2
        "rep": (mesh, [R, R, R, R, R, R]),
        "sub": (mesh["dp_shard", "tp"], [Shard(0), Shard(1)]),  # a 2-D sub-mesh
    }
    out = _check_sharded_run(grads_per_step, params, layout, max_norm, _adamw_with_clip)
    one = torch.tensor(float(dist.get_rank() + 1), dtype=torch.float64)
    sums = [float(_all_reduce_sum(one.clone(), mesh, (2, 5), allow_world=w)) for w in (True, False)]
    sums.append(float(_all_reduce_sum(one.clone(), mesh, (2,))))  # dp_shard pairs: ranks {0,2} and {1,3}
    return (*out, sums)


def test_clip_and_adamw_on_2d_fsdp_tp_shards_equal_the_unsharded_run(gloo):
    grads = [_full_tree(s, _SHAPES_4) for s in range(2)]
    params = _full_tree(20, _SHAPES_4)
    reference = _reference(grads, params, 2.0, _adamw_with_clip)
    results = gloo.run(_fsdp_tp_worker, 4, grads, params, 2.0, timeout=120)
    placements = _assert_ranks_match_reference([r[:4] for r in results], reference)
    assert placements["w2"] == ["(Replicate(), Replicate(), Shard(dim=1), Replicate(), Replicate(), Shard(dim=0))"] * 4
    assert placements["sub"] == ["(Shard(dim=0), Shard(dim=1))"] * 4
    assert [r[4] for r in results] == [[10.0, 10.0, 4.0], [10.0, 10.0, 6.0], [10.0, 10.0, 4.0], [10.0, 10.0, 6.0]]


def test_fused_adamw_equals_its_chain_of_transforms():
    torch.manual_seed(0)
    params = {
        "w": torch.randn(4, 3, dtype=torch.float64),
        "b": torch.randn(3, dtype=torch.float64),
        "embed": torch.randn(5, 3, dtype=torch.float64),
    }
    schedule = optim.warmup_cosine(1e-2, 2, 10)
    fused = optim.adamw(schedule, b1=0.8, b2=0.9, weight_decay=0.3)
    chained = optim.chain(
        optim.scale_by_adam(b1=0.8, b2=0.9),
        optim.add_decayed_weights(0.3, mask=optim.default_decay_mask),
        optim.scale_by_learning_rate(schedule),
    )
    sf, sc, pf, pc = fused.init(params), chained.init(params), params, params
    for _step in range(5):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        uf, sf = fused.update(grads, sf, pf)
        uc, sc = chained.update(grads, sc, pc)
        pf, pc = optim.apply_updates(pf, uf), optim.apply_updates(pc, uc)
    for k in params:
        torch.testing.assert_close(pf[k], pc[k], atol=1e-14, rtol=1e-12)
    assert int(sf[0].count) == int(sc[0].count) == 5 and int(sf[2].count) == 5


# --------------------------------------------------------------------------------------------------------
# adamw's in-place path (make_train_step(donate=True)): torch's fused kernel on the same buffers


def _run_in_place(opt, steps, dtype=torch.float64):
    params = _init_params(dtype)
    state = opt.init(params)
    for step in range(steps):
        leaves, treedef = optree.tree_flatten(params)
        grads = treedef.unflatten(torch.autograd.grad(_loss(params, *_batch(step)), leaves))
        done = opt.update_in_place(grads, state, params)
        assert done is not None
        new_params, state = done
        assert all(a is b for a, b in zip(optree.tree_leaves(new_params), leaves))  # the same buffers
        params = new_params
    return params, state


def test_adamw_in_place_equals_torch_fused_adamw_and_the_functional_update():
    peak, wd = 1e-2, 0.1
    schedule = optim.warmup_cosine(peak, warmup_steps=3, total_steps=12, final=1e-3)
    make = lambda: optim.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd)  # noqa: E731
    in_place, state = _run_in_place(make(), 12)
    functional, fstate = _run_functional(make(), 12)

    def make_opt(named):
        decay = [p for n, p in named if optim.default_decay_mask(n, p)]
        no_decay = [p for n, p in named if not optim.default_decay_mask(n, p)]
        groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.95), eps=1e-8, fused=True)

    expected = _run_torch(
        make_opt, 12, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s) / peak)
    )
    start = dict(_named(_init_params()))
    fun = dict(_named(functional))
    for name, leaf in _named(in_place):
        torch.testing.assert_close(leaf, expected[name].detach(), rtol=0, atol=1e-15)  # the same kernel
        torch.testing.assert_close(leaf, fun[name], rtol=0, atol=1e-12)  # the same arithmetic, other rounding
        assert (leaf - start[name]).abs().max() > 1e-3, name
        assert leaf.requires_grad and leaf.is_leaf
    assert int(state[0].count) == int(state[2].count) == 12 == int(fstate[0].count)
    torch.testing.assert_close(state[0].nu, fstate[0].nu, rtol=0, atol=1e-15)


def test_adamw_in_place_declines_what_the_fused_kernel_cannot_take():
    opt = optim.adamw(1e-2)
    params = {"w": torch.ones(3, 2, dtype=torch.bfloat16)}
    state = opt.init(params)
    grads = {"w": torch.ones(3, 2)}  # fp32 grads of bf16 params: the functional path casts them
    assert opt.update_in_place(grads, state, params) is None
    assert optim.chain(optim.scale(1.0)).update_in_place is None  # a chain is always functional


def _in_place_fsdp_worker(grads_per_step, params):
    fsdp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    layout = {
        "w": (fsdp, [Shard(0)]),
        "uneven": (fsdp, [Shard(0)]),
        "tiny": (fsdp, [Shard(0)]),
        "rep": (fsdp, [Replicate()]),
    }
    out = []
    for donate in (False, True):
        p = {k: v.clone().requires_grad_() for k, v in _shard_tree(params, layout).items()}
        opt = optim.adamw(1e-2, weight_decay=0.1, mask=None)
        state = opt.init(p)
        for g in grads_per_step:
            g = _shard_tree(g, layout)
            if donate:
                p, state = opt.update_in_place(g, state, p)
            else:
                u, state = opt.update(g, state, p)
                p = optim.apply_updates(p, u)
        out.append({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy() for k, v in p.items()})
        assert all(isinstance(p[k], DTensor) and p[k].placements == tuple(layout[k][1]) for k in layout)
    return out


def test_adamw_in_place_on_fsdp_shards_equals_the_functional_update(gloo):
    grads = [_full_tree(s, _SHAPES_2) for s in range(3)]
    params = _full_tree(10, _SHAPES_2)
    for functional, in_place in gloo.run(_in_place_fsdp_worker, 2, grads, params, timeout=120):
        for k in _SHAPES_2:
            assert abs(functional[k] - params[k].numpy()).max() > 1e-3, k
            torch.testing.assert_close(
                torch.from_numpy(in_place[k]), torch.from_numpy(functional[k]), rtol=0, atol=1e-12
            )


def test_clip_to_norm_in_place_scales_the_given_buffers():
    grads = {"w": torch.full((2, 3), 2.0, dtype=torch.float64), "b": torch.full((3,), 2.0, dtype=torch.float64)}
    norm = optim.global_norm(grads)  # 2 * 3 = 6
    expected = optim.clip_to_norm(grads, norm, 3.0)
    buffers = {k: v.data_ptr() for k, v in grads.items()}
    out = optim.clip_to_norm(grads, norm, 3.0, in_place=True)
    assert out is grads and {k: v.data_ptr() for k, v in out.items()} == buffers
    for k in grads:
        torch.testing.assert_close(out[k], expected[k], rtol=0, atol=0)
        assert float(out[k].flatten()[0]) == 1.0  # halved: max_norm 3 over norm 6


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_the_donated_step_equals_the_functional_one_for_gradients_laid_out_unlike_their_params(max_norm):
    """torch's fused AdamW walks its operands as flat buffers: a permuted gradient (strides unlike its
    param's) or an expanded one (a param used through ``.sum()``: stride 0) was read in the wrong order or
    past its storage, so ``donate=True`` trained silently wrong (0.02 off after one step; garbage), and the
    in-place clip refused the expanded one."""
    from functitan.random import key
    from functitan.step import make_train_step
    from functitan.train_state import TrainState
    from functitan.transforms import value_and_grad

    g = torch.Generator().manual_seed(0)
    cases = [  # (loss, params, batch)
        (
            lambda p, b: (p["w"].permute(1, 0, 2) * b).sum() ** 2 / 100,  # grad of w: strides (4, 12, 1)
            {"w": torch.randn(3, 4, 4, generator=g)},
            torch.randn(4, 3, 4, generator=g),
        ),
        (
            lambda p, b: (p["w"] * b).sum() + 0.5 * p["b"].sum(),  # grad of b: expanded, stride 0
            {"w": torch.randn(4, generator=g), "b": torch.zeros(4)},
            torch.randn(4, generator=g),
        ),
    ]
    for loss, params, batch in cases:
        assert any(x.stride() != params[k].stride() for k, x in _grads(loss, params, batch))
        finals = []
        for donate in (False, True):
            opt = optim.adamw(0.1, weight_decay=0.1)
            ps = {k: v.clone() for k, v in params.items()}
            state = TrainState(step=0, params=ps, opt_state=opt.init(ps), data_state=None, rng=key(0))
            step = make_train_step(value_and_grad(loss), opt, max_norm=max_norm, donate=donate)
            for _ in range(3):
                state, _ = step(state, batch)
            finals.append(state.params)
        for k in params:
            torch.testing.assert_close(finals[1][k], finals[0][k], rtol=0, atol=1e-6)


def _grads(loss, params, batch):
    from functitan.transforms import value_and_grad

    return value_and_grad(loss)(params, batch)[1].items()


def test_inner_transforms_of_masked_and_multi_transform_see_the_params_names():
    """A decay mask by spec or by name inside ``masked`` / ``multi_transform`` (they used to hand the inner
    transform a list, named "0", "1", ...: the embedding was decayed, 0.1158 off after one step)."""
    params = {"embed": torch.ones(6, 4), "wq": torch.ones(4, 4), "norm": torch.ones(4)}
    specs = {"embed": ("vocab", "embed"), "wq": ("embed", "heads"), "norm": ("embed",)}
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    by_spec = optim.adamw(0.1, weight_decay=0.5, mask=optim.decay_mask_from_specs(specs))
    by_name = optim.adamw(0.1, weight_decay=0.5, mask=lambda name, p: name == "wq")
    for opt in (
        by_spec,
        optim.masked(by_spec, lambda name, p: True),
        optim.multi_transform({"a": by_spec}, lambda name, p: "a"),
        optim.masked(by_name, lambda name, p: name != "norm"),
        optim.multi_transform({"a": by_name, "b": optim.sgd(0.1)}, lambda name, p: "b" if name == "norm" else "a"),
    ):
        updates, _ = opt.update(zeros, opt.init(params), params)
        moved = {k: float(u.abs().max()) for k, u in updates.items()}
        assert moved == {"embed": 0.0, "wq": pytest.approx(0.05), "norm": 0.0}, opt


def test_a_group_without_leaves_is_left_alone_and_set_to_zero_freezes():
    params = {"embed": torch.ones(3, 2), "w": torch.ones(2, 2)}
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    for opt in (
        optim.masked(optim.adamw(0.1), lambda name, p: False),  # selects nothing: updates pass through
        optim.multi_transform({"x": optim.scale(1.0), "y": optim.adamw(0.1)}, lambda name, p: "x"),
    ):
        state = opt.init(params)
        for _ in range(2):
            updates, state = opt.update(grads, state, params)
        assert all(torch.equal(updates[k], grads[k]) for k in params)
    frozen = optim.multi_transform(
        {"train": optim.adamw(0.1), "frozen": optim.set_to_zero()},
        lambda name, p: "frozen" if name.startswith("embed") else "train",
    )
    updates, _ = frozen.update(grads, frozen.init(params), params)
    new = optim.apply_updates(params, updates)
    assert torch.equal(new["embed"], params["embed"]) and float((new["w"] - params["w"]).abs().min()) > 0.09
