import pytest
import torch
from support import TINY_LLAMA

from functitan import optim, rope
from functitan.random import key
from functitan.step import NonFiniteLossError, make_train_step
from functitan.train_state import TrainState
from functitan.transforms import accumulate, remat, split_batch, value_and_grad
from functitan.tree import tree_leaves, tree_map
from models import llama


def _batch(n=8, s=16, seed=0):
    t = torch.randint(0, TINY_LLAMA.vocab_size, (n, s + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _loss(params, batch):
    return llama.loss(params, batch, TINY_LLAMA)


def test_value_and_grad_matches_autograd_and_skips_integer_leaves():
    params = {"model": llama.init(TINY_LLAMA, key(0)), "count": torch.tensor(3)}
    loss, grads = value_and_grad(lambda p, b: _loss(p["model"], b))(params, _batch())
    ref = tree_map(lambda x: x.clone().requires_grad_(), params["model"])
    ref_loss = _loss(ref, _batch())
    ref_loss.backward()
    assert grads["count"] is None  # an integer leaf gets no gradient
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss.detach())
    for g, r in zip(tree_leaves(grads["model"]), tree_leaves(ref)):
        torch.testing.assert_close(g, r.grad, atol=0, rtol=0)


def test_four_accumulated_microbatches_equal_one_big_batch():
    params = llama.init(TINY_LLAMA, key(0))
    big_loss, big = value_and_grad(_loss)(params, _batch(8))
    acc_loss, acc = accumulate(value_and_grad(_loss), 4)(params, _batch(8))
    torch.testing.assert_close(acc_loss, big_loss, atol=1e-6, rtol=0)
    for a, b in zip(tree_leaves(acc), tree_leaves(big)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_split_batch_error_names_the_fix():
    with pytest.raises(ValueError, match="multiple of training.microbatches"):
        split_batch(_batch(6), 4)


def test_remat_gives_the_same_gradients():
    params = llama.init(TINY_LLAMA, key(0))
    f = lambda p, b: _loss(p, b)  # noqa: E731
    _, plain = value_and_grad(f)(params, _batch())
    _, rematted = value_and_grad(remat(f))(params, _batch())
    for a, b in zip(tree_leaves(plain), tree_leaves(rematted)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _state(opt):
    params = {"w": torch.ones(3)}
    return TrainState(step=4, params=params, opt_state=opt.init(params), data_state={"epoch": 0, "seq": 0}, rng=key(0))


def test_nonfinite_loss_stops_with_the_step_named():
    opt = optim.sgd(0.1)
    step = make_train_step(value_and_grad(lambda p, b: (p["w"] * b).sum() * float("nan")), opt)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss nan .* at step 5; lower optimizer.lr"):
        step(_state(opt), torch.ones(3))


def test_nonfinite_grad_norm_is_named_not_the_finite_loss():
    opt = optim.sgd(0.1)
    # loss 5.55 (sqrt(0) = 0), gradient 0.5 / sqrt(0) = inf
    step = make_train_step(value_and_grad(lambda p, b: torch.sqrt(p["w"] - b).sum() + 5.55), opt)
    with pytest.raises(
        NonFiniteLossError, match=r"^non-finite grad norm inf \(loss 5\.55\) at step 5; lower optimizer.lr"
    ):
        step(_state(opt), torch.ones(3))


def test_nonfinite_loss_skip_keeps_params():
    opt = optim.sgd(0.1)
    step = make_train_step(value_and_grad(lambda p, b: (p["w"] * b).sum() * float("inf")), opt, on_nonfinite="skip")
    state, out = step(_state(opt), torch.ones(3))
    assert out["skipped"] == 1 and state.step == 5
    assert torch.equal(state.params["w"], torch.ones(3))
    good = make_train_step(value_and_grad(lambda p, b: (p["w"] * b).sum()), opt)
    state, out = good(state, torch.ones(3))
    assert out["skipped"] == 0 and out["loss"] == 3.0
    torch.testing.assert_close(state.params["w"], torch.full((3,), 0.9))


# ------------------------------------------------------------------ the JAX-shaped transforms (issue 12)


from functitan import _remat  # noqa: E402
from functitan.transforms import grad, hessian, hvp, jacfwd, jacrev, jvp, vjp, vmap  # noqa: E402

A = torch.tensor([[1.0, 2.0], [3.0, -1.0]])


def _quad(w, x):  # (w.x)^2: grad_w = 2 (w.x) x, grad_x = 2 (w.x) w, hessian_w = 2 x x^T
    return (w * x).sum() ** 2


def test_value_and_grad_argnums_against_closed_form():
    w, x = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    (value, (gw, gx)) = value_and_grad(_quad, argnums=(0, 1))(w, x)
    assert value.item() == 121.0 and not value.requires_grad
    torch.testing.assert_close(gw, 22.0 * x)
    torch.testing.assert_close(gx, 22.0 * w)
    torch.testing.assert_close(grad(_quad, argnums=1)(w, x), 22.0 * w)
    with pytest.raises(ValueError, match="argnums=2 does not name positional arguments of a call with 2"):
        grad(_quad, argnums=2)(w, x)


def test_has_aux_returns_detached_aux_and_loss():
    def f(p, x):
        y = p["w"] * x
        return y.sum(), {"y": y, "n": 3}

    (loss, aux), g = value_and_grad(f, has_aux=True)({"w": torch.ones(2)}, torch.tensor([2.0, 5.0]))
    assert loss.item() == 7.0 and not loss.requires_grad
    assert not aux["y"].requires_grad and aux["n"] == 3
    torch.testing.assert_close(aux["y"], torch.tensor([2.0, 5.0]))
    torch.testing.assert_close(g["w"], torch.tensor([2.0, 5.0]))
    g2, aux2 = grad(f, has_aux=True)({"w": torch.ones(2)}, torch.tensor([2.0, 5.0]))
    torch.testing.assert_close(g2["w"], g["w"])


def test_accumulate_with_has_aux_equals_one_big_batch():
    params = llama.init(TINY_LLAMA, key(0))

    def f(p, b):
        loss = _loss(p, b)
        return loss, {"loss_x2": 2 * loss}

    (loss, aux), grads = accumulate(value_and_grad(f, has_aux=True), 4)(params, _batch(8))
    (big, _), ref = value_and_grad(f, has_aux=True)(params, _batch(8))
    torch.testing.assert_close(loss, big, atol=1e-6, rtol=0)
    torch.testing.assert_close(aux["loss_x2"], 2 * big, atol=2e-6, rtol=0)
    for a, b in zip(tree_leaves(grads), tree_leaves(ref)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_grad_of_grad_is_the_second_derivative():
    f = lambda x: x**3  # noqa: E731
    x = torch.tensor(2.0)
    assert grad(grad(f))(x).item() == 12.0  # 6x
    assert grad(lambda x: grad(f)(x) * x)(x).item() == 36.0  # d/dx (3x^2 * x) = 9x^2


def test_vmap_grad_gives_per_example_gradients_of_the_debug_llama():
    cfg = llama.config("debug", n_layers=2)
    params = llama.init(cfg, key(1))
    t = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(3))

    def one(p, x, y):
        return llama.loss(p, {"inputs": x[None], "targets": y[None]}, cfg)

    with pytest.warns(UserWarning, match="batching rule"):  # sdpa on CPU has no vmap rule: a loop inside
        per = vmap(grad(one), in_dims=(None, 0, 0))(params, t[:, :-1], t[:, 1:])
    for i in range(3):
        ref = value_and_grad(one)(params, t[i, :-1], t[i, 1:])[1]
        for name, (a, b) in zip(range(10**6), zip(tree_leaves(per), tree_leaves(ref))):
            torch.testing.assert_close(
                a[i], b, atol=2e-6, rtol=1e-4, msg=lambda m, i=i, n=name: f"example {i} leaf {n}: {m}"
            )


def test_jvp_vjp_and_jacobians_of_a_linear_map():
    f = lambda x: torch.tanh(A @ x)  # noqa: E731  J = diag(1 - tanh^2(Ax)) A
    x, v = torch.tensor([0.5, -0.25]), torch.tensor([1.0, 2.0])
    J = torch.diag(1 - torch.tanh(A @ x) ** 2) @ A
    out, tangent = jvp(f, (x,), (v,))
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(tangent, J @ v)
    _, back = vjp(f, x)
    torch.testing.assert_close(back(v)[0], J.T @ v)
    torch.testing.assert_close(jacrev(f)(x), J)
    torch.testing.assert_close(jacfwd(f)(x), J)


def test_hvp_equals_the_hessian_times_the_vector():
    rope.clear_cache()  # the transforms below are the first to build the RoPE tables
    w, x, v = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([0.5, -1.0])
    H = 2 * torch.outer(x, x)
    torch.testing.assert_close(hessian(_quad)(w, x), H)
    torch.testing.assert_close(hvp(_quad, (w, x), (v,)), H @ v)
    # on a pytree of params: the llama head's norm weight, others fixed
    params = llama.init(TINY_LLAMA, key(0))
    b = _batch(2, 8)
    f = lambda nw: _loss({**params, "norm": {"weight": nw}}, b)  # noqa: E731
    nw = params["norm"]["weight"]
    vec = torch.randn(nw.shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hvp(f, (nw,), (vec,)), hessian(f)(nw) @ vec, atol=1e-5, rtol=1e-4)
    value_and_grad(_loss)(params, b)  # and nothing the transforms made escapes into the eager step after them


@pytest.mark.parametrize("policy", ["none", "full", "selective", "offload", _remat.save_only_these_names("h")])
def test_every_remat_policy_gives_the_same_gradients(policy):
    params = llama.init(TINY_LLAMA, key(0))
    _, plain = value_and_grad(_loss)(params, _batch())
    _, rematted = value_and_grad(remat(_loss, policy))(params, _batch())
    for a, b in zip(tree_leaves(plain), tree_leaves(rematted)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # per block, through the Layout
    from functitan.sharding import Layout

    _, per_block = value_and_grad(lambda p, b: llama.loss(p, b, TINY_LLAMA, Layout(remat=policy)))(params, _batch())
    for a, b in zip(tree_leaves(plain), tree_leaves(per_block)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_named_policy_keeps_the_tagged_activation_and_recomputes_the_rest():
    calls = {"sin": 0}

    def f(x):
        calls["sin"] += 1
        return _remat.name(x.sin(), "h").cos()

    x = torch.tensor([1.0, 2.0])
    for policy, forwards in ((_remat.everything_saveable, 1), (_remat.nothing_saveable, 2)):
        calls["sin"] = 0
        g = grad(lambda x, p=policy: remat(f, p)(x).sum())(x)
        assert calls["sin"] == forwards
        torch.testing.assert_close(g, -torch.sin(torch.sin(x)) * torch.cos(x))
    # in backward, the tagged value comes from the cache: the tag op is not run again
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    tag = torch.ops.functitan.checkpoint_name.default
    for policy, tags_in_backward in (
        (_remat.save_only_these_names("h"), 0),
        (_remat.save_only_these_names("other"), 1),
    ):
        xr = x.clone().requires_grad_()
        out = remat(f, policy)(xr).sum()
        with Count() as c:
            out.backward()
        assert c.ops.count(tag) == tags_in_backward, (policy, c.ops)
        torch.testing.assert_close(xr.grad, -torch.sin(torch.sin(x)) * torch.cos(x))


def test_remat_composes_with_vmap_and_rejects_unknown_names():
    w = torch.tensor([1.0, 2.0])
    per = vmap(grad(remat(_quad)), in_dims=(None, 0))(w, torch.eye(2))  # runs plainly under torch.func
    torch.testing.assert_close(per, torch.tensor([[2.0, 0.0], [0.0, 4.0]]))
    with pytest.raises(
        ValueError,
        match=r"training.remat='some' is not a policy; choose one of \('none', 'full', 'selective', 'offload'\)",
    ):
        remat(_quad, "some")


def _fsdp_transforms_worker():
    from torch.distributed.tensor import DTensor

    from functitan.mesh import make_mesh
    from functitan.sharding import Layout, default_rules, place

    mesh = make_mesh(dp_shard=2)
    layout = Layout(mesh, default_rules())
    full = llama.init(TINY_LLAMA, key(0))
    params = place(full, llama.specs(TINY_LLAMA), default_rules(), mesh)
    out = {}
    try:
        vmap(grad(_loss), in_dims=(None, 0))(params, _batch(2))
    except TypeError as e:
        out["error"] = str(e)
    # per-example gradients on the local compute tensors a Layout gathers
    with torch.no_grad():
        compute = layout.params(params)
    b = _batch(2, 8)
    one = lambda p, x, y: _loss(p, {"inputs": x[None], "targets": y[None]})  # noqa: E731
    out["per_example"] = vmap(grad(one), in_dims=(None, 0, 0))(compute, b["inputs"], b["targets"])
    # accumulate + has_aux over DTensor leaves: gradients keep their placements (and are means over ranks)
    f = lambda p, b: (llama.loss(p, b, TINY_LLAMA, layout), {"n": torch.tensor(1.0)})  # noqa: E731
    (loss, aux), grads = accumulate(value_and_grad(f, has_aux=True), 2)(params, _batch(4, seed=dist_rank()))
    w = grads["layers"][0]["attn"]["wq"]
    out["placements"] = (
        type(w).__name__,
        w.placements == params["layers"][0]["attn"]["wq"].placements,
        str(w.placements),
    )
    out["grads"] = tree_map(lambda g: g.full_tensor() if isinstance(g, DTensor) else g, grads)
    out["aux"] = aux["n"].item()
    return out


def dist_rank():
    import torch.distributed as dist

    return dist.get_rank()


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_transforms_on_the_local_tensors_of_an_fsdp_layout(gloo):

    res = gloo.run(_fsdp_transforms_worker, 2, timeout=120)
    assert "pass the local compute tensors (layout.params(params))" in res[0]["error"]
    assert res[0]["placements"][:2] == ("DTensor", True) and "Shard" in res[0]["placements"][2]
    assert res[0]["aux"] == 1.0
    params = llama.init(TINY_LLAMA, key(0))
    b = _batch(2, 8)
    one = lambda p, x, y: _loss(p, {"inputs": x[None], "targets": y[None]})  # noqa: E731
    ref = vmap(grad(one), in_dims=(None, 0, 0))(params, b["inputs"], b["targets"])
    for a, r in zip(tree_leaves(res[1]["per_example"]), tree_leaves(ref)):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)
    # the FSDP gradient is the mean over ranks of each rank's microbatch-accumulated gradient
    both = (
        torch.cat([_batch(4, seed=0)["inputs"], _batch(4, seed=1)["inputs"]]),
        torch.cat([_batch(4, seed=0)["targets"], _batch(4, seed=1)["targets"]]),
    )
    _, want = value_and_grad(_loss)(params, {"inputs": both[0], "targets": both[1]})
    for a, r in zip(tree_leaves(res[0]["grads"]), tree_leaves(want)):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)


def test_every_remat_name_has_one_policy():
    # the config's Literal (RematName) and the policy table are one list of names
    from functitan import _remat

    assert set(_remat._BY_NAME) == set(_remat.REMAT_POLICIES) == {"none", "full", "selective", "offload"}
