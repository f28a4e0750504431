"""The trainer end to end: FSDP and DDP on 2 gloo processes equal one process, step for step."""

import json

import pytest
import torch
from support import SMALL, train_small

from functitan.config import apply_overrides
from functitan.job_config import JobConfig
from functitan.train import run


@pytest.fixture(scope="module")
def reference(tmp_path_factory, gloo):
    ref = tmp_path_factory.mktemp("ref")
    return gloo.run(train_small, 1, {"metrics.run_dir": str(ref / "ref"), "metrics.run_name": "ref"})[0]


# fp32, same global batch: the only difference is the order of floating-point sums in the collectives
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "layout", [{"parallelism.dp_shard": 2}, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1}]
)
def test_fsdp_and_ddp_equal_one_process(layout, reference, tmp_path, gloo):
    ref_losses, ref_params, ref_data = reference
    assert len(ref_losses) == 5 and ref_losses[-1] < ref_losses[0]
    results = gloo.run(train_small, 2, {**layout, "metrics.run_dir": str(tmp_path), "metrics.run_name": "dist"})
    losses, params, data_state = results[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert data_state == ref_data  # the iterator state is global: identical on every layout
    torch.testing.assert_close(results[1][1]["layers.1.mlp.w_down"], params["layers.1.mlp.w_down"], atol=0, rtol=0)


def test_microbatches_and_remat_equal_one_batch(reference, tmp_path, gloo):
    ref_losses, ref_params, _ = reference
    losses, params, _ = gloo.run(
        train_small,
        1,
        {
            "training.microbatches": 4,
            "training.remat": "full",
            "metrics.run_dir": str(tmp_path),
            "metrics.run_name": "acc",
        },
    )[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    # microbatch sums round differently; after 5 AdamW steps (m / sqrt(v) amplifies rounding on tiny
    # gradients) the params agree to 1e-4
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], atol=1e-4, rtol=1e-3)


def _bad_batch():
    cfg = apply_overrides(JobConfig(), {**SMALL, "training.batch_size": 3, "parallelism.dp_shard": 2})
    run(cfg)


def test_batch_not_dividing_the_data_parallel_ranks_is_an_error(gloo):
    with pytest.raises(RuntimeError, match=r"training.batch_size=3 must split evenly over 2 data-parallel ranks"):
        gloo.run(_bad_batch, 2, timeout=120)


def _train_bf16(layout: dict, run_dir: str):
    losses, params, _ = train_small(
        {**layout, "training.param_dtype": "bfloat16", "metrics.run_dir": run_dir, "metrics.run_name": "bf16"}
    )
    return losses, {n: p.dtype for n, p in params.items()}


def test_bf16_compute_keeps_fp32_master_weights_and_matches_fsdp(reference, tmp_path, gloo):
    one = gloo.run(_train_bf16, 1, {}, str(tmp_path / "one"))[0]
    two = gloo.run(_train_bf16, 2, {"parallelism.dp_shard": 2}, str(tmp_path / "two"))[0]
    assert set(one[1].values()) == {torch.float32} and set(two[1].values()) == {torch.float32}
    # bf16 compute tracks the fp32 run to bf16 precision, and FSDP in bf16 tracks one bf16 process closely
    torch.testing.assert_close(torch.tensor(one[0]), torch.tensor(reference[0]), atol=5e-2, rtol=0)
    torch.testing.assert_close(torch.tensor(two[0]), torch.tensor(one[0]), atol=2e-2, rtol=0)


def test_nproc_flag_launches_torchrun(tmp_path):
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "functitan.cli",
        "train",
        "--nproc",
        "2",
        "--parallelism.dp_shard=2",
        *[f"--{k}={v}" for k, v in SMALL.items()],
        "--training.steps=2",
        f"--metrics.run_dir={tmp_path}",
        "--metrics.run_name=np",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "functitan: 2 steps, first loss" in out.stdout
    with open(tmp_path / "np" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_compiled_blocks_train_like_eager(reference, tmp_path, gloo):
    # FSDP 2 with compiled blocks: the gathers, reshard hooks and prefetch sit around the compiled block
    compiled = gloo.run(
        train_small,
        2,
        {
            "training.compile": True,
            "training.steps": 2,
            "parallelism.dp_shard": 2,
            "metrics.run_dir": str(tmp_path),
            "metrics.run_name": "compiled",
        },
        timeout=600,
    )[0]
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(reference[0][:2]), atol=1e-5, rtol=1e-5)


