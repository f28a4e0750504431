"""The ``functitan`` command: one line per subcommand here; each subcommand's ``--help`` shows an example."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (one-line summary, "module:function" taking the remaining arguments and returning an exit status)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "train a model: a TOML config plus --section.key=value overrides (--nproc N, or --nnodes elastic)",
        "functitan._train_cli:main",
    ),
    "rendezvous": ("run the store that elastic nodes meet in (docs/elastic.md)", "functitan.elastic._store:main"),
    "report": (
        "draw runs' curves (loss, lr, throughput, MFU, memory) and a summary table to a PNG and an HTML page",
        "functitan.metrics._report_cli:main",
    ),
    "gradcheck": (
        "check a model's gradients under FSDP, HSDP, TP and TP + SP against one process",
        "functitan.model._cli:main",
    ),
    "pipeline": (
        "pipeline show: print, simulate and draw a pipeline schedule (GPipe, 1F1B, interleaved, ZB)",
        "functitan.pipeline._cli:main",
    ),
    "plan": (
        "recommend a parallel layout for a model on a cluster (writes a config you can train with)",
        "functitan.plan:main",
    ),
    "export": (
        "export hf|dcp: write a functitan checkpoint as a Hugging Face directory or a torchtitan DCP checkpoint",
        "functitan.checkpoint._cli:export_main",
    ),
    "import": (
        "import hf: make a functitan checkpoint from a Hugging Face model directory",
        "functitan.checkpoint._cli:import_main",
    ),
    "data": ("data prepare: tokenize a corpus into memory-mapped shards", "functitan.data._prepare:main"),
    "generate": (
        "continue a prompt with a trained model: a run's checkpoint or an HF directory (greedy, top-k, top-p)",
        "functitan.generate._cli:main",
    ),
}

USAGE = "\n".join(
    [
        "functitan: JAX-style functional distributed training on PyTorch.",
        "",
        "usage: functitan <command> [args]      (functitan <command> --help: every option and an example)",
        "       functitan --version",
        "",
        "commands:",
        *(f"  {name:<10} {line}" for name, (line, _) in COMMANDS.items()),
        "",
        "examples:",
        "  functitan train --config configs/debug.toml --training.steps=100",
        "  functitan report runs/<run-name>",
        "",
        "A user error (a bad value, path or checkpoint) prints one line and exits with code 2; add --debug to any",
        "command to see its traceback.",
        "",
    ]
)


def _load(target: str) -> Callable[[list[str]], int]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "--version":
        from . import __version__

        print(f"functitan {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        from .errors import unknown_command

        return unknown_command("functitan", command, COMMANDS)
    return _load(COMMANDS[command][1])(rest)


if __name__ == "__main__":
    sys.exit(main())
