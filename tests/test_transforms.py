import pytest
import torch

from functitan import optim
from functitan.random import key
from functitan.step import NonFiniteLossError, make_train_step
from functitan.train_state import TrainState
from functitan.transforms import accumulate, remat, split_batch, value_and_grad
from functitan.tree import tree_leaves, tree_map
from models import llama

CFG = llama.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)


def _batch(n=8, s=16, seed=0):
    t = torch.randint(0, CFG.vocab_size, (n, s + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _loss(params, batch):
    return llama.loss(params, batch, CFG)


def test_value_and_grad_matches_autograd_and_skips_integer_leaves():
    params = {"model": llama.init(CFG, key(0)), "count": torch.tensor(3)}
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
    params = llama.init(CFG, key(0))
    big_loss, big = value_and_grad(_loss)(params, _batch(8))
    acc_loss, acc = accumulate(value_and_grad(_loss), 4)(params, _batch(8))
    torch.testing.assert_close(acc_loss, big_loss, atol=1e-6, rtol=0)
    for a, b in zip(tree_leaves(acc), tree_leaves(big)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_split_batch_error_names_the_fix():
    with pytest.raises(ValueError, match="multiple of training.microbatches"):
        split_batch(_batch(6), 4)


def test_remat_gives_the_same_gradients():
    params = llama.init(CFG, key(0))
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
    with pytest.raises(NonFiniteLossError, match=r"^non-finite grad norm inf \(loss 5\.55\) at step 5; lower optimizer.lr"):
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
