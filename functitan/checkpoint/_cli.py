"""``functitan export hf|dcp CKPT OUT`` and ``functitan import hf HF_DIR OUT_CKPT``.

Paths are checked before any work, so a wrong one is a named error (one line, exit code 2): a checkpoint or
HF directory that does not exist or is not one, an output path that is a file, or that cannot be created or
written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .._command import CommandParser, run
from ..errors import UserError, unknown_command
from ._hf import MAX_SHARD_BYTES
from ._manager import check_checkpoint_path


def _hf_in(path: str) -> None:
    from ._hf import is_hf_dir

    if not Path(path).is_dir():
        raise UserError(
            f"Hugging Face directory {path} does not exist; pass a local model directory "
            f"(config.json and *.safetensors)"
        )
    if not is_hf_dir(path):
        raise UserError(
            f"{path} is not a Hugging Face model directory: it needs config.json and model.safetensors "
            f"(or model.safetensors.index.json)"
        )


def _writable_dir(path: str, *, must_be_new: bool = False) -> None:
    """``path`` is (or can be made) a writable directory; ``must_be_new``: it must not exist yet."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"output {path} exists and is not a directory; pass a new or empty directory")
    if must_be_new and p.exists():
        raise UserError(f"output {path} already exists; pass a new directory (a checkpoint is never overwritten)")
    parent = p if p.exists() else next((d for d in p.absolute().parents if d.exists()), Path("/"))
    if not parent.is_dir():
        raise UserError(f"output {path}: {parent} is not a directory; pass a path under a directory")
    try:  # a probe, not os.access: root passes access() on read-only and virtual file systems
        os.rmdir(tempfile.mkdtemp(prefix=".functitan-probe-", dir=parent))
    except OSError as e:
        raise UserError(
            f"output {path}: cannot write in {parent} ({e.strerror}); pass a directory you can write to"
        ) from None


def _export_tokenizer(checkpoint: str, choice: str) -> tuple[object | None, str]:
    """``(the tokenizer export hf writes, what the closing line says of it)`` for ``--tokenizer``."""
    from ..data import load_tokenizer, run_tokenizer
    from ._hf import recorded_run_config

    if choice == "none":
        return None, "no tokenizer: --tokenizer=none"
    if choice != "run":
        return load_tokenizer(Path(choice)), f"tokenizer {choice}"
    run = recorded_run_config(checkpoint)
    if run is None:
        return None, "no tokenizer: this checkpoint has no run record; add one with --tokenizer=FILE"
    data = run["data"]
    which = data.get("tokenizer") or ("the shards' tokenizer" if data.get("path") else "the byte tokenizer")
    return run_tokenizer(data), f"with the run's tokenizer, {which}, and generation_config.json"


EXAMPLES = {
    "export": "examples:\n  functitan export hf runs/llama-20260101-120000/checkpoints/200 hf_out/\n"
    "  python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf_out')\"\n"
    "  functitan export dcp runs/llama-20260101-120000/checkpoints/200 tt_out/step-200   # torchtitan's names",
    "import": "example:\n  functitan import hf ~/models/Llama-3.2-1B ckpt/llama-1b\n"
    "  functitan train --checkpoint.load_path=ckpt/llama-1b --data.tokenizer=~/models/Llama-3.2-1B/tokenizer.json",
}


def export_main(argv: Sequence[str]) -> int:
    """``functitan export hf ...``"""
    return main("export", argv)


def import_main(argv: Sequence[str]) -> int:
    """``functitan import hf ...``"""
    return main("import", argv)


FORMATS = {"export": ("hf", "dcp"), "import": ("hf",)}  # command -> the formats it takes, the first the default help


def _parser(command: str, fmt: str) -> CommandParser:
    parser = CommandParser(f"{command} {fmt}", examples=EXAMPLES[command])
    if command == "export":
        parser.add_argument(
            "checkpoint", help="a functitan checkpoint (a step directory: runs/<name>/checkpoints/<step>)"
        )
        if fmt == "hf":
            parser.add_argument("out", help="the Hugging Face directory to write")
            parser.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES)
            parser.add_argument(
                "--tokenizer",
                default="run",
                help="the tokenizer files to include: run (the one the run trained with), a tokenizer.json, or none",
            )
        else:
            parser.add_argument(
                "out", help="the DCP checkpoint directory to write (new; e.g. outputs/checkpoint/step-200)"
            )
            parser.add_argument(
                "--dtype", choices=("float32", "bfloat16"), default=None, help="default: the checkpoint's dtype"
            )
    else:
        parser.add_argument("hf_dir", help="a local Hugging Face model directory (config.json + safetensors)")
        parser.add_argument("out", help="the functitan checkpoint directory to write")
        parser.add_argument(
            "--model",
            default=None,
            help="the model as --model.name spells it (default: the installed model of config.json's architecture)",
        )
        parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    return parser


def main(command: str, argv: Sequence[str]) -> int:
    return run(argv, lambda args: _main(command, args))


def _main(command: str, args: list[str]) -> int:
    formats = FORMATS[command]
    if args and args[0] in ("-h", "--help"):
        args = [formats[0], *args]
    if not args:
        raise UserError(f"name a format ({' or '.join(formats)}): functitan {command} {formats[0]} ... (see --help)")
    if args[0] not in formats:
        return unknown_command(f"functitan {command}", args[0], list(formats))
    fmt = args[0]
    ns = _parser(command, fmt).parse_args(args[1:])

    def body() -> int:
        import torch

        from ._export import export_dcp, export_hf
        from ._hf import hf_model, import_hf, recorded_model

        dtype = getattr(torch, ns.dtype) if getattr(ns, "dtype", None) else None
        if command == "export" and fmt == "hf":
            if ns.max_shard_bytes < 1:  # checked first: it was taken as "no limit" after the export's work
                raise ValueError(f"--max-shard-bytes={ns.max_shard_bytes}: must be >= 1, e.g. 5000000000 (5 GB)")
            check_checkpoint_path(ns.checkpoint)
            _writable_dir(ns.out)
            model, cfg = recorded_model(ns.checkpoint)
            tokenizer, note = _export_tokenizer(ns.checkpoint, ns.tokenizer)
            export_hf(
                ns.checkpoint, ns.out, model=model, cfg=cfg, tokenizer=tokenizer, max_shard_bytes=ns.max_shard_bytes
            )
            print(
                f"functitan: wrote a Hugging Face {model.hf.architecture if model.hf else model.name} to {ns.out}"
                f" ({note})"
            )
        elif command == "export":
            from ._dcp import torchtitan_keys

            check_checkpoint_path(ns.checkpoint)
            _writable_dir(ns.out, must_be_new=True)
            model, cfg = recorded_model(ns.checkpoint)
            torchtitan_keys(model, cfg)  # a model without a torchtitan map is named before any work
            export_dcp(ns.checkpoint, ns.out, model=model, cfg=cfg, dtype=dtype)
            print(
                f"functitan: wrote a torch DCP checkpoint in torchtitan's {model.name} names to {ns.out}; torchtitan "
                f"loads it with --checkpoint.initial_load_path={ns.out} --checkpoint.initial_load_model_only"
            )
        else:
            _hf_in(ns.hf_dir)
            _writable_dir(ns.out, must_be_new=True)
            name, model = hf_model(ns.hf_dir, ns.model)
            import_hf(ns.hf_dir, ns.out, model, name=name, dtype=dtype)
            print(
                f"functitan: wrote a functitan checkpoint of {ns.hf_dir} to {ns.out}; train from it with "
                f"--checkpoint.load_path={ns.out}"
            )
        return 0

    return body()
