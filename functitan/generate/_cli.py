"""``functitan generate --checkpoint CKPT --prompt TEXT``: a model's continuation of a prompt.

The checkpoint is a run's step (``runs/<run>/checkpoints/<step>``, the tokenizer and ``data.add_bos`` from the
run's record), ``import hf``'s output, or a Hugging Face directory (its ``tokenizer.json``, as ``export hf``
writes one). Generation stops at ``--max-new-tokens`` or at the tokenizer's EOS, the token every training
document ended with.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from .._command import CommandParser, run
from ..config import _attributes
from ..errors import UserError
from ._sample import SamplingConfig

EXAMPLES = """examples:
  functitan generate --checkpoint runs/llama-20260101-120000/checkpoints/200 --prompt "def fib(n):"
  functitan generate --checkpoint hf_out/ --prompt "import os" --temperature 0.8 --top-p 0.95 --seed 1
"""


def main(argv: Sequence[str]) -> int:
    """``functitan generate``: prints the prompt and its continuation (``--ids``: the token ids as JSON)."""
    return run(argv, _generate)


def _parser() -> CommandParser:
    parser = CommandParser(
        "generate", description="Continue a prompt with a trained model (greedy by default).", examples=EXAMPLES
    )
    parser.add_argument("--checkpoint", required=True, help="a run's step directory, import hf's output or an HF dir")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer file (default: the run's, or the HF dir's)")
    helps = _attributes(SamplingConfig)
    for f in fields(SamplingConfig):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag, type=type(f.default), default=f.default, help=f"{helps[f.name]} (default {f.default})"
        )
    parser.add_argument("--ids", action="store_true", help="print the prompt's and the new token ids as JSON")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default cpu)")
    return parser


def _generate(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    try:
        sampling = SamplingConfig(**{f.name: getattr(ns, f.name) for f in fields(SamplingConfig)})
    except ValueError as e:
        raise UserError(f"--{str(e).replace('_', '-')}") from None
    model, model_cfg, params, tokenizer, add_bos = load(ns.checkpoint, ns.tokenizer, device=ns.device)
    prompt = [int(i) for i in tokenizer.encode(ns.prompt)]
    prompt = [int(tokenizer.bos_id), *prompt] if add_bos else prompt
    from ._sample import generate

    new = generate(model, model_cfg, params, prompt, sampling, stop_ids=(tokenizer.eos_id,))
    if ns.ids:
        print(json.dumps({"prompt_ids": prompt, "ids": new}))
    else:
        print(ns.prompt + tokenizer.decode([i for i in new if i != tokenizer.eos_id]))
    return 0


def load(checkpoint: str, tokenizer_file: str | None, *, device: str = "cpu") -> tuple[Any, Any, Any, Any, bool]:
    """``(model, model config, params, tokenizer, add_bos)`` of a checkpoint or an HF directory, params in fp32
    on ``device`` (a bf16 export is widened: sampling compares logits)."""
    import torch

    from ..checkpoint import check_checkpoint_path, hf_model, is_hf_dir, load_hf, recorded_run_config, saved_params
    from ..data import load_tokenizer, run_tokenizer

    path = Path(checkpoint)
    if is_hf_dir(path):
        _, model = hf_model(path)
        model_cfg, params = load_hf(path, model, dtype=torch.float32, device=device)
        tokenizer = load_tokenizer(Path(tokenizer_file)) if tokenizer_file else _hf_tokenizer(path)
        return model, model_cfg, params, tokenizer, False
    check_checkpoint_path(path)
    model, model_cfg, params = saved_params(path)
    import optree

    params = optree.tree_map(lambda x: x.to(device=device, dtype=torch.float32) if x.is_floating_point() else x, params)
    run_cfg = recorded_run_config(path)
    if tokenizer_file:
        tokenizer = load_tokenizer(Path(tokenizer_file))
    elif run_cfg is not None:
        tokenizer = run_tokenizer(run_cfg["data"])
    else:
        raise UserError(f"{path} has no run record naming its tokenizer (import hf's output?); pass --tokenizer FILE")
    return model, model_cfg, params, tokenizer, bool(run_cfg and run_cfg["data"].get("add_bos"))


def _hf_tokenizer(hf_dir: Path) -> Any:
    from ..data import load_tokenizer

    file = hf_dir / "tokenizer.json"
    if not file.is_file():
        raise UserError(f"{hf_dir} has no tokenizer.json; pass --tokenizer FILE (functitan export hf writes one)")
    special = (
        json.loads((hf_dir / "tokenizer_config.json").read_text())
        if (hf_dir / "tokenizer_config.json").is_file()
        else {}
    )
    names = {
        k: v if isinstance(v, str) else (v or {}).get("content")
        for k, v in special.items()
        if k in ("bos_token", "eos_token")
    }
    return load_tokenizer(file, bos_token=names.get("bos_token"), eos_token=names.get("eos_token"))
