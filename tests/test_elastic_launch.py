"""The launcher as a scheduler and a user meet it: SIGTERM/SIGINT to ``functitan train --nproc 2`` and a rank's error."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from elastic_harness import alive, descendants

from functitan.elastic import BatchSplitError, LaunchError, parse_launch_args, split_batch, world_sizes_for
from functitan.testing import TINY_RUN_ARGS

SMALL = [
    *TINY_RUN_ARGS,
    "--training.batch_size=8",
    "--training.seq_len=32",
]


def kill_all(pids) -> None:
    for p in alive(pids):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for_step(path, step: int, proc, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                records = [json.loads(line) for line in f if line.strip()]
            if records and records[-1]["step"] >= step:
                return records[-1]
        assert proc.poll() is None, f"the run ended early (rc {proc.returncode})"
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not reach step {step} in {timeout}s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_nproc_cli_saves_a_checkpoint_and_leaves_no_process_or_file(sig, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "functitan.cli",
        "train",
        "--nproc",
        "2",
        "--parallelism.dp_shard=2",
        *SMALL,
        "--training.steps=100000",
        "--checkpoint.enable=true",
        "--checkpoint.interval=100000",
        f"--metrics.run_dir={tmp_path}",
        "--metrics.run_name=pre",
    ]
    scratch = tmp_path / "tmp"  # the temporary directory of the launcher, torchrun and the workers
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    tree: set[int] = set()
    try:
        wait_for_step(tmp_path / "pre" / "metrics.jsonl", 2, proc, timeout=120)
        tree = descendants(proc.pid)
        assert len(tree) >= 3, tree  # torchrun and its two workers
        proc.send_signal(sig)  # what a scheduler (SIGTERM) or a terminal (SIGINT) does
        out, err = proc.communicate(timeout=60)
    finally:
        kill_all(tree | {proc.pid})
    assert proc.returncode == 0, err[-3000:]
    assert not alive(tree), f"processes left behind: {alive(tree)}"
    # torchrun stopped by a signal leaves its torchelastic_* log directory: the launcher gives it one of its own
    assert not [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")], "files left behind"
    steps = sorted(int(d) for d in os.listdir(tmp_path / "pre" / "checkpoints") if d.isdigit())
    assert len(steps) == 1 and steps[0] >= 2  # the preemption save, at the step boundary after the signal
    assert os.path.exists(tmp_path / "pre" / "checkpoints" / str(steps[0]) / "default" / "_COMMIT")
    with open(tmp_path / "pre" / "metrics.jsonl") as f:
        assert json.loads(f.readlines()[-1])["step"] == steps[0]
    word = "interrupted (SIGINT)" if sig == signal.SIGINT else "stopped by SIGTERM"
    assert f"functitan: {word} after step {steps[0]}; checkpoint saved in" in out
    assert out.rstrip().endswith("; run the same command to resume")  # the run is named: it finds its checkpoints
    assert "Traceback" not in err and "SignalException" not in err


def test_a_stopped_run_says_how_to_resume_it_and_that_command_resumes(tmp_path):
    # an unnamed run is named by the clock, so "the same command" would start another run: the line names the
    # flag that finds this one; a run without checkpoints has nothing to resume from
    saved = ["--checkpoint.enable=true", "--checkpoint.interval=100000", f"--metrics.run_dir={tmp_path / 'saved'}"]
    runs = {"saved": saved, "unsaved": [f"--metrics.run_dir={tmp_path / 'unsaved'}"]}

    def train(*args: str) -> list[str]:
        return [sys.executable, "-m", "functitan.cli", "train", *SMALL, *args]

    procs = {
        k: subprocess.Popen(
            train("--training.steps=100000", *a), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for k, a in runs.items()
    }
    last = {}
    try:
        for k, proc in procs.items():
            deadline = time.monotonic() + 120
            while not list((tmp_path / k).glob("*/metrics.jsonl")):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                time.sleep(0.2)
            wait_for_step(next((tmp_path / k).glob("*/metrics.jsonl")), 1, proc, timeout=120)
            proc.send_signal(signal.SIGTERM)
        for k, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err[-3000:]
            last[k] = out.strip().splitlines()[-1]
    finally:
        kill_all({p.pid for p in procs.values()})
    (run_dir,) = (tmp_path / "saved").iterdir()
    (step,) = [int(d.name) for d in (run_dir / "checkpoints").iterdir()]
    assert last["saved"] == (
        f"functitan: stopped by SIGTERM after step {step}; checkpoint saved in {run_dir / 'checkpoints' / str(step)}; "
        f"run the same command with --metrics.run_name={run_dir.name} to resume"
    )
    assert last["unsaved"].endswith(
        "; no checkpoint (checkpoint.enable=false); nothing to resume from (add --checkpoint.enable=true to save one)"
    )
    again = train(f"--training.steps={step + 1}", *saved, f"--metrics.run_name={run_dir.name}")
    out = subprocess.run(again, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"functitan: {step + 1} steps (resumed at step {step})" in out.stdout


def _train_error(overrides: dict) -> str:
    """On each pool rank: the trainer on support.SMALL + ``overrides``; the user error it raises, as text."""
    from support import SMALL as SMALL_CONFIG

    from functitan.config import apply_overrides
    from functitan.errors import UserError
    from functitan.job_config import JobConfig
    from functitan.train import run

    try:
        run(apply_overrides(JobConfig(), {**SMALL_CONFIG, **overrides}))
    except (UserError, BatchSplitError) as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


def test_a_batch_that_cannot_split_is_refused_on_every_rank_before_training(gloo, tmp_path):
    # 7 sequences over 2 ranks cannot stay constant: every rank refuses by name before step 1 (the launcher shows
    # a rank's refusal as its one line: test_an_error_under_nproc_is_exactly_one_line)
    got = gloo.run(_train_error, 2, {"training.batch_size": 7, "metrics.run_dir": str(tmp_path)})
    assert (
        got
        == [
            "BatchSplitError: training.batch_size=7 must split evenly over 2 data-parallel ranks x "
            "training.microbatches=1 (world size 2); world sizes that keep it: 1, 7; or use a batch_size "
            "that is a multiple of 2"
        ]
        * 2
    )
    assert not list(tmp_path.iterdir())  # refused before the run folder was made


def test_an_error_under_nproc_is_exactly_one_line(tmp_path):
    # nothing of torchrun's around it: neither its OMP_NUM_THREADS banner nor "Sending process N closing signal"
    cmd = [sys.executable, "-m", "functitan.cli", "train", "--nproc", "2", "--parallelism.dp_shard=3", *SMALL]
    out = subprocess.run([*cmd, f"--metrics.run_dir={tmp_path}"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        "functitan: error: parallelism: pp=1 x dp_replicate=1 x dp_shard=3 x cp=1 x tp=1 = 3 ranks, but the world size is "
        "2; make the product 2 (for example set dp_shard=-1 to take the remaining ranks)"
    ]


def test_bad_launcher_flags_are_named():
    with pytest.raises(LaunchError, match=r"--nproc='abc': the number of processes is an integer >= 1, e.g. --nproc 2"):
        parse_launch_args(["--nproc", "abc"])
    with pytest.raises(LaunchError, match=r"--nnodes=3:2: expected N or MIN:MAX"):
        parse_launch_args(["--nnodes=3:2", "--rdzv-endpoint=h:1", "--rdzv-id=x"])
    with pytest.raises(LaunchError, match=r"needs --rdzv-endpoint=HOST:PORT.*functitan rendezvous"):
        parse_launch_args(["--nnodes=1:3"])
    spec, rest = parse_launch_args(
        ["--nproc=2", "--training.steps=3", "--nnodes", "2:3", "--rdzv-endpoint=h:1", "--rdzv-id=job"]
    )
    assert (spec.nproc, spec.nnodes, spec.elastic, rest) == (2, "2:3", True, ["--training.steps=3"])


def test_global_batch_split_follows_the_world_size():
    assert split_batch(12, 3, microbatch_size=2) == (4, 2)
    assert split_batch(12, 2, microbatch_size=2) == (6, 3)
    assert split_batch(12, 2, microbatches=2) == (6, 2)
    assert world_sizes_for(12, microbatch_size=2, fixed=2) == [2, 4, 6, 12]
    with pytest.raises(BatchSplitError, match=r"world sizes that keep it: 2, 4, 6, 12;"):
        split_batch(12, 4, microbatch_size=2, fixed=2)
    with pytest.raises(
        BatchSplitError, match=r"\(world size 1\); no world size keeps it with training.microbatches=4; use"
    ):
        split_batch(2, 1, microbatches=4)  # fewer sequences than microbatches: no world size can help


_SECOND_SIGNAL = """
import os, signal, sys, time
from functitan.elastic import Preemption
with Preemption() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same stop delivered twice (scheduler + torchrun): one request
    time.sleep(0.2)
    print("requested", stop.signum, stop.agreed(), flush=True)
    time.sleep(1.2)
    os.kill(os.getpid(), signal.SIGTERM)  # a second stop, later: exit at once, by the signal's default action
    time.sleep(10)
    print("not reached", flush=True)
"""


def test_first_signal_requests_a_stop_and_a_second_one_exits_at_once():
    out = subprocess.run([sys.executable, "-c", _SECOND_SIGNAL], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[0] == f"requested {int(signal.SIGTERM)} {int(signal.SIGTERM)}", out.stderr
    assert "not reached" not in out.stdout
    assert out.returncode == -signal.SIGTERM
