"""The whole train step under torch.compile (functitan/step.py's ``compile``): one graph, no breaks, the same
numbers as the eager step."""

import functools
import warnings

import pytest
import torch
from support import TINY_LLAMA

from functitan import optim
from functitan.random import key
from functitan.step import make_train_step
from functitan.train_state import TrainState
from functitan.transforms import value_and_grad
from functitan.tree import tree_leaves
from models import llama


def _batch(seed):
    t = torch.randint(0, TINY_LLAMA.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _state(opt):
    params = llama.init(TINY_LLAMA, key(0))
    for p in tree_leaves(params):
        p.requires_grad_(True)
    return TrainState(step=0, params=params, opt_state=opt.init(params), data_state={}, rng=key(0))


def _step(compile, opt=None):
    opt = opt or optim.adamw(
        optim.warmup_cosine(1e-2, 2, 10), mask=optim.decay_mask_from_specs(llama.specs(TINY_LLAMA))
    )
    grad_fn = value_and_grad(functools.partial(llama.loss, cfg=TINY_LLAMA))
    return opt, make_train_step(grad_fn, opt, max_norm=1.0, compile=compile)


def test_the_whole_step_is_one_graph_without_breaks():
    opt, step = _step("aot_eager")
    state = _state(opt)
    explained = step.explain(state.params, state.opt_state, _batch(0))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_compiled_step_trains_like_the_eager_step_and_compiles_once():
    torch._dynamo.reset()
    opt, eager = _step(False)
    _, compiled = _step("aot_eager", opt)
    a, b = _state(opt), _state(opt)
    from torch._dynamo.utils import counters

    counters.clear()
    for i in range(4):
        a, ma = eager(a, _batch(i))
        b, mb = compiled(b, _batch(i))
        assert abs(ma["loss"] - mb["loss"]) < 1e-5 and abs(ma["grad_norm"] - mb["grad_norm"]) < 1e-4, (i, ma, mb)
    assert counters["stats"]["unique_graphs"] == 1  # steps 2..4 reuse step 1's graph: counters are tensors
    for x, y in zip(tree_leaves(a.params), tree_leaves(b.params)):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
        assert y.requires_grad and y.is_leaf
    assert int(b.opt_state[0].count) == 4


def test_a_loss_with_aux_outputs_trains_and_reports_them_eager_donated_and_compiled():
    """``value_and_grad(loss, has_aux=True)`` into the step (it failed on ``tuple.float``): the aux outputs come
    back detached in the metrics, the same on every path, and the training matches the aux-free loss."""
    torch._dynamo.reset()

    def with_aux(params, batch):
        loss = llama.loss(params, batch, TINY_LLAMA)
        return loss, {"twice": 2 * loss, "tokens": batch["targets"].numel()}

    opt = optim.adamw(1e-2)
    plain = make_train_step(value_and_grad(functools.partial(llama.loss, cfg=TINY_LLAMA)), opt, max_norm=1.0)
    ref, _ = plain(_state(opt), _batch(0))
    for kwargs in ({}, {"donate": True}, {"compile": "aot_eager"}):
        step = make_train_step(value_and_grad(with_aux, has_aux=True), opt, max_norm=1.0, **kwargs)
        state, metrics = step(_state(opt), _batch(0))
        aux = metrics["aux"]
        assert aux["tokens"] == 16 and not aux["twice"].requires_grad, kwargs
        assert float(aux["twice"]) == pytest.approx(2 * metrics["loss"], rel=1e-6), kwargs
        for x, y in zip(tree_leaves(ref.params), tree_leaves(state.params)):
            torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-5)
    with pytest.raises(TypeError, match=r"has_aux=True\): 'loss' returned a Tensor; with has_aux it returns"):
        value_and_grad(llama.loss, has_aux=True)(llama.init(TINY_LLAMA, key(0)), _batch(0), TINY_LLAMA)


# ------------------------------------------------------------------------------------ under FSDP, TP + SP and CP
# Two gloo processes, params sharded over dp_shard=2 (or tp=2 with sequence parallelism, or cp=2 with the sequence
# split over it): the compiled step still
# traces as one graph (the FSDP all-gathers and reduce-scatters or the TP gathers and reduce-scatters, the gradient,
# the norm all-reduce and the AdamW update on the shards), and it trains like the eager step on the same layout
# and like one process on the whole batch. The workers record every warning: dynamo warns about what it traces
# badly (an lru_cache on the path, say), and pytest's warnings-as-errors do not reach other processes.

