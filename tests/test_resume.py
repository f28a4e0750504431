"""Exact resume: a run saved at step 10 and resumed reproduces the uninterrupted run's losses bit for bit."""

import contextlib
import json
import math

import pytest
import torch
from support import LAYOUTS, Crash, crashing_at_step, train_small

CKPT = {"checkpoint.enable": True, "checkpoint.interval": 10, "checkpoint.keep_last": 2}


def _losses(run_dir: str) -> dict[int, float]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _interrupted_and_resumed(layout: dict, root: str):
    straight = train_small(
        {**layout, **CKPT, "training.steps": 14, "metrics.run_dir": root, "metrics.run_name": "straight"}
    )
    with crashing_at_step(10), contextlib.suppress(Crash):
        train_small({**layout, **CKPT, "training.steps": 14, "metrics.run_dir": root, "metrics.run_name": "resumed"})
    resumed = train_small(
        {**layout, **CKPT, "training.steps": 14, "metrics.run_dir": root, "metrics.run_name": "resumed"}
    )
    return straight[1], resumed[1], resumed[2]


@pytest.mark.parametrize("world,layout", [(1, {}), (2, {"parallelism.dp_shard": 2})])
def test_resume_after_step_10_is_bit_exact(world, layout, tmp_path, gloo):
    straight_params, resumed_params, data_state = gloo.run(_interrupted_and_resumed, world, layout, str(tmp_path))[0]
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert [s for s in resumed if s > 10] == [11, 12, 13, 14]  # the second run started at step 11
    for step in (11, 12, 13, 14):
        assert resumed[step] == straight[step], step  # bit for bit
    for name, p in straight_params.items():
        assert torch.equal(resumed_params[name], p), name
    assert data_state["seq"] == 14 * 8


CP_RESUME = {**CKPT, "checkpoint.interval": 3, "training.steps": 6}


def _cp_then_another_layout(root: str):
    """cp 2 x fsdp 2 straight for 6 steps; the same run cut after step 3 and resumed as fsdp 4 (and its last
    checkpoint restored on one process, below)."""
    cp = {**LAYOUTS["cp2_fsdp2"], **CP_RESUME, "metrics.run_dir": root}
    straight = train_small({**cp, "metrics.run_name": "straight"})
    with crashing_at_step(3), contextlib.suppress(Crash):
        train_small({**cp, "metrics.run_name": "moved"})
    moved = train_small({**LAYOUTS["fsdp4"], **CP_RESUME, "metrics.run_dir": root, "metrics.run_name": "moved"})
    return straight[1], moved[1]


def test_a_cp_checkpoint_resumes_under_fsdp_and_on_one_process_with_the_same_files(tmp_path, gloo):
    """cp does not change what is on disk: a cp 2 x fsdp 2 run's step 3 resumes as fsdp 4 (steps 4-6 within fp32
    rounding of the uninterrupted cp run; the layouts sum in other orders), writes the same files at step 6, and
    that checkpoint resumes on one process."""
    straight_params, moved_params = gloo.run(_cp_then_another_layout, 4, str(tmp_path))[0]
    straight, moved = _losses(tmp_path / "straight"), _losses(tmp_path / "moved")
    assert [s for s in moved if s > 3] == [4, 5, 6]  # the fsdp 4 run started after the cp run's step 3
    for step in (4, 5, 6):
        assert moved[step] == pytest.approx(straight[step], rel=1e-5), step
    for name, p in straight_params.items():
        torch.testing.assert_close(moved_params[name], p, atol=1e-5, rtol=1e-4)

    def files(run: str) -> dict[str, bytes]:  # every file of step 6; the array metadata (zarr.json) by content
        d = tmp_path / run / "checkpoints" / "6"
        return {str(f.relative_to(d)): f.read_bytes() if f.name == "zarr.json" else b"" for f in d.rglob("*")}

    assert files("straight") == files("moved") and len(files("moved")) > 300
    # the cp run's step 6 on one process: training.steps=6 restores it and trains no step
    one = train_small({**CP_RESUME, "metrics.run_dir": str(tmp_path), "metrics.run_name": "straight"})
    for name, p in straight_params.items():
        assert torch.equal(one[1][name], p), name


# ------------------------------------------------------------------------------------------- crash leftovers, damage


def _train_and_capture(overrides: dict, crash_at: int | None = None, stepper=None):
    """The trainer's run (crashing after step ``crash_at``), returning its summary numbers, warnings and output."""
    import io
    import warnings

    from support import SMALL

    from functitan.config import apply_overrides
    from functitan.job_config import JobConfig
    from functitan.train import run

    printed = io.StringIO()  # not capfd: a forkserver started by an earlier test writes to that test's stdout
    with (
        crashing_at_step(crash_at),
        warnings.catch_warnings(record=True) as caught,
        contextlib.redirect_stdout(printed),
    ):
        warnings.simplefilter("always")
        try:
            out = run(apply_overrides(JobConfig(), {**SMALL, **overrides}), stepper=stepper)
        except Crash:
            return None
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out["first_loss"], out["steps"], warned, printed.getvalue()


