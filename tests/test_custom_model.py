"""A model that is not Llama gets FSDP, TP and sequence parallelism by annotating its params and contractions."""

import pytest
import torch
import torch.nn.functional as F

from functitan.mesh import make_mesh
from functitan.random import fold_in, generator, key
from functitan.sharding import Layout, default_rules, place
from functitan.testing import run_distributed
from functitan.transforms import value_and_grad
from functitan.tree import flatten_with_names, map_with_names

VOCAB, DIM, HIDDEN, LAYERS = 40, 16, 32, 2


def specs():
    # the only sharding the model declares: logical names per parameter dim
    layer = {"norm": ("embed",), "w_in": ("mlp", "embed"), "w_out": ("embed", "mlp")}
    return {"embed": ("vocab", "embed"), "layers": [dict(layer) for _ in range(LAYERS)]}


def init(k):
    shapes = {"embed": (VOCAB, DIM), "layers": [{"norm": (DIM,), "w_in": (HIDDEN, DIM), "w_out": (DIM, HIDDEN)} for _ in range(LAYERS)]}
    return map_with_names(lambda n, s: torch.randn(s, generator=generator(fold_in(k, n))) * 0.3, shapes,
                          is_leaf=lambda s: isinstance(s, tuple))


def block(p, x, layout):
    h = F.layer_norm(x, (DIM,))
    h = layout.einsum("batch seq embed, embed -> batch seq embed", h, p["norm"])
    h = F.gelu(layout.einsum("batch seq embed, mlp embed -> batch seq mlp", h, p["w_in"]))
    return x + layout.einsum("batch seq mlp, embed mlp -> batch seq embed", h, p["w_out"])


def loss(params, batch, layout=Layout()):
    table = layout.param(params["embed"])
    x = layout.embed(batch["inputs"], table, VOCAB)
    for p in params["layers"]:
        x = layout.block(block, p, x, layout)
    logits = layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, table)  # tied head
    return layout.cross_entropy(logits, batch["targets"], VOCAB)


def _batch():
    t = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _grads(degrees, sp):
    mesh = make_mesh(**degrees)
    layout = Layout(mesh, default_rules(sequence_parallel=sp))
    params = place(init(key(0)), specs(), layout.rules, mesh)
    b = {k: v.chunk(layout.dp_size)[layout.dp_rank] for k, v in _batch().items()}
    value, grads = value_and_grad(loss)(params, b, layout)
    value = value.clone()
    torch.distributed.all_reduce(value)
    return value.item() / torch.distributed.get_world_size(), {n: g.full_tensor() for n, g in flatten_with_names(grads)[0]}


@pytest.mark.parametrize("degrees,sp", [(dict(dp_shard=2), False), (dict(dp_shard=1, tp=2), True), (dict(dp_shard=2, tp=2), False)])
def test_custom_model_gets_every_layout(degrees, sp):
    ref_loss, ref_grads = value_and_grad(loss)(init(key(0)), _batch())
    world = degrees.get("dp_shard", 1) * degrees.get("tp", 1)
    value, grads = run_distributed(_grads, world, degrees, sp)[0]
    assert value == pytest.approx(ref_loss.item(), abs=1e-6)
    for name, g in flatten_with_names(ref_grads)[0]:
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
