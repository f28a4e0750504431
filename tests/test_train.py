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
