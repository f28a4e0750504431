"""Muon (functitan.optim.muon): torch.optim.Muon's arithmetic, the Muon/AdamW split from the specs, the same bits on
FSDP and TP shards as on one process, and the trainer with optimizer.name=muon."""

import math

import pytest
import torch
from support import SMALL, TINY_LLAMA, cli, train_small
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim._muon import _zeropower_via_newtonschulz

from functitan import optim
from models import llama

# torch.optim.Muon's default Newton-Schulz coefficients and eps (torch/optim/_muon.py)
TORCH_NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_orthogonalize_is_torchs_newton_schulz_bit_for_bit_per_matrix_of_a_stack():
    for shape in [(16, 24), (40, 12), (7, 7)]:  # wide, tall (transposed), square
        x = _randn(1, *shape)
        assert torch.equal(optim.orthogonalize(x), _zeropower_via_newtonschulz(x, *TORCH_NS))
    stack = _randn(2, 2, 3, 20, 12)  # a stack of 2 x 3 tall matrices, orthogonalised each on its own (batched)
    got = optim.orthogonalize(stack)
    assert got.shape == stack.shape and got.dtype == torch.bfloat16
    for i in range(2):
        for j in range(3):
            assert torch.equal(got[i, j], _zeropower_via_newtonschulz(stack[i, j], *TORCH_NS)), (i, j)
    s = torch.linalg.svdvals(optim.orthogonalize(_randn(3, 32, 48), dtype=torch.float32))
    assert 0.5 < float(s.min()) and float(s.max()) < 1.5  # roughly orthogonal: US'V^T, S' in ~(0.7, 1.2)


# A model's worth of params with their logical names: the Muon/AdamW split reads them.
SPECS = {
    "embed": ("vocab", "embed"),
    "wq": ("heads", "embed"),
    "w_down": ("embed", "mlp"),
    "qkv": ("qkv", "heads", "embed"),
    "qkv_bias": ("qkv", "heads"),
    "norm": ("embed",),
}
SHAPES = {"embed": (11, 8), "wq": (12, 8), "w_down": (8, 20), "qkv": (3, 12, 8), "qkv_bias": (3, 12), "norm": (8,)}
MUON_PARAMS = ("wq", "w_down", "qkv")


def test_the_split_sends_hidden_matrices_to_muon_and_tables_vectors_and_stacked_biases_to_adamw():
    labels = optim.muon_labels_from_specs(SPECS)
    got = {k: labels(k, torch.zeros(s)) for k, s in SHAPES.items()}
    assert [k for k, v in got.items() if v == "muon"] == list(MUON_PARAMS)
    # a router stacks no matrix: AdamW; learned positions are a table; a name without a spec: torch's 2-D rule
    more = optim.muon_labels_from_specs({"router": ("experts", "embed"), "wpe": ("positions", "embed")})
    assert more("router", torch.zeros(4, 8)) == more("wpe", torch.zeros(4, 8)) == "adamw"
    assert more("w_in", torch.zeros(4, 8)) == "muon" and more("w3", torch.zeros(2, 4, 8)) == "adamw"
    experts = optim.muon_labels_from_specs({"w": ("layers", "experts", "mlp", "embed")})
    assert experts("w", torch.zeros(2, 4, 6, 8)) == "muon"
    by_spec = optim.muon_labels_from_specs(llama.specs(TINY_LLAMA))
    assert by_spec("embed.weight", None) == by_spec("output.weight", None) == by_spec("norm.weight", None) == "adamw"
    assert by_spec("layers.0.attn.wq", None) == by_spec("layers.1.mlp.w_down", None) == "muon"
    with pytest.raises(ValueError, match=r"'b' has shape \(3,\); Muon orthogonalises matrices"):
        optim.scale_by_muon().init({"w": torch.zeros(2, 2), "b": torch.zeros(3)})


def _grads(step):
    return {k: _randn(100 + 10 * step + i, *s) for i, (k, s) in enumerate(SHAPES.items())}


