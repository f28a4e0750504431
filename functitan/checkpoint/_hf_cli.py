"""``functitan export hf CKPT OUT`` and ``functitan import hf HF_DIR OUT_CKPT``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import torch

from ..model import Model, load_model, model_for_architecture
from ._hf import CONFIG_NAME, MAX_SHARD_BYTES, _read_json, export_hf, import_hf, recorded_model


def _model_of(hf_dir: str, name: str | None) -> tuple[str, Model]:
    if name is not None:
        return name, load_model(name)
    config = Path(hf_dir) / CONFIG_NAME
    if not config.is_file():
        raise ValueError(f"{config} not found; import hf takes a local Hugging Face model directory")
    archs = _read_json(config).get("architectures") or []
    if not archs:
        raise ValueError(f"{config} names no architectures; pass --model NAME")
    return model_for_architecture(archs[0])


def main(command: str, argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"functitan {command} hf")
    if command == "export":
        parser.add_argument("checkpoint", help="a functitan checkpoint (a step directory: runs/<name>/checkpoints/<step>)")
        parser.add_argument("out", help="the Hugging Face directory to write")
        parser.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES)
    else:
        parser.add_argument("hf_dir", help="a local Hugging Face model directory (config.json + safetensors)")
        parser.add_argument("out", help="the functitan checkpoint directory to write")
        parser.add_argument("--model", default=None,
                            help="the model as --model.name spells it (default: the installed model of config.json's architecture)")
        parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = list(argv)
    if not args or args[0] != "hf":
        parser.error(f"usage: functitan {command} hf ...")
    ns = parser.parse_args(args[1:])
    try:
        if command == "export":
            model, cfg = recorded_model(ns.checkpoint)
            export_hf(ns.checkpoint, ns.out, model=model, cfg=cfg, max_shard_bytes=ns.max_shard_bytes)
            print(f"functitan: wrote a Hugging Face {model.hf.architecture if model.hf else model.name} to {ns.out}")
        else:
            name, model = _model_of(ns.hf_dir, ns.model)
            import_hf(ns.hf_dir, ns.out, model, name=name, dtype=getattr(torch, ns.dtype) if ns.dtype else None)
            print(f"functitan: wrote a functitan checkpoint of {ns.hf_dir} to {ns.out}; train from it with "
                  f"--checkpoint.load_path={ns.out}")
    except ValueError as e:
        print(f"functitan {command} hf: {e}", file=sys.stderr)
        return 2
    return 0