FSDP_STEPS = 3


def _fsdp_batch(seed, rank=None):
    """The whole batch, or a data-parallel rank's half of it (the mean of means is the mean)."""
    t = torch.randint(0, TINY_LLAMA.vocab_size, (4, 9), generator=torch.Generator().manual_seed(seed))
    t = t if rank is None else t[2 * rank : 2 * rank + 2]
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _fsdp_opt():
    return optim.adamw(optim.warmup_cosine(1e-2, 2, 10), mask=optim.decay_mask_from_specs(llama.specs(TINY_LLAMA)))


def _fsdp_run(layout_name):
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from functitan.mesh import make_mesh
    from functitan.sharding import Layout, default_rules, place

    if layout_name == "fsdp":
        mesh, rules = make_mesh(dp_shard=2), default_rules()
    elif layout_name.startswith("cp"):  # every rank sees the whole batch, its chunks of the sequence
        mesh, rules = make_mesh(cp=2), default_rules()
    else:  # tp_sp: every rank sees the whole batch
        mesh, rules = make_mesh(tp=2), default_rules(sequence_parallel=True)
    layout = Layout(mesh, rules, cp_attention=layout_name[3:] if layout_name.startswith("cp") else "allgather")
    data_rank = dist.get_rank() if layout_name == "fsdp" else None
    opt = _fsdp_opt()
    grad_fn = value_and_grad(functools.partial(llama.loss, cfg=TINY_LLAMA, layout=layout))
    steps = {c: make_train_step(grad_fn, opt, max_norm=1.0, compile=c) for c in (False, "aot_eager")}
    states = {}
    for c in steps:
        params = place(llama.init(TINY_LLAMA, key(0)), llama.specs(TINY_LLAMA), layout.rules, mesh)
        states[c] = TrainState(step=0, params=params, opt_state=opt.init(params), data_state={}, rng=key(0))
    # dynamo's own counters of the compiled run (one trace; explain() would trace the step a second time)
    losses = {c: [] for c in steps}
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(FSDP_STEPS):
            for c, step in steps.items():
                states[c], m = step(states[c], _fsdp_batch(i, data_rank))
                losses[c].append((m["loss"], m["grad_norm"]))
    full = {c: [x.full_tensor() for x in tree_leaves(s.params)] for c, s in states.items()}
    breaks = counters["graph_break"]
    return (
        (counters["stats"]["unique_graphs"], sum(breaks.values()), counters["stats"]["calls_captured"] > 0),
        [str(r)[:300] for r in breaks] + [str(w.message)[:300] for w in caught],
        losses,
        full,
    )


# cp: params sharded over cp, K/V all-gathered (the default) or passed around the ring, one graph with the step.
# The ring's send/receive traces as one functional all-to-all per exchange (its p2p work handles broke the graph,
# and dynamo then failed rebuilding a DTensor, torch 2.13). (Ulysses traced as one graph too, 18 s more here.)
@pytest.mark.parametrize("layout_name", ["fsdp", "tp_sp", "cp_allgather", "cp_ring"])
def test_compiled_sharded_step_has_no_graph_breaks_and_trains_like_eager_and_one_process(layout_name, gloo):

    opt = _fsdp_opt()
    ref = _state(opt)
    eager = make_train_step(value_and_grad(functools.partial(llama.loss, cfg=TINY_LLAMA)), opt, max_norm=1.0)
    ref_losses = []
    for i in range(FSDP_STEPS):
        ref, m = eager(ref, _fsdp_batch(i))
        ref_losses.append((m["loss"], m["grad_norm"]))
    # TP sums partial products in another order than one process; three Adam steps at lr 1e-2 grow that to ~2e-5
    tol = dict(atol=1e-5, rtol=1e-4) if layout_name == "fsdp" else dict(atol=1e-4, rtol=1e-3)
    for rank, (graphs, reasons, losses, full) in enumerate(gloo.run(_fsdp_run, 2, layout_name)):
        assert (graphs, reasons) == ((1, 0, True), []), rank  # one graph, no break or warning; compiled once
        for c in (False, "aot_eager"):
            torch.testing.assert_close(losses[c], ref_losses, atol=1e-5, rtol=1e-5, msg=lambda m, c=c: f"{c}: {m}")
            for x, y in zip(full[c], tree_leaves(ref.params)):
                torch.testing.assert_close(x, y.detach(), **tol)
        for x, y in zip(full[False], full["aot_eager"]):  # compiled and eager FSDP: the same arithmetic
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