@pytest.mark.parametrize("nesterov,adjust_lr", [(True, "original"), (False, "match_rms_adamw")])
def test_muon_with_adamw_for_the_rest_equals_torch_muon_plus_torch_adamw_over_5_steps(nesterov, adjust_lr):
    lr, adam_lr, wd = 0.02, 1e-2, 0.1
    opt = optim.muon(
        lr,
        nesterov=nesterov,
        adjust_lr=adjust_lr,
        weight_decay=wd,
        mask=optim.decay_mask_from_specs(SPECS),
        labels=optim.muon_labels_from_specs(SPECS),
        adam_learning_rate=adam_lr,
        b2=0.95,
    )
    start = {k: _randn(i, *s) for i, (k, s) in enumerate(SHAPES.items())}
    params, state = dict(start), opt.init(start)
    for step in range(5):
        updates, state = opt.update(_grads(step), state, params)
        params = optim.apply_updates(params, updates)

    # torch: Muon on the hidden matrices (the stacked qkv as three 2-D params), AdamW on the rest, decay as the
    # specs say (the vocab table and the norm are not decayed, the stacked bias is)
    ref = {k: v.clone().requires_grad_() for k, v in start.items() if k != "qkv"}
    qkv = [start["qkv"][i].clone().requires_grad_() for i in range(3)]
    muon = torch.optim.Muon(
        [ref["wq"], ref["w_down"], *qkv], lr=lr, weight_decay=wd, nesterov=nesterov, adjust_lr_fn=adjust_lr
    )
    groups = [{"params": [ref["qkv_bias"]], "weight_decay": wd}, {"params": [ref["embed"], ref["norm"]]}]
    adam = torch.optim.AdamW(groups, lr=adam_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for step in range(5):
        g = _grads(step)
        for k, p in ref.items():
            p.grad = g[k]
        for i, p in enumerate(qkv):
            p.grad = g["qkv"][i].clone()
        muon.step()
        adam.step()
    ref["qkv"] = torch.stack(qkv)
    for k in SHAPES:
        # fp32; the iteration's bf16 bits are torch's, the final add rounds in another order (a few ulps)
        torch.testing.assert_close(params[k], ref[k].detach(), rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        assert (params[k] - start[k]).abs().max() > 1e-2, k
    assert set(state.inner_states) == {"muon", "adamw"}
    momentum = state.inner_states["muon"][0].momentum
    assert momentum["embed"] is None and momentum["qkv"].shape == (3, 12, 8)  # state only for Muon's params


# --------------------------------------------------------------------------------------------------------
# Sharded: the same bits as one process, for every placement of a matrix dim and of a stacking dim.

_SHARDED = {  # name: (shape, mesh dims, placements)
    "fsdp_rows": ((9, 6), ("dp_shard",), (Shard(0),)),  # uneven: 5 + 4 rows
    "fsdp_cols": ((6, 10), ("dp_shard",), (Shard(1),)),  # the embed dim, as the trainer shards w_down
    "tp_rows": ((8, 6), ("tp",), (Shard(0),)),  # column-parallel (heads, mlp)
    "tp_cols": ((6, 7), ("tp",), (Shard(1),)),  # row-parallel, uneven
    "tiny": ((1, 3), ("dp_shard",), (Shard(0),)),  # one row: a rank holds an empty shard
    "fsdp_x_tp": ((8, 12), ("dp_shard", "tp"), (Shard(1), Shard(0))),  # FSDP on embed x TP on heads
    "nested": ((12, 6), ("dp_shard", "tp"), (Shard(0), Shard(0))),  # both axes split one dim
    "stack_split": ((4, 6, 5), ("dp_shard",), (Shard(0),)),  # each rank's matrices are whole: no gather
    "stack_and_matrix": ((2, 7, 6), ("dp_shard", "tp"), (Shard(0), Shard(1))),
    "replicated": ((5, 4), ("dp_shard", "tp"), (Replicate(), Replicate())),
    "plain": ((4, 3), (), ()),
}


def _sharded_tree(seed):
    return {k: _randn(seed + i, *shape) for i, (k, (shape, _, _)) in enumerate(_SHARDED.items())}


def _muon_steps(params, grads_per_step):
    opt = optim.muon(0.05, weight_decay=0.1, mask=None, labels=lambda name, p: "muon")
    state = opt.init(params)
    from functitan._dtensor import CountDTensorOps

    with CountDTensorOps() as counted:
        for grads in grads_per_step:
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
    return params, state.inner_states["muon"][0].momentum, counted.count


def _sharded_worker(params, grads_per_step):
    from functitan.mesh import make_mesh

    mesh = make_mesh(dp_shard=2, tp=2, device="cpu")

    def shard(tree):
        out = {}
        for k, (_, dims, pl) in _SHARDED.items():
            out[k] = distribute_tensor(tree[k], mesh[dims], pl, src_data_rank=None) if dims else tree[k]
        return out

    params, momentum, dtensor_ops = _muon_steps(shard(params), [shard(g) for g in grads_per_step])

    def full(t):  # numpy pickles by value
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy()

    placements = {k: str(getattr(momentum[k], "placements", "plain")) for k in _SHARDED}
    return {k: full(v) for k, v in params.items()}, placements, dtensor_ops


def test_muon_on_fsdp_tp_and_stacked_shards_equals_one_process_bit_for_bit(gloo):
    params, grads = _sharded_tree(0), [_sharded_tree(50 + 20 * s) for s in range(3)]
    pending = gloo.submit(_sharded_worker, 4, params, grads, timeout=120)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        reference, _, _ = _muon_steps(params, grads)
    finally:
        torch.set_num_threads(threads)
    for got, placements, dtensor_ops in pending():
        assert dtensor_ops == 0  # gathers on the local shards: no DTensor dispatch on the update's path
        for k in _SHARDED:
            assert torch.equal(torch.from_numpy(got[k]), reference[k]), k
            assert (reference[k] - params[k]).abs().max() > 1e-2, k
        assert placements["fsdp_x_tp"] == "(Shard(dim=1), Shard(dim=0))"  # the momentum stays a shard
        assert placements["plain"] == "plain"


# --------------------------------------------------------------------------------------------------------
# The trainer: optimizer.name=muon from the config, on FSDP and TP as on one process.

# fp32 throughout, as tests/test_parallel.py compares layouts. The iteration in fp32 too: in bf16 (the default)
# one gradient element that the collectives round across a bf16 boundary changes the whole matrix's update
# (Newton-Schulz amplifies small singular directions ~3.4x per step), so bf16 layouts drift apart by ~1e-3 in
# 4 steps, while the optimizer itself is exact on shards (the bit-for-bit test above runs bf16).
MUON_RUN = {**SMALL, "optimizer.name": "muon", "optimizer.muon_ns_dtype": "float32", "training.steps": 4}


def _muon_layouts(run_dir: str):
    layouts = {
        "fsdp2": {"parallelism.dp_shard": 2},
        "tp2": {"parallelism.dp_shard": 1, "parallelism.tp": 2, "parallelism.sequence_parallel": True},
    }
    return {
        name: train_small({**layout, "metrics.run_dir": run_dir, "metrics.run_name": name}, MUON_RUN)[:2]
        for name, layout in layouts.items()
    }


def _one_process(run_dir: str):
    muon = train_small({"metrics.run_dir": run_dir, "metrics.run_name": "one"}, MUON_RUN)
    adamw = train_small({"metrics.run_dir": run_dir, "metrics.run_name": "adamw", "optimizer.name": "adamw"}, MUON_RUN)
    return muon[:2], adamw[0]


def test_the_trainer_with_muon_on_fsdp2_and_tp2_equals_one_process(tmp_path, gloo):
    pending = gloo.submit(_muon_layouts, 2, str(tmp_path))
    (ref_losses, ref_params), adamw_losses = gloo.run(_one_process, 1, str(tmp_path))[0]
    assert ref_losses[0] == adamw_losses[0] and ref_losses[-1] != adamw_losses[-1]  # the same start, another update
    assert ref_losses[-1] < ref_losses[0] - 0.5, ref_losses
    for name, (losses, params) in pending()[0].items():
        # the collectives sum the gradients in another order: ~1e-6 apart after 4 steps
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
        for k, p in params.items():
            torch.testing.assert_close(p, ref_params[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{name} {k}: {m}")


def test_muon_through_the_cli_as_typed_trains_and_its_keys_have_help(tmp_path):
    from functitan.cli import main

    tiny = ["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64"]
    args = [*tiny, "--training.batch_size=4", "--training.seq_len=16", "--data.max_corpus_bytes=100000"]
    args += ["--training.steps=10", "--optimizer.lr=2e-2", "--optimizer.warmup_steps=2", "--metrics.log_every=1"]
    args += ["--optimizer.name=muon", "--optimizer.ns_steps=5", "--optimizer.muon_momentum=0.9"]
    assert main(["train", *args, f"--metrics.run_dir={tmp_path}", "--metrics.run_name=m"]) == 0
    import json

    losses = [json.loads(line)["loss"] for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    out = cli("train", "--help").stdout
    for key in ("muon_momentum", "ns_steps", "muon_adjust_lr"):
        assert f"--optimizer.{key}" in out, key
    bad = cli("train", "--optimizer.name=muon", "--optimizer.ns_steps=0", "--dry-run")
    assert bad.returncode != 0 and "ns_steps" in bad.stderr, bad.stderr


def test_build_optimizer_muon_is_optim_muon_with_the_configs_values():
    from functitan.job_config import OptimizerConfig, build_optimizer, learning_rate_schedule

    cfg = OptimizerConfig(
        name="muon", lr=1e-2, weight_decay=0.05, b1=0.8, b2=0.97, muon_momentum=0.9, ns_steps=4, warmup_steps=2
    )
    labels = optim.muon_labels_from_specs(SPECS)
    mask = optim.decay_mask_from_specs(SPECS)
    mine = build_optimizer(cfg, 10, decay_mask=mask, muon_labels=labels)
    lr = learning_rate_schedule(cfg, 10)
    by_hand = optim.muon(
        lr,
        momentum=0.9,
        ns_steps=4,
        weight_decay=0.05,
        adjust_lr="match_rms_adamw",
        mask=mask,
        labels=labels,
        b1=0.8,
        b2=0.97,
        adam_eps=1e-8,
    )
    start = {k: _randn(i, *s) for i, (k, s) in enumerate(SHAPES.items())}
    results = []
    for opt in (mine, by_hand):
        params, state = dict(start), opt.init(start)
        for step in range(3):
            updates, state = opt.update(_grads(step), state, params)
            params = optim.apply_updates(params, updates)
        results.append(params)
    for k in SHAPES:
        assert torch.equal(results[0][k], results[1][k]) and not torch.equal(results[0][k], start[k]), k


def test_docstring_examples_run():
    import doctest

    from functitan.optim import _muon

    result = doctest.testmod(_muon)
    assert result.attempted > 0 and result.failed == 0
