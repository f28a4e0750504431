"""User errors through the CLI as typed: one line ``functitan: error: ...`` naming the key or path, exit code 2,
no traceback (``--debug`` shows it); on each failing rank the line also lands in ``$FUNCTITAN_ERROR_DIR``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import cli

from functitan.errors import user_errors_exit
from functitan.testing import TINY_RUN_ARGS

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    *TINY_RUN_ARGS,
    "--training.batch_size=8",
    "--training.seq_len=32",
]


def _env(extra: dict | None = None) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **(extra or {})}


def _cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "functitan.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(env),
        timeout=timeout,
    )


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("functitan: error: "), out.stderr
    return lines[0]


BAD_VALUES = {  # the command line as typed -> the one line it must print
    ("--metrics.log_every=0",): "functitan: error: metrics.log_every=0: must be >= 1",
    ("--training.microbatches=0",): "functitan: error: training.microbatches=0: must be >= 1",
    ("--training.steps=0",): "functitan: error: training.steps=0: must be >= 1",  # and no word of warmup_steps
    (
        "--training.device=tpu",
    ): "functitan: error: training.device='tpu' is not allowed; choose one of ['auto', 'cpu', 'cuda']",
    ("--nproc", "abc"): "functitan: error: --nproc='abc': the number of processes is an integer >= 1, e.g. --nproc 2",
    (
        "--nproc",
        "2",
        "--optimizer.lr=-1",
    ): "functitan: error: optimizer.lr=-1.0: a learning rate is a finite number > 0, e.g. 3e-4",
    ("--checkpoint.keep_last=0",): "functitan: error: checkpoint.keep_last=0: must be >= 1",
    ("--training.batch_size=0",): "functitan: error: training.batch_size=0: must be >= 1",
    (
        "--data.path=no/such/shards",
    ): "functitan: error: data.path=no/such/shards: no such directory; make the shards with `functitan data "
    "prepare SRC ... --out no/such/shards`, or use data.paths for text / JSONL / parquet files",
    ("--parallelism.tp=0",): "functitan: error: parallelism.tp=0: must be >= 1",
    (
        "--optimizer.schedule=wsd",
        "--training.steps=10",
    ): "functitan: error: optimizer.schedule='wsd' does not fit training.steps=10 with optimizer.warmup_steps=20 "
    "(capped at training.steps=10): wsd: the decay (1 steps, decay_fraction=0.1 of 10) would start at step 9, "
    "inside the 10-step warmup; lower decay_fraction or warmup_steps; lower optimizer.warmup_steps or raise "
    "training.steps",
}


def test_each_bad_value_is_one_named_line_and_exit_code_2():
    for args, message in BAD_VALUES.items():
        assert _one_line_error(cli("train", *args)) == message, args


def test_a_pipeline_error_names_the_config_keys_and_values_to_type(tmp_path):
    # the fix of a layout the pipeline refuses is typed on the command line: keys and schedule names as train takes
    pp = [
        "--nproc",
        "2",
        "--parallelism.pp=2",
        "--parallelism.dp_shard=1",
        "--training.microbatches=2",
        "--model.n_layers=4",
    ]
    args = [*pp, "--parallelism.pipeline_schedule=zb_v", "--training.remat=selective", f"--metrics.run_dir={tmp_path}"]
    assert _one_line_error(_cli("train", *SMALL, *args)) == (
        "functitan: error: schedule 'zb_v' splits the backward into B and W, two backward passes through each stage, "
        "but the stages use selective activation checkpointing (remat='selective'), which allows one; build the "
        "Layout with remat 'none' or 'full' (training.remat), or use a schedule without B/W "
        "(parallelism.pipeline_schedule gpipe, 1f1b or interleaved_1f1b)"
    )


def test_debug_shows_the_traceback():
    out = _cli("train", "--metrics.log_every=0", "--debug")
    assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError: metrics.log_every=0" in out.stderr


def test_a_diverging_run_names_the_non_finite_value(tmp_path):
    out = _cli(
        "train",
        *SMALL,
        "--training.steps=3",
        "--optimizer.lr=1e30",
        "--optimizer.warmup_steps=0",
        "--optimizer.max_norm=0",
        f"--metrics.run_dir={tmp_path}",
        "--metrics.run_name=nan",
    )
    assert _one_line_error(out).startswith("functitan: error: non-finite loss nan and grad norm nan at step 2; ")


def test_the_error_line_is_left_for_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("FUNCTITAN_ERROR_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    out = cli("train", "--training.steps=0")
    line = _one_line_error(out)
    assert (tmp_path / "rank3.txt").read_text() == line.removeprefix("functitan: error: ") + "\n"


def _train_main(argv: list[str], error_dir: str) -> int:
    os.environ["FUNCTITAN_ERROR_DIR"] = error_dir
    from functitan.train import main

    return main(argv)


def test_each_failing_rank_reports_its_line(tmp_path, gloo):
    # an error found by the ranks once running (a checkpoint that is not there), on 2 processes as torchrun runs them
    argv = [
        *SMALL,
        "--parallelism.dp_shard=2",
        "--training.steps=2",
        f"--metrics.run_dir={tmp_path}",
        f"--checkpoint.load_path={tmp_path}/missing",
    ]
    codes = gloo.run(_train_main, 2, argv, str(tmp_path))
    assert codes == [2, 2]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == (
            f"checkpoint {tmp_path}/missing does not exist; pass a step directory such as "
            "runs/<run>/checkpoints/<step>, or import hf's output\n"
        )


def test_a_bug_keeps_its_traceback_and_a_user_error_does_not(capsys):
    with pytest.raises(ZeroDivisionError):
        user_errors_exit(lambda: 1 // 0)
    assert user_errors_exit(lambda: int("x")) == 2
    assert capsys.readouterr().err == "functitan: error: invalid literal for int() with base 10: 'x'\n"


# ------------------------------------------------------------------------------------------- export / import hf


def test_export_hf_names_a_missing_checkpoint_and_a_bad_output(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "2" / "default").mkdir(parents=True)
    (ckpts / "2" / "default" / "_METADATA").write_text("{}")
    (tmp_path / "a_file").write_text("")
    cases = {
        (
            str(ckpts / "7"),
            str(tmp_path / "hf"),
        ): f"functitan: error: checkpoint {ckpts}/7 does not exist (steps in {ckpts}: 2); pass a step directory",
        (
            str(tmp_path / "run"),
            str(tmp_path / "hf"),
        ): f"functitan: error: {tmp_path}/run is not a functitan checkpoint (no _METADATA in it or in {tmp_path}/run/"
        f"default) (steps in {ckpts}: 2); pass a step directory",
        (
            str(ckpts / "2"),
            str(tmp_path / "a_file"),
        ): f"functitan: error: output {tmp_path}/a_file exists and is not a directory",
        (
            str(ckpts / "2"),
            str(tmp_path / "a_file" / "hf"),
        ): f"functitan: error: output {tmp_path}/a_file/hf: {tmp_path}/a_file is not a directory",
    }
    for (ckpt, out), message in cases.items():
        assert _one_line_error(cli("export", "hf", ckpt, out)).startswith(message), message


def test_a_load_path_that_is_a_run_directory_names_its_steps(tmp_path):
    # the run directory is the usual mistake: train names the steps under it, as export hf does
    ckpts = tmp_path / "run" / "checkpoints"
    for step in ("2", "4"):
        (ckpts / step / "default").mkdir(parents=True)
    (tmp_path / "run" / "model_config.json").write_text('{"name": "llama", "config": {}}')
    cases = {
        str(tmp_path / "run"): f"functitan: error: {tmp_path}/run is not a functitan checkpoint (no _METADATA in it "
        f"or in {tmp_path}/run/default) (steps in {ckpts}: 2, 4); pass a step directory such as "
        "runs/<run>/checkpoints/<step> (or a torch DCP one with its .metadata: torchtitan's step-<N>)",
        str(
            ckpts / "9"
        ): f"functitan: error: checkpoint {ckpts}/9 does not exist (steps in {ckpts}: 2, 4); pass a step "
        "directory such as runs/<run>/checkpoints/<step>, or import hf's output",
    }
    for path, message in cases.items():
        out = cli("train", *SMALL, f"--checkpoint.load_path={path}", f"--metrics.run_dir={tmp_path}")
        assert _one_line_error(out) == message


def _sys_is_writable() -> bool:
    try:
        os.rmdir(tempfile.mkdtemp(dir="/sys"))
        return True
    except OSError:
        return False


@pytest.mark.skipif(_sys_is_writable(), reason="needs an unwritable directory (/sys)")
def test_export_and_import_hf_name_an_unwritable_output(tmp_path):
    (tmp_path / "ck" / "default").mkdir(parents=True)
    (tmp_path / "ck" / "default" / "_METADATA").write_text("{}")
    line = _one_line_error(cli("export", "hf", str(tmp_path / "ck"), "/sys/functitan-test/hf"))
    assert line.startswith("functitan: error: output /sys/functitan-test/hf: cannot write in /sys (")
    missing = _one_line_error(cli("import", "hf", str(tmp_path / "nope"), str(tmp_path / "out")))
    assert missing.startswith(f"functitan: error: Hugging Face directory {tmp_path}/nope does not exist")
