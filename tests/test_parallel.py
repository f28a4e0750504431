"""Every layout from one config equals one process: {DDP 4, FSDP 4, HSDP 2x2, FSDP 2 x TP 2, TP 4 + SP}
x {no checkpointing, full, selective}, 5 steps of the trainer in fp32."""

import pytest
import torch
from support import LAYOUTS, SMALL, train_small

# fp32, same global batch and data. Collectives sum in another order than one process does, and AdamW's
# m / sqrt(v) amplifies that rounding on tiny gradients: losses agree to 2e-5, params after 5 steps to 1e-4.
LOSS_TOL = dict(atol=2e-5, rtol=1e-4)
PARAM_TOL = dict(atol=1e-4, rtol=1e-3)
REMATS = ("none", "full", "selective")


def _train_all_remats(layout: dict, run_dir: str):
    return [
        train_small({**layout, "training.remat": r, "metrics.run_dir": run_dir, "metrics.run_name": r})[:2]
        for r in REMATS
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, gloo):
    return gloo.run(
        train_small, 1, {"metrics.run_dir": str(tmp_path_factory.mktemp("ref")), "metrics.run_name": "ref"}
    )[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process(name, reference, tmp_path, gloo):
    ref_losses, ref_params, _ = reference
    results = gloo.run(_train_all_remats, 4, LAYOUTS[name], str(tmp_path), timeout=280)
    for remat, (losses, params) in zip(REMATS, results[0]):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), **LOSS_TOL, msg=lambda m: f"{name}/{remat} losses: {m}"
        )
        for key, p in params.items():
            torch.testing.assert_close(p, ref_params[key], **PARAM_TOL, msg=lambda m, k=key: f"{name}/{remat} {k}: {m}")


def _state_bytes(degrees: dict, run_dir: str) -> int:
    """Bytes of the storages this rank actually holds for params + AdamW state after one step."""
    from functitan.config import apply_overrides
    from functitan.job_config import JobConfig
    from functitan.train import run
    from functitan.tree import tree_leaves

    cfg = apply_overrides(
        JobConfig(),
        {
            **SMALL,
            **{f"parallelism.{k}": v for k, v in degrees.items()},
            "training.steps": 1,
            "metrics.run_dir": run_dir,
            "metrics.run_name": "m",
        },
    )
    state = run(cfg)["state"]
    storages = {}
    for x in tree_leaves((state.params, state.opt_state)):
        if isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_fsdp4_holds_a_quarter_of_params_and_optimizer_state(tmp_path, gloo):
    single = gloo.run(_state_bytes, 1, {}, str(tmp_path))[0]
    per_rank = gloo.run(_state_bytes, 4, {"dp_shard": 4}, str(tmp_path))
    for b in per_rank:
        assert 0.24 < b / single < 0.27, (b, single)  # a quarter, plus the 0-d step counters held whole


def _train_pipelined(layout: dict, run_dir: str):
    return train_small({**layout, "metrics.run_dir": run_dir, "metrics.run_name": "pp"})[:2]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])  # 2 layers: one stage per rank
def test_trainer_with_pipeline_stages_equals_one_process(schedule, reference, tmp_path, gloo):
    ref_losses, ref_params, _ = reference
    layout = {
        "parallelism.pp": 2,
        "parallelism.dp_shard": 1,
        "parallelism.pipeline_schedule": schedule,
        "parallelism.reshard_after_forward": False,
        "training.microbatches": 4,
    }
    results = gloo.run(_train_pipelined, 2, layout, str(tmp_path))
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(ref_losses), **LOSS_TOL)
    params = {**results[0][1], **results[1][1]}  # each pipeline rank holds its stages' params
    assert params.keys() == ref_params.keys()
    for key, p in params.items():
        torch.testing.assert_close(p, ref_params[key], **PARAM_TOL, msg=lambda m, k=key: f"pp2/{schedule} {k}: {m}")


