"""``functitan export hf CKPT OUT`` and ``functitan import hf HF_DIR OUT_CKPT``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

from ._hf import export_hf, import_hf


def main(command: str, argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"functitan {command} hf")
    if command == "export":
        parser.add_argument("checkpoint", help="a functitan checkpoint (runs/<name>/checkpoints/step-N)")
        parser.add_argument("out", help="the Hugging Face directory to write")
        parser.add_argument("--max-shard-bytes", type=int, default=5 * 10**9)
    else:
        parser.add_argument("hf_dir", help="a local Hugging Face LlamaForCausalLM directory (safetensors)")
        parser.add_argument("out", help="the functitan checkpoint directory to write")
        parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = list(argv)
    if not args or args[0] != "hf":
        parser.error(f"usage: functitan {command} hf ...")
    ns = parser.parse_args(args[1:])
    try:
        if command == "export":
            cfg = export_hf(ns.checkpoint, ns.out, max_shard_bytes=ns.max_shard_bytes)
            print(f"functitan: wrote a Hugging Face Llama ({cfg.n_layers} layers, dim {cfg.dim}) to {ns.out}")
        else:
            cfg = import_hf(ns.hf_dir, ns.out, dtype=getattr(torch, ns.dtype) if ns.dtype else None)
            print(f"functitan: wrote a functitan checkpoint of {ns.hf_dir} to {ns.out}; train from it with "
                  f"--checkpoint.load_path={ns.out}")
    except ValueError as e:
        print(f"functitan {command} hf: {e}", file=sys.stderr)
        return 2
    return 0