def _files(step_dir) -> dict[str, bytes]:
    return {str(p.relative_to(step_dir)): p.read_bytes() for p in sorted(step_dir.rglob("*")) if p.is_file()}


def test_a_restarted_trainer_removes_leftovers_and_resaves_a_damaged_newest_step(tmp_path, gloo):
    import shutil

    run = {
        **CKPT,
        "checkpoint.interval": 2,
        "training.steps": 6,
        "metrics.run_dir": str(tmp_path),
        "metrics.run_name": "r",
    }
    assert gloo.run(_train_and_capture, 1, run, 4) == [None]  # crashed after step 4 was saved
    ckpts = tmp_path / "r" / "checkpoints"
    assert sorted(e.name for e in ckpts.iterdir()) == ["2", "4"]
    good4 = _files(ckpts / "4")
    # a crash's leftovers: a save cut short before its rename, a retention delete cut short
    shutil.copytree(ckpts / "2", ckpts / "6.tmp-0a1b2c3d4e5f")
    shutil.copytree(ckpts / "2", ckpts / "0.tmp-deleting-89abcdef")
    # and a damaged newest step: one array file truncated
    victim = next(p for p in (ckpts / "4" / "default").rglob("c/*") if p.is_file() and "params" in str(p))
    victim.write_bytes(victim.read_bytes()[:-7])

    first, steps, warned, printed = gloo.run(_train_and_capture, 1, run)[0]
    assert steps == 6 and math.isfinite(first)  # the first loss this run computed (step 3), not nan
    assert len(warned) == 1 and "checkpoint step 4" in warned[0] and "restored step 2 instead" in warned[0]
    assert "functitan: 6 steps (resumed at step 2), loss at step 3 " in printed and "nan" not in printed
    # leftovers gone; step 4 saved again in place of the damaged one; keep_last=2 counts intact steps only
    assert sorted(e.name for e in ckpts.iterdir()) == ["4", "6"]
    assert _files(ckpts / "4") == good4  # the resumed run is bit-exact, so its step 4 is the original's, byte for byte


def test_resuming_with_another_model_is_one_line_and_keeps_the_runs_record(tmp_path):
    # a resume refused (another model, another shape) must not rewrite the run's record of its model: export hf and
    # --checkpoint.load_path rebuild the model from it
    import subprocess
    import sys

    tiny = ["--model.n_layers=2", "--model.dim=64", "--model.n_heads=8", "--model.ffn_dim=128"]  # llama's and gpt2's
    run = [*tiny, "--data.max_corpus_bytes=400000", "--training.seq_len=32", "--checkpoint.enable=true"]
    run += [f"--metrics.run_dir={tmp_path}", "--metrics.run_name=r"]
    procs: list[subprocess.Popen] = []

    def train(*args: str, steps: int = 2) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "functitan.cli", "train", *run, f"--training.steps={steps}", *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs[-1]

    record = tmp_path / "r" / "model_config.json"
    wrong = {
        ("--model.name=gpt2",): f"model.name='gpt2' differs from the checkpoints of {tmp_path / 'r'} ({record}), "
        "which hold model 'llama'",
        ("--model.dim=32", "--model.n_layers=3"): "model.dim=32, model.n_layers=3 differ from the checkpoints of "
        f"{tmp_path / 'r'} ({record}), which hold dim=64, n_layers=2",
    }
    fix = "; drop the flags that differ, or start another run with a new metrics.run_name"
    try:
        first = train()
        _, err = first.communicate(timeout=180)
        assert first.returncode == 0, err[-3000:]
        records = {p.name: p.read_bytes() for p in (tmp_path / "r").glob("*.json")}
        assert set(records) == {"config.json", "model_config.json"}
        refused = [train(*args, steps=3) for args in wrong]  # at once: each mostly waits for torch's import
        for (args, message), proc in zip(wrong.items(), refused):
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 2, err[-3000:]
            assert err.splitlines() == [f"functitan: error: {message}{fix}"], args
        assert {p.name: p.read_bytes() for p in (tmp_path / "r").glob("*.json")} == records
        again = train(steps=3)
        out, err = again.communicate(timeout=180)
        assert again.returncode == 0, err[-3000:]
        assert "functitan: 3 steps (resumed at step 2)" in out
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()


def _joined(overrides: dict):
    """The trainer's run as a live joiner: the first step's state is healed from a peer at step 3."""
    from functitan.train import local_stepper

    @contextlib.contextmanager
    def healing(*args, **kwargs):
        with local_stepper(*args, **kwargs) as advance:

            def healed(state, *a, **k):
                return advance(state._replace(step=max(state.step, 3)), *a, **k)

            yield healed

    return _train_and_capture(overrides, stepper=healing)


def test_a_joiners_summary_starts_at_the_step_it_healed_to(tmp_path, gloo):
    run = {"training.steps": 5, "metrics.run_dir": str(tmp_path), "metrics.run_name": "j"}
    first, steps, _, printed = gloo.run(_joined, 1, run)[0]
    assert steps == 5 and math.isfinite(first)
    assert "functitan: 5 steps (resumed at step 3), loss at step 4 " in printed and "nan" not in printed, printed
