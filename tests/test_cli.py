"""The first five minutes: `functitan --help` lists every subcommand; each subcommand's --help has an example."""

from __future__ import annotations

import math

import pytest
from support import TINY_FLAGS

from functitan.cli import COMMANDS, main

# how each command's help is reached as typed (export/import take the format word first)
HELP = {
    "train": ["train", "--help"],
    "report": ["report", "--help"],
    "gradcheck": ["gradcheck", "--help"],
    "pipeline": ["pipeline", "show", "--help"],
    "export": ["export", "hf", "--help"],
    "import": ["import", "hf", "--help"],
    "rendezvous": ["rendezvous", "--help"],
    "data": ["data", "prepare", "--help"],
    "plan": ["plan", "--help"],
    "generate": ["generate", "--help"],
}


def test_top_level_help_lists_every_command_on_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.split("commands:\n")[1].split("\n\n")[0].splitlines()]
    assert listed == list(COMMANDS)
    assert set(HELP) == set(COMMANDS), "a new command needs its help invocation here"


def test_no_arguments_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "commands:" in capsys.readouterr().out


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"functitan {version('functitan')}\n"


def test_unknown_command_is_one_error_with_the_list(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


@pytest.mark.parametrize("command", list(HELP))
def test_every_command_help_has_an_example(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main(HELP[command])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out
    assert out.count("usage:") == 1 and out.startswith(f"usage: functitan {command}"), out[:200]
    example = out.split("example", 1)[1]
    assert f"functitan {command}" in example


_LAUNCH_PATH = """
import sys
from functitan.cli import COMMANDS, _load
from functitan.config import parse_config
from functitan.job_config import JobConfig
_load(COMMANDS["train"][1])
cfg = parse_config(JobConfig, ["--config", sys.argv[1], "--parallelism.dp_shard=2", "--optimizer.schedule=wsd"])
from functitan._train_cli import main
assert main(["--config", sys.argv[1], "--print-config"]) == 0  # the config as TOML, torch not imported either
print(cfg.parallelism.dp_shard, sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""
_TRAINER = """
import sys
import functitan.train
print(sorted(m for m in sys.modules if m.startswith("functitan.elastic")))
"""


def test_the_train_launcher_checks_a_config_without_torch_and_the_trainer_imports_no_elastic():
    # `functitan train --nproc N` parses and checks the config (its schedule included), then starts torchrun:
    # torch's import (about 3 s) stays off that path, paid once by each worker. The trainer (functitan.train)
    # imports nothing of functitan.elastic: the command line launches and hands it its stepper
    import subprocess
    import sys
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs" / "debug.toml"
    out = subprocess.run([sys.executable, "-c", _LAUNCH_PATH, str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "2 []" and "[model]" in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-c", _TRAINER], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "[]\n"), out.stderr[-2000:]


# one bad value per command, as typed: the line every command prints is `functitan: error: <what and the fix>`
BAD_VALUE = {
    "train": (["train", "--training.steps=0"], "training.steps=0: must be >= 1"),
    "rendezvous": (["rendezvous", "--port", "70000"], "--port=70000: a TCP port is 0..65535"),
    "report": (["report", "/nonexistent/run"], "/nonexistent/run"),
    "gradcheck": (["gradcheck", "--steps", "0"], "--steps=0: must be >= 1"),
    "pipeline": (["pipeline", "show", "--schedule", "1f1b", "--pp", "0"], "pp"),
    "plan": (["plan", "--device", "cpu", "--seq-len", "0"], "--seq-len=0: must be >= 1"),
    "export": (["export", "hf", "/nonexistent/ck", "/nonexistent/out"], "/nonexistent/ck"),
    "import": (["import", "hf", "/nonexistent/hf", "/nonexistent/out"], "/nonexistent/hf"),
    "data": (["data", "prepare", "/nonexistent/c.txt", "--out", "/nonexistent/s"], "/nonexistent/c.txt"),
    "generate": (["generate", "--checkpoint", "/nonexistent/ck", "--prompt", "x"], "/nonexistent/ck"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_says_a_bad_value_in_one_line_and_shows_its_traceback_with_debug(command, capsys):
    assert set(BAD_VALUE) == set(COMMANDS), "a new command needs its bad value here"
    argv, message = BAD_VALUE[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("functitan: error: ") and err.count("\n") == 1 and message in err, err
    with pytest.raises((ValueError, OSError), match="."):  # --debug: the error itself, with its traceback
        main([*argv, "--debug"])


# a flag prefix each command would once have taken for a longer flag (argparse's allow_abbrev): now refused
ABBREVIATION = {  # the command as typed, and the prefix its one line names
    "train": (["train", "--training.step", "1"], "--training.step"),  # config keys: the nearest key is named
    "rendezvous": (["rendezvous", "--po", "70000"], "--po"),
    "report": (["report", "/nonexistent/run", "--smooth", "0.5"], "--smooth"),
    "gradcheck": (["gradcheck", "--lay", "nosuch"], "--lay"),
    "pipeline": (["pipeline", "show", "--schedule", "1f1b", "--micro", "4"], "--micro"),
    "plan": (["plan", "--gpus", "0"], "--gpus"),
    "data": (["data", "prepare", "/nonexistent/c.txt", "--out", "/nonexistent/s", "--work", "2"], "--work"),
    "export": (["export", "hf", "/nonexistent/ck", "/nonexistent/out", "--max-shard", "5"], "--max-shard"),
    "import": (["import", "hf", "/nonexistent/hf", "/nonexistent/out", "--dt", "bfloat16"], "--dt"),
    "generate": (["generate", "--checkpoint", "/nonexistent/ck", "--prompt", "x", "--temp", "1"], "--temp"),
}


@pytest.mark.parametrize("command", list(ABBREVIATION))
def test_every_command_refuses_an_abbreviated_flag_in_one_line(command, capsys):
    assert set(ABBREVIATION) == set(COMMANDS), "a new command needs its abbreviation here"
    argv, prefix = ABBREVIATION[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("functitan: error: ") and err.count("\n") == 1, err
    assert f"unrecognized arguments: {prefix} " in err or f"unknown config key {prefix[2:]!r}" in err, err
    with pytest.raises(ValueError, match=prefix[2:]):  # --debug: the error with its traceback
        main([*argv, "--debug"])


def test_an_argparse_error_is_one_line_naming_the_help_to_read(capsys):
    # argparse's own errors (a missing argument, a bad choice) used to print its usage and `prog: error:` lines
    assert main(["data", "prepare", "corpus.txt"]) == 2
    assert capsys.readouterr().err == (
        "functitan: error: the following arguments are required: --out (see functitan data prepare --help)\n"
    )


def test_a_dash_alias_and_its_config_key_are_one_flag(capsys):
    # --stages-per-rank is parallelism.stages_per_rank: either spelling, same schedule
    show = ["pipeline", "show", "--schedule", "interleaved_1f1b", "--pp", "2", "--microbatches", "4"]
    assert main([*show, "--stages-per-rank", "3"]) == 0
    dashed = capsys.readouterr().out
    assert main([*show, "--parallelism.stages_per_rank=3"]) == 0
    assert capsys.readouterr().out == dashed and "stages_per_rank=3" in dashed
    # and a value the config refuses, each flag refuses with the config's words, naming the key
    for argv, flag in (
        (["gradcheck", "--seq-len", "0"], "--seq-len"),
        (["gradcheck", "--training.seq_len=0"], "--training.seq_len"),
        (["plan", "--seq-len", "0"], "--seq-len"),
        (["pipeline", "show", "--schedule", "1f1b", "--pp", "0"], "--pp"),
        (["pipeline", "show", "--parallelism.pipeline_schedule=zbv"], "--parallelism.pipeline_schedule"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        key = {"--seq-len": "training.seq_len", "--pp": "parallelism.pp"}.get(flag, flag.removeprefix("--"))
        assert err.startswith(f"functitan: error: {flag}=") and key in err, err
    assert main(["train", "--training.seq_len=0"]) == 2
    assert "training.seq_len=0: must be >= 1" in capsys.readouterr().err
    from functitan.data._prepare import _parser as prepare_parser

    dashed = prepare_parser().parse_args(["c.txt", "--out", "s", "--text-key", "body", "--tokenizer", "t.json"])
    dotted = prepare_parser().parse_args(["c.txt", "--out", "s", "--data.text_key=body", "--data.tokenizer=t.json"])
    assert vars(dashed) == vars(dotted) and (dashed.text_key, dashed.tokenizer) == ("body", "t.json")


def test_a_config_flag_takes_its_help_and_check_from_the_key(capsys):
    from functitan.config import flat_keys
    from functitan.job_config import JobConfig

    with pytest.raises(SystemExit):
        main(["pipeline", "show", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for key in ("parallelism.pp", "parallelism.stages_per_rank", "training.microbatches"):
        text = flat_keys(JobConfig)[key][2]
        assert text and text.rstrip(".") in out and f"the config key {key}" in out, (key, out)


def test_every_command_reads_model_flags_with_the_trainers_parser():
    from functitan.config import parse_config
    from functitan.job_config import JobConfig, parse_model_args

    argv = ["--model.name", "gpt2", "--model.n_layers=2", "--model.flavor", "debug", "--model.tie=false"]
    model, rest = parse_model_args([*argv, "--top", "1"])
    assert rest == ["--top", "1"]
    assert model == parse_config(JobConfig, argv).model
    assert (model.name, model.flavor, dict(model.overrides)) == ("gpt2", "debug", {"n_layers": "2", "tie": "false"})


def test_plan_takes_a_model_field_with_a_space_as_train_does(capsys):
    # `--model.n_layers 0` was "unknown argument" in plan (only `--model.<field>=value` was read there)
    assert main(["plan", "--device", "cpu", "--model.n_heads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("functitan: error: ") and "n_heads" in err and "unknown argument" not in err, err


def test_every_error_class_a_user_fixes_is_a_user_error():
    # UserError is what a command shows as one line; a ValueError subclass outside it read like a bug's
    import importlib
    import pkgutil

    import functitan
    from functitan.errors import UserError

    found = {}
    for info in pkgutil.walk_packages(functitan.__path__, "functitan."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (torchft, matplotlib) that is not installed
            continue
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, ValueError) and obj.__module__ == info.name:
                found[f"{info.name}.{name}"] = issubclass(obj, UserError)
    assert len(found) >= 10 and "functitan.plan._plan.PlanError" in found, found
    assert [name for name, ok in found.items() if not ok] == []


_TINY = list(TINY_FLAGS)


def _losses(run_dir) -> dict[int, dict]:
    import json

    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_every_train_key_says_what_it_is_in_train_help(capsys):
    # the comments in job_config.py were not in --help: 40 of the keys had no description
    from functitan.config import flat_keys
    from functitan.job_config import JobConfig

    assert [key for key, (_, _, text) in flat_keys(JobConfig).items() if not text] == []
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--optimizer.b1" in out and "first-moment decay (adamw, lion)" in out
    assert "--print-config" in out and "--dry-run" in out


def test_print_config_is_toml_that_config_reads_back_to_the_same_run(tmp_path, capsys):
    from functitan.config import parse_config
    from functitan.job_config import JobConfig

    args = [
        "--config",
        "configs/debug.toml",
        "--model.n_layers=3",
        "--data.paths=a.txt,b dir/c.jsonl",
        "--optimizer.name=lion",
        "--optimizer.schedule=wsd",
        "--optimizer.decay_fraction=0.25",
        '--metrics.run_name=quoted "name"',
        "--parallelism.dp_shard=2",
    ]
    assert main(["train", *args, "--print-config"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "mine.toml").write_text(text)
    again = parse_config(JobConfig, ["--config", str(tmp_path / "mine.toml")])
    assert again == parse_config(JobConfig, args)
    assert again.data.paths == ("a.txt", "b dir/c.jsonl") and str(again.model.overrides["n_layers"]) == "3"
    assert '[optimizer]\nname = "lion"' in text and "[elastic]" not in text  # only what differs from defaults


def test_dry_run_builds_the_run_prints_the_banner_and_the_planners_peak_and_writes_nothing(tmp_path, capsys):
    from functitan.config import parse_config
    from functitan.job_config import JobConfig
    from functitan.model import count
    from functitan.train import run

    assert main(["train", *_TINY, f"--metrics.run_dir={tmp_path}", "--checkpoint.enable=true", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert list(tmp_path.iterdir()) == []  # no run directory, no checkpoint, no metrics
    n = count(run(parse_config(JobConfig, _TINY), dry_run=True)["state"].params)
    assert out[0] == f"functitan: model llama (debug): {n / 1e3:.2f}K parameters", out
    assert out[1].startswith("functitan: layout one process on 1 process; 2 sequences x 16 tokens per step")
    kib = f"{4 * n / 2**10:.3g} KiB"  # fp32
    assert out[2].startswith(f"functitan: rank 0 holds {kib} params + {kib} grads + "), out[2]
    assert out[3] == "functitan: nothing is written (--dry-run)" and len(out) == 5
    # the planner's trace of the step: the state and the activations, more than the state alone
    assert out[4].startswith("functitan: planner: rank 0 peaks at ") and out[4].endswith(
        "(params, grads, optimizer state and activations; the step traced on meta tensors at 1 process)"
    ), out[4]
    state = out[2].split(" = ")[1].split(" before")[0]
    peak = out[4].split("peaks at ")[1].split(" in a step")[0]
    in_kib = {"KiB": 1, "MiB": 2**10}
    assert float(peak.split()[0]) * in_kib[peak.split()[1]] > float(state.split()[0]) * in_kib[state.split()[1]]


def _dry_banner(overrides: dict) -> str:
    import contextlib
    import io

    from functitan.config import apply_overrides
    from functitan.job_config import JobConfig
    from functitan.train import run

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = run(apply_overrides(JobConfig(), overrides), dry_run=True)
    assert out["dry_run"] and out["steps"] == 0
    return buf.getvalue()


def test_the_banner_names_each_axis_and_this_ranks_share(gloo):
    tiny = {a[2:].split("=")[0]: a.split("=")[1] for a in _TINY}
    one = _dry_banner(tiny)
    two = gloo.run(_dry_banner, 2, {**tiny, "parallelism.dp_shard": 2})
    assert two[1] == ""  # rank 0 prints it
    line = next(x for x in two[0].splitlines() if "layout" in x)
    assert line.startswith("functitan: layout dp_shard=2 on 2 processes; 2 sequences"), line

    def held(text: str) -> float:  # the params this rank holds, in KiB
        value, unit = next(x for x in text.splitlines() if "holds" in x).split("holds ")[1].split()[:2]
        assert unit == "KiB", text
        return float(value)

    assert held(two[0]) == pytest.approx(held(one) / 2, rel=0.05)  # FSDP: half the params on each rank
    # ep borrows its ranks from dp_shard: the line says dp_shard as configured, and each rank holds half the params
    # under ep 2 as under fsdp 2 (its experts whole, the dense params sharded over both ranks)
    moe = {"model.name": "qwen3_moe", "model.flavor": "debug", "training.seq_len": "32", "training.batch_size": "2"}
    one, fsdp = _dry_banner(moe), gloo.run(_dry_banner, 2, {**moe, "parallelism.dp_shard": 2})[0]
    ep = gloo.run(_dry_banner, 2, {**moe, "parallelism.dp_shard": 2, "parallelism.ep": 2})[0]
    assert next(x for x in ep.splitlines() if "layout" in x).startswith("functitan: layout dp_shard=2 ep=2 on 2 ")
    assert held(ep) == pytest.approx(held(fsdp), rel=0.05) and held(ep) == pytest.approx(held(one) / 2, rel=0.05)


def test_lion_and_adafactor_train_from_the_config_and_loss_avg_is_the_window_mean(tmp_path):
    common = [*_TINY, "--training.steps=4", f"--metrics.run_dir={tmp_path}", "--optimizer.lr=1e-2"]
    runs = {}
    for name in ("adamw", "lion", "adafactor"):
        assert (
            main(["train", *common, f"--optimizer.name={name}", f"--metrics.run_name={name}", "--metrics.log_every=1"])
            == 0
        )
        runs[name] = _losses(tmp_path / name)
    first = {name: r[1]["loss"] for name, r in runs.items()}
    assert len(set(first.values())) == 1  # the same init and batch
    # three different updates (adamw's and lion's first steps are both lr x sign(g): step 2 agrees)
    third = {name: r[3]["loss"] for name, r in runs.items()}
    assert len(set(third.values())) == 3 and all(math.isfinite(v) for v in third.values()), third
    # the logged loss_avg is the mean of the steps since the previous line
    assert main(["train", *common, "--metrics.run_name=window", "--metrics.log_every=3"]) == 0
    window, each = _losses(tmp_path / "window"), runs["adamw"]
    assert sorted(window) == [1, 3, 4]
    assert window[3]["loss_avg"] == pytest.approx((each[2]["loss"] + each[3]["loss"]) / 2, rel=1e-6)
    assert window[4]["loss_avg"] == pytest.approx(each[4]["loss"], rel=1e-6)
    assert window[3]["loss"] == pytest.approx(each[3]["loss"], rel=1e-6)
