"""Rules -> placements (precedence, size-1 axes), place(), and the Layout's explicit collectives."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from functitan.mesh import make_mesh, resolve_degrees
from functitan.sharding import Layout, default_rules, logical_to_mesh_axes, place, spec_placements

FLAX_EXAMPLE = (("mlp", "tp"), ("embed", "dp_shard"), ("mlp", "dp_shard"))
DOC_EXAMPLE = (("mlp", "tp"), ("embed", "tp"), ("embed", "dp_shard"))  # docs/parallelism.md and _rules.py


def test_precedence_earlier_rule_wins_as_in_flax():
    assert logical_to_mesh_axes(("mlp", "embed"), FLAX_EXAMPLE) == (("tp",), ("dp_shard",))
    assert logical_to_mesh_axes(("embed", "mlp"), FLAX_EXAMPLE) == (("dp_shard",), ("tp",))
    # the documented example: rules apply in order, not dims left to right
    assert logical_to_mesh_axes(("embed", "mlp"), DOC_EXAMPLE) == (("dp_shard",), ("tp",))
    assert logical_to_mesh_axes(("embed",), DOC_EXAMPLE) == (("tp",),)
    # a rule looks at the first dim of its name only (flax's array_dim_names.index)
    assert logical_to_mesh_axes(("mlp", "mlp"), FLAX_EXAMPLE) == (("tp",), ())
    # an unknown name, or None, is replicated
    assert logical_to_mesh_axes((None, "unknown"), FLAX_EXAMPLE) == ((), ())
    # a rule may map to several axes: batch over both data-parallel axes
    assert logical_to_mesh_axes(("batch", "seq"), default_rules()) == (("dp_replicate", "dp_shard"), ())
    assert logical_to_mesh_axes(("batch", "seq"), default_rules(sequence_parallel=True)) == (
        ("dp_replicate", "dp_shard"),
        ("tp",),
    )


def test_degrees_fill_and_errors():
    assert resolve_degrees(8, dp_replicate=2, dp_shard=-1, tp=2) == {
        "pp": 1,
        "dp_replicate": 2,
        "dp_shard": 2,
        "cp": 1,
        "tp": 2,
    }
    with pytest.raises(
        ValueError,
        match=r"parallelism.dp_shard=-1: the other degrees multiply to 3, which does not divide the world size 4",
    ):
        resolve_degrees(4, dp_shard=-1, tp=3)
    with pytest.raises(ValueError, match=r"dp_shard=3 x cp=1 x tp=1 = 3 ranks, but the world size is 2"):
        resolve_degrees(2, dp_shard=3)
    with pytest.raises(ValueError, match="only one degree may be -1"):
        resolve_degrees(4, dp_shard=-1, tp=-1)


def _placements_on_2x2():
    mesh = make_mesh(dp_shard=2, tp=2)
    rules = default_rules()
    got = {
        "wq": spec_placements(("heads", "embed"), rules, mesh),
        "wo": spec_placements(("embed", "heads"), rules, mesh),
        "norm": spec_placements(("embed",), rules, mesh),
        "doc": spec_placements(("embed", "mlp"), DOC_EXAMPLE, mesh),
    }
    tp1 = make_mesh(dp_shard=4, tp=1)  # size-1 tp: the "heads" rule shards nothing
    got["wq_tp1"] = spec_placements(("heads", "embed"), rules, tp1)
    return got


def test_rules_to_placements_on_a_real_mesh(gloo):
    got = gloo.run(_placements_on_2x2, 4)[0]
    R = Replicate()
    # mesh axes are (pp, dp_replicate, dp_shard, ep, cp, tp)
    assert got["wq"] == (R, R, Shard(1), R, R, Shard(0))  # FSDP on embed, TP column-parallel on heads
    assert got["wo"] == (R, R, Shard(0), R, R, Shard(1))  # TP row-parallel
    assert got["norm"] == (R, R, Shard(0), R, R, R)
    assert got["doc"] == (R, R, Shard(0), R, R, Shard(1))  # the documented precedence example
    assert got["wq_tp1"] == (R, R, Shard(1), R, R, R)  # size-1 axes mean Replicate


def test_spec_errors_name_the_key_path():
    mesh = make_mesh()
    with pytest.raises(ValueError, match=r"layers.0.attn.wq: spec \('heads',\) names 1 dims but the tensor has 2"):
        place(
            {"layers": [{"attn": {"wq": torch.ones(2, 2)}}]},
            {"layers": [{"attn": {"wq": ("heads",)}}]},
            default_rules(),
            mesh,
        )
    with pytest.raises(ValueError, match=r"names mesh axis 'fsdp', which the mesh does not have"):
        spec_placements(("embed",), (("embed", "fsdp"),), mesh)
    with pytest.raises(ValueError, match=r"params and specs differ at '<root>': keys only in the first: \['b'\]"):
        place({"a": torch.ones(2), "b": torch.ones(2)}, {"a": ("embed",)}, default_rules(), mesh)


def _fsdp_gather_and_grad(degrees):
    torch.manual_seed(0)
    w = torch.randn(6, 5, dtype=torch.float64)
    x = torch.randn(8, 5, dtype=torch.float64)
    mesh = make_mesh(**degrees)
    layout = Layout(mesh, default_rules())
    p = place({"w": w}, {"w": ("mlp", "embed")}, layout.rules, mesh)["w"]
    rows = x.chunk(layout.dp_size)[layout.dp_rank]
    loss = (rows @ layout.param(p).T).square().mean()
    (g,) = torch.autograd.grad(loss, [p])
    return tuple(p.placements), tuple(g.placements), g.full_tensor()


@pytest.mark.parametrize(
    "degrees", [dict(dp_shard=2), dict(dp_replicate=2, dp_shard=1), dict(dp_shard=4), dict(dp_replicate=2, dp_shard=2)]
)
def test_layout_param_grads_equal_single_process(degrees, gloo):
    torch.manual_seed(0)
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 5, dtype=torch.float64)
    (ref,) = torch.autograd.grad((x @ w.T).square().mean(), [w])
    world = degrees.get("dp_shard", 1) * degrees.get("dp_replicate", 1)
    for placements, grad_placements, g in gloo.run(_fsdp_gather_and_grad, world, degrees):
        assert placements == grad_placements  # grads keep the storage placement
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-14)
    if degrees.get("dp_shard", 1) == 4:  # 5 columns over 4 shards: uneven, still exact
        assert placements == (Shard(1),)  # on the storage mesh: dp_shard alone


def _constrain_activation():
    from functitan.sharding import constrain

    mesh = make_mesh(dp_shard=2)
    x = torch.arange(8.0).reshape(4, 2)  # (batch, embed): this rank's view of the full value
    sharded = constrain(x, ("batch", "embed"), default_rules(), mesh)
    whole = constrain(sharded, (None, None), default_rules(), mesh)  # redistributed: all-gathered
    by_embed = constrain(whole, (None, "embed"), default_rules(), mesh)  # the same table: embed -> dp_shard
    return (
        tuple(sharded.placements),
        sharded.to_local().tolist(),
        tuple(whole.placements),
        whole.to_local().tolist(),
        tuple(by_embed.placements),
    )


def test_constrain_lays_out_activations_by_name(gloo):
    R = Replicate()
    for rank, (pl, local, whole_pl, whole, by_embed) in enumerate(gloo.run(_constrain_activation, 2)):
        # on the storage mesh, dp_shard alone: batch -> (dp_replicate, dp_shard), and dp_replicate has size 1
        assert pl == (Shard(0),)
        assert local == torch.arange(8.0).reshape(4, 2)[2 * rank : 2 * rank + 2].tolist()
        assert whole_pl == (R,) and whole == torch.arange(8.0).reshape(4, 2).tolist()
        assert by_embed == (Shard(1),)


def _constrain_grads():
    from functitan.sharding import constrain

    mesh = make_mesh(dp_shard=2)
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3).requires_grad_(True)
    y = x * 2  # a non-leaf activation, as inside any forward
    d = constrain(y, ("batch", "embed"), default_rules(), mesh)  # batch over dp_shard
    assert isinstance(d, DTensor) and d.placements == (Shard(0),) and d.to_local().shape == (2, 3)
    (d.to_local() ** 2).sum().backward()  # each rank's share of sum(y**2)
    g = x.grad.clone()
    dist.all_reduce(g)
    again = constrain(d, (None, None), default_rules(), mesh)  # a DTensor is redistributed
    return g, again.to_local()


def test_constrain_works_on_activations_inside_a_forward(gloo):
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    for g, full in gloo.run(_constrain_grads, 2):
        torch.testing.assert_close(g, 8 * x)  # d/dx sum((2x)^2), whatever the shards
        torch.testing.assert_close(full, 2 * x)


def test_params_live_on_the_mesh_axes_of_more_than_one_rank():
    # DTensor's sharding propagation expands an op's strategies over every mesh dim, size 1 or not: on the
    # six-axis mesh a user's first ``p * 0.5 + p`` on a shape took minutes; on the storage mesh, milliseconds
    mesh = make_mesh(device="cpu")  # one process: every axis has one rank
    p = place({"w": torch.ones(5, 3)}, {"w": ("mlp", "embed")}, default_rules(), mesh)["w"]
    assert p.device_mesh.mesh_dim_names == ("pp",) and p.placements == (Replicate(),)
    start = time.perf_counter()
    q = (p * 0.5 + p).to(torch.bfloat16)
    assert time.perf_counter() - start < 5
    assert torch.equal(q.full_tensor(), torch.full((5, 3), 1.5, dtype=torch.bfloat16))


def test_place_cuts_only_this_ranks_shard_as_distribute_tensor_would():
    # the planner places params at FSDP 8192; cutting all 8192 chunks to keep one was most of its trace time
    from torch.distributed.tensor import distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from functitan.plan._trace import fake_world

    class Outputs(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.n += len(out) if isinstance(out, (list, tuple)) else 1
            return out

    if dist.is_initialized():  # the fake world is this process's own (make_mesh() above made a 1-rank group)
        dist.destroy_process_group()
    full = {"wq": torch.arange(6000.0).reshape(1000, 6), "norm": torch.arange(7.0)}  # both uneven over 2048
    specs = {"wq": ("embed", "heads"), "norm": ("embed",)}
    for rank in (1, 4095):  # a full shard, and the last rank's (empty: 1000 rows in 2048 chunks of 1)
        with fake_world(4096, rank):
            mesh = make_mesh(dp_shard=2048, tp=2)
            counter = Outputs()
            with counter:
                placed = place(full, specs, default_rules(), mesh)
            assert counter.n < 10 * len(full)  # about two tensors per leaf, not one per rank
            for k, x in full.items():
                pl = placed[k].placements
                want = distribute_tensor(x, placed[k].device_mesh, pl, src_data_rank=None)
                assert placed[k].device_mesh.mesh_dim_names == ("dp_shard", "tp")  # the storage mesh
                assert placed[k].to_local().shape == want.to_local().shape, (rank, k)
                assert torch.equal(placed[k].to_local(), want.to_local()), (rank, k)
                assert placed[k].shape == x.shape and placed[k].requires_grad
                assert placed[k].to_local().untyped_storage().nbytes() <= want.to_local().untyped_storage().nbytes()