def _gathered_alive_after_forward(reshard: bool) -> tuple[int, int]:
    """(gathered block params whose storage is still alive after an FSDP-2 forward, how many were gathered)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from functitan import _collectives
    from functitan.mesh import make_mesh
    from functitan.random import key
    from functitan.sharding import Layout, default_rules, place
    from models import llama

    refs = []
    gather = _collectives.bucket_all_gather

    def recording(*args, **kwargs):
        out = gather(*args, **kwargs)
        if torch.is_grad_enabled():  # forward gathers (the backward's re-gathers run without grad)
            refs.append([StorageWeakRef(t.untyped_storage()) for t in out])
        return out

    _collectives.bucket_all_gather = recording
    start = _collectives.start_bucket_gather
    prefetches = []
    _collectives.start_bucket_gather = lambda *a, **k: prefetches.append(1) or start(*a, **k)
    cfg = llama.LlamaConfig(vocab_size=64, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=128)
    mesh = make_mesh(dp_shard=2)
    layout = Layout(mesh, default_rules(), reshard_after_forward=reshard)
    params = place(llama.init(cfg, key(0)), llama.specs(cfg), layout.rules, mesh)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    loss = llama.loss(params, {"inputs": tokens, "targets": tokens}, cfg, layout)
    block_refs = [r for call in refs[1:] for r in call]  # refs[0]: embedding/norm/head, held like FSDP2's root
    alive = sum(not r.expired() for r in block_refs)
    assert len(prefetches) == 3  # blocks 1-3 were gathered while the previous block computed
    loss.backward()  # the re-gather in backward works
    # resharded: blocks 2, 1, 0 were re-gathered while the next block's backward computed
    assert len(prefetches) == (6 if reshard else 3)
    return alive, len(block_refs)


def test_reshard_after_forward_frees_gathered_params(gloo):
    alive, gathered = gloo.run(_gathered_alive_after_forward, 2, False)[0]
    assert gathered == 4 * 9 and alive == gathered  # 4 blocks x 9 params, all kept for backward
    alive, gathered = gloo.run(_gathered_alive_after_forward, 2, True)[0]
    assert gathered == 4 * 9 and alive == 0  # resharded: every block's gathered params died after its forward


def _async_reduce_scatter_events(remat: str = "none") -> tuple[list[str], float]:
    """(the reduce-scatter starts / waits and (re-)gathers of one FSDP-2 backward in order, the largest gradient
    difference from one process's on the global batch)."""
    from functitan import _collectives
    from functitan.mesh import make_mesh
    from functitan.random import key
    from functitan.sharding import Layout, default_rules, place
    from models import llama

    events: list[str] = []
    box, gather = _collectives.PendingReduce, _collectives.bucket_all_gather
    start, wait = box.start, box.wait

    def logged_start(self, out, flat, group, *, async_op=True):
        if not async_op:
            events.append("sync")  # then its own "wait"
        start(self, out, flat, group, async_op=async_op)
        if async_op:
            events.append("async")  # issued at the end of start, after any wait on the one in flight

    def logged_wait(self):
        if self.work is not None:
            events.append("wait")
        wait(self)

    def logged_gather(*args, **kwargs):
        events.append("gather" if not torch.is_grad_enabled() else "forward")
        return gather(*args, **kwargs)

    box.start, box.wait, _collectives.bucket_all_gather = logged_start, logged_wait, logged_gather
    cfg = llama.LlamaConfig(vocab_size=64, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=128)
    full = llama.init(cfg, key(0))
    tokens = torch.randint(0, cfg.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    mesh = make_mesh(dp_shard=2)
    layout = Layout(mesh, default_rules(), remat=remat)
    params = place(full, llama.specs(cfg), layout.rules, mesh)
    rank = torch.distributed.get_rank()
    mine = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    leaves = torch.utils._pytree.tree_leaves(params)
    loss = llama.loss(params, mine, cfg, layout)
    events.clear()
    grads = torch.autograd.grad(loss, leaves)
    full_leaves = [t.detach().requires_grad_() for t in torch.utils._pytree.tree_leaves(full)]
    ref_params = torch.utils._pytree.tree_unflatten(full_leaves, torch.utils._pytree.tree_structure(full))
    ref = torch.autograd.grad(llama.loss(ref_params, batch, cfg), full_leaves)
    diff = max(float((g.full_tensor() - r).abs().max()) for g, r in zip(grads, ref))
    return events, diff


@pytest.mark.parametrize("remat", ["none", "full", "selective"])
def test_backward_reduce_scatter_is_async_one_deep_and_exact(remat, gloo):
    events, diff = gloo.run(_async_reduce_scatter_events, 2, remat)[0]
    if remat == "none":
        # blocks 3, 2, 1 (prefetched in forward) start theirs asynchronously; each runs under the previous
        # block's backward (its re-gather) and is waited on before the next starts. Block 0's and the top
        # bucket's (made without a prefetch) run synchronously
        overlapped = ["gather", "async"] + ["gather", "wait", "async"] * 2 + ["gather", "wait"]
        assert events == overlapped + ["sync", "wait", "sync", "wait"], events
    else:
        # each checkpointed block gathers again in its recompute ("forward": with grad), and starts its
        # reduce-scatter asynchronously once the one before it (block i + 1's, which ran under this block's
        # recompute and backward) finished: one in flight; block 0's is waited on by its await, the top
        # bucket's is synchronous
        overlapped = ["forward", "async"] + ["forward", "wait", "async"] * 3 + ["wait"]
        assert events == overlapped + ["sync", "wait"], events
    assert diff < 1e-6


# ----------------------------------------------------------------------------------------------- other models
# GPT-2 (biases, learned positions, tied head) and Qwen3 (q/k norms, GQA, untied head) through the trainer:
# one 4-process run per model walks DDP, FSDP, HSDP, FSDP x TP + SP and PP x FSDP, each against one process.

MODEL_BASE = {
    "training.steps": 3,
    "training.batch_size": 8,
    "training.seq_len": 32,
    "optimizer.lr": 1e-2,
    "optimizer.warmup_steps": 2,
    "optimizer.eps": 1e-6,
    "metrics.log_every": 1,
    "data.max_corpus_bytes": 400_000,
}
MODELS = {
    # 4 layers: zb_v puts the first and the last of its 4 stages on rank 0, as the tied head needs
    "gpt2": (
        {"model.name": "models.gpt2", "model.n_layers": 4, "model.dim": 32, "model.n_heads": 4, "model.ffn_dim": 64},
        {"parallelism.pipeline_schedule": "zb_v"},
    ),
    "qwen3": (
        {
            "model.name": "models.qwen3",
            "model.n_layers": 2,
            "model.dim": 32,
            "model.n_heads": 4,
            "model.n_kv_heads": 2,
            "model.head_dim": 16,
            "model.ffn_dim": 64,
        },
        {"parallelism.pipeline_schedule": "1f1b"},
    ),
}
MODEL_LAYOUTS = {
    "ddp4": {"parallelism.dp_replicate": 4, "parallelism.dp_shard": 1},
    "fsdp4": {"parallelism.dp_shard": 4},
    "hsdp2x2": {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 2},
    "fsdp2_tp2_sp": {"parallelism.dp_shard": 2, "parallelism.tp": 2, "parallelism.sequence_parallel": True},
    "cp2_tp2_sp": {"parallelism.cp": 2, "parallelism.tp": 2, "parallelism.dp_shard": 1},
    "pp2_cp2_ring": {
        "parallelism.pp": 2,
        "parallelism.cp": 2,
        "parallelism.dp_shard": 1,
        "parallelism.cp_attention": "ring",
        "training.microbatches": 2,
    },
    "pp2_fsdp2": {
        "parallelism.pp": 2,
        "parallelism.dp_shard": 2,
        "parallelism.reshard_after_forward": False,
        "training.microbatches": 4,
    },
}


def _train_model(overrides: dict) -> tuple[list, dict]:
    return train_small(overrides, base=MODEL_BASE)[:2]


def _train_model_layouts(model: dict, pp: dict, run_dir: str) -> dict:
    return {
        name: _train_model(
            {**model, **layout, **(pp if "pp" in name else {}), "metrics.run_dir": run_dir, "metrics.run_name": name}
        )
        for name, layout in MODEL_LAYOUTS.items()
    }


@pytest.mark.parametrize("model", list(MODELS))
def test_model_layouts_equal_one_process(model, tmp_path, gloo):
    overrides, pp = MODELS[model]
    ref_losses, ref_params = gloo.run(
        _train_model, 1, {**overrides, "metrics.run_dir": str(tmp_path), "metrics.run_name": "ref"}
    )[0]
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    results = gloo.run(_train_model_layouts, 4, overrides, pp, str(tmp_path), timeout=600)
    for name in MODEL_LAYOUTS:
        losses = results[0][name][0]
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), **LOSS_TOL, msg=lambda m: f"{model}/{name} losses: {m}"
        )
        # pipeline ranks hold their own stages' params; together they hold all
        params = {k: v for r in results for k, v in r[name][1].items()} if "pp" in name else results[0][name][1]
        assert params.keys() == ref_params.keys(), name
        for key, p in params.items():
            torch.testing.assert_close(p, ref_params[key], **PARAM_TOL, msg=lambda m, k=key: f"{model}/{name} {k}: {m}")
