"""Tensor parallelism (functitan/_tp.py): q, k, v (and gate, up) share one input collective, and the
gradients still equal one process."""

import pytest
import torch

CFG = dict(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128)


def _grads_and_collectives(sp: bool):
    """(full grads, {collective: calls} in forward, in backward) of llama.loss on TP 2 in fp64."""
    import torch.distributed as dist

    from functitan import _collectives
    from functitan.mesh import make_mesh
    from functitan.random import key
    from functitan.sharding import Layout, default_rules, place
    from models import llama

    cfg = llama.LlamaConfig(**CFG)
    mesh = make_mesh(tp=2)
    layout = Layout(mesh, default_rules(sequence_parallel=sp))
    params = place(llama.init(cfg, key(0), dtype=torch.float64), llama.specs(cfg), layout.rules, mesh)
    tokens = torch.arange(2 * 16).reshape(2, 16) % cfg.vocab_size
    calls: dict[str, int] = {}
    # an all-gather is functitan._collectives.all_gather_now (point to point on gloo, not counted as the dist
    # calls it makes); a reduce-scatter is reduce_scatter_single, or batch_isend_irecv on gloo (PendingReduce)
    names = ("reduce_scatter_single", "batch_isend_irecv", "all_reduce")
    originals = {n: getattr(dist, n) for n in names}
    gather_now = _collectives.all_gather_now
    inside_gather = [False]

    def counting(name, f):
        def call(*args, **kwargs):
            if not inside_gather[0]:
                calls[name] = calls.get(name, 0) + 1
            inside_gather[0] = inside_gather[0] or name == "all_gather_now"
            try:
                return f(*args, **kwargs)
            finally:
                inside_gather[0] = inside_gather[0] and name != "all_gather_now"

        return call

    for n, f in originals.items():
        setattr(dist, n, counting(n, f))
    _collectives.all_gather_now = counting("all_gather_now", gather_now)
    try:
        loss = llama.loss(params, {"inputs": tokens, "targets": tokens.roll(-1, 1)}, cfg, layout)
        forward = dict(calls)
        calls.clear()
        leaves = [p for p in torch.utils._pytree.tree_leaves(params)]
        grads = torch.autograd.grad(loss, leaves)
        backward = dict(calls)
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
        _collectives.all_gather_now = gather_now
    return [g.full_tensor() for g in grads], forward, backward


def _reference():
    from functitan.random import key
    from models import llama

    cfg = llama.LlamaConfig(**CFG)
    params = llama.init(cfg, key(0), dtype=torch.float64)
    leaves = [p.requires_grad_() for p in torch.utils._pytree.tree_leaves(params)]
    tokens = torch.arange(2 * 16).reshape(2, 16) % cfg.vocab_size
    return torch.autograd.grad(llama.loss(params, {"inputs": tokens, "targets": tokens.roll(-1, 1)}, cfg), leaves)


@pytest.mark.parametrize("sp", [True, False])
def test_shared_input_is_gathered_once_per_attention_and_mlp(sp, gloo):
    ref = _reference()
    grads, forward, backward = gloo.run(_grads_and_collectives, 2, sp)[0]
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7)  # rms_norm normalises in fp32
    layers = CFG["n_layers"]
    if sp:
        # per block: one all-gather for q/k/v's input, one for gate/up's (was 3 + 2); one more for the head's
        assert forward.get("all_gather_now") == 2 * layers + 1
        # backward: one reduce-scatter per shared input (the dual), plus the head's
        assert backward.get("batch_isend_irecv", 0) + backward.get("reduce_scatter_single", 0) == 2 * layers + 1
    else:
        # no sequence parallelism: the shared input's gradient is all-reduced once per attention and MLP
        # (2 a block, was 5), plus once for the head's input; forward all-reduces (wo, w_down, embedding,
        # the loss's max / sum / target logit) do not change
        assert backward.get("all_reduce") == 2 * layers + 1