def test_an_unnamed_run_is_named_after_the_model(tmp_path):
    # whatever spells it: a module path names the run after the model (gpt2-...), not the package (models-...)
    import subprocess
    import sys

    tiny = ["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.ffn_dim=64"]
    args = [*tiny, "--training.steps=1", "--training.seq_len=16", "--data.max_corpus_bytes=100000"]
    cmd = [sys.executable, "-m", "functitan.cli", "train", "--model.name=models.gpt2", *args]
    out = subprocess.run([*cmd, f"--metrics.run_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    assert run.name.startswith("gpt2-20") and len(run.name) == len("gpt2-20261201-061433"), run.name
    assert f"logs in {run}" in out.stdout
    assert f"functitan: records in {run}/ (tensorboard --logdir {run}/tb)" in out.stdout  # the banner, as typed


def test_a_live_config_without_its_stepper_is_refused_before_anything_starts():
    # run() is the trainer; `functitan train` hands it functitan.elastic.live.live_stepper for elastic.live
    live = ["--elastic.live=true", "--elastic.microbatch_size=2", "--elastic.lighthouse=http://127.0.0.1:1"]
    from functitan.config import parse_config

    with pytest.raises(ValueError, match=r"elastic.live=true: pass stepper=functitan.elastic.live.live_stepper"):
        run(parse_config(JobConfig, live))


class _FixedBatch:
    """A loader of one's own (``run(loader=...)``): the same batch every step, a state of its own."""

    vocab_size = 64

    def __init__(self, cfg, *, batch_size, seq_len, dp_rank, dp_size, device):
        rows = torch.randint(
            0, self.vocab_size, (batch_size * dp_size, seq_len + 1), generator=torch.Generator().manual_seed(0)
        )
        self.rows = rows[dp_rank * batch_size : (dp_rank + 1) * batch_size].to(device)
        self.batch_size, self.dp_size = batch_size, dp_size

    def init_state(self):
        return {"n": 0}

    def next(self, state):
        return {"inputs": self.rows[:, :-1], "targets": self.rows[:, 1:]}, {"n": state["n"] + 1}


def _with_hooks(run_dir: str) -> dict:
    """Three steps with every hook, and the same three steps by hand: SGD on the loss of the fixed batch."""
    import optree

    from functitan import optim
    from functitan.model import load_model
    from functitan.transforms import grad

    cfg = apply_overrides(
        JobConfig(),
        {
            **SMALL,
            "training.steps": 3,
            "optimizer.max_norm": 0.0,
            "eval.every": 2,
            "metrics.log_every": 10,
            "metrics.run_dir": run_dir,
            "metrics.run_name": "hooks",
        },
    )
    seen = []

    def callback(step, state, metrics):
        seen.append((step, state.step, state.data_state["n"], metrics["loss"]))
        return {"cb/first": 1.0} if step == 1 else None

    def evaluate(params):  # an evaluation of one's own: the squared norm of the params
        return {"eval/norm": float(sum(p.square().sum() for p in _full(params).values()))}

    start = run(cfg, loader=_FixedBatch, evaluate=evaluate, dry_run=True)["state"].params  # the initial params
    out = run(cfg, loader=_FixedBatch, optimizer=optim.sgd(0.5), evaluate=evaluate, callbacks=[callback])
    model = load_model("llama")
    mcfg = model.config("debug", vocab_size=64, **{k[6:]: v for k, v in SMALL.items() if k.startswith("model.")})
    loader = _FixedBatch(cfg, batch_size=8, seq_len=32, dp_rank=0, dp_size=1, device="cpu")
    batch, _ = loader.next(loader.init_state())
    params = optree.tree_map(lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach(), start)
    losses = []
    for _ in range(3):
        losses.append(float(model.loss(params, batch, mcfg)))
        grads = grad(lambda q: model.loss(q, batch, mcfg))(params)
        params = optree.tree_map(lambda p, g: p - 0.5 * g, params, grads)
    records = [json.loads(line) for line in open(f"{out['run_dir']}/metrics.jsonl")]
    return {
        "seen": seen,
        "records": records,
        "data": out["state"].data_state,
        "got": _full(out["state"].params),
        "want": _full(params),
        "losses": losses,
    }


def _full(params):
    from functitan.tree import flatten_with_names

    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in flatten_with_names(params)[0]}


def test_run_takes_a_loader_an_optimizer_an_eval_and_callbacks_of_ones_own(gloo, tmp_path):
    """``run(loader=, optimizer=, evaluate=, callbacks=)``: a fixed-batch loader with its own state, SGD at 0.5
    (three steps equal to the same SGD by hand on the same batch), an evaluate hook every 2 steps that needs no
    eval data, and a callback that sees every step's state and adds a metric; what the hooks return is written at
    their steps, and no lr (the config's schedule is not the optimizer's) is logged."""
    res = gloo.run(_with_hooks, 1, str(tmp_path))[0]
    for name, p in res["got"].items():
        torch.testing.assert_close(p, res["want"][name], atol=1e-5, rtol=1e-5)
    assert [(s, t, n) for s, t, n, _ in res["seen"]] == [(1, 1, 1), (2, 2, 2), (3, 3, 3)] and res["data"] == {"n": 3}
    assert [r["loss"] for r in res["records"]] == pytest.approx(res["losses"], abs=1e-5)
    assert [loss for *_, loss in res["seen"]] == pytest.approx(res["losses"], abs=1e-5)
    steps = {r["step"]: r for r in res["records"]}
    assert sorted(steps) == [1, 2, 3] and steps[1]["cb/first"] == 1.0 and "eval/norm" not in steps[1]
    assert steps[2]["eval/norm"] > 0 and steps[3]["eval/norm"] != steps[2]["eval/norm"]
    assert not any("lr" in r or "data_epoch" in r for r in res["records"])
