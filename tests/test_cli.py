"""The first five minutes: `functitan --help` lists every subcommand; each subcommand's --help has an example."""

from __future__ import annotations

import pytest

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
