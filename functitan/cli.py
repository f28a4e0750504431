"""The ``functitan`` command: ``train``, ``rendezvous``, ``pipeline show``, ``export hf``, ``import hf``, ``data prepare``."""

from __future__ import annotations

import sys
from typing import Sequence

USAGE = """usage: functitan <command> [args]

commands:
  train [--config FILE.toml] [--section.key=value ...] [--nproc N]   train a model (--help lists every key)
        [--nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id NAME]     ... elastically (docs/elastic.md)
  rendezvous [--host H] [--port 29400]                                 the store elastic nodes meet in
  pipeline show --schedule zb_v --pp 4 --microbatches 8 [--out t.png]   draw a pipeline schedule
  gradcheck --model.name=NAME [--layouts fsdp,tp_sp]                   a model's gradients under each layout vs one process
  plan --model.flavor llama3_8b --nodes 8 --device h100 [--out plan.toml]  recommend a parallel layout
  export hf CHECKPOINT OUT_DIR                                          write a Hugging Face model directory
  import hf HF_DIR OUT_CHECKPOINT                                       make a functitan checkpoint from HF
  data prepare SRC... --out DIR [--tokenizer FILE]                     tokenize a corpus into memory-mapped shards

A user error (a bad value, path or checkpoint) prints one line and exits with code 2; add --debug to any
command to see its traceback.
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "train":
        from .train import main as train_main

        return train_main(rest)
    if command == "rendezvous":
        from .elastic._store import main as store_main

        return store_main(rest)
    if command == "pipeline":
        from .pipeline._cli import main as pipeline_main

        return pipeline_main(rest)
    if command == "gradcheck":
        from .model._cli import main as gradcheck_main

        return gradcheck_main(rest)
    if command == "data":
        from .data._prepare import main as data_main

        return data_main(rest)
    if command == "plan":
        from .plan import main as plan_main

        return plan_main(rest)
    if command in ("export", "import"):
        from .checkpoint._hf_cli import main as hf_main

        return hf_main(command, rest)
    print(f"functitan: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
