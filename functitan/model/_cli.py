"""``functitan gradcheck``: a model's gradients under each parallel layout against one process.

functitan gradcheck --model.name=path/to/my_model.py --model.flavor=tiny --layouts=fsdp,tp,tp_sp,hsdp
"""

from __future__ import annotations

from collections.abc import Sequence

from .._command import CommandParser, config_flag, model_flags, run
from ..job_config import DEFAULT_FLAVOR, DEFAULT_MODEL, parse_model_args
from ._gradcheck import GRADCHECK_LAYOUTS, gradcheck

EXAMPLE = """example:
  functitan gradcheck --model.name=models.gpt2 --model.flavor=debug --layouts=fsdp,tp_sp
"""


def main(argv: Sequence[str]) -> int:
    """``functitan gradcheck``: 0 when every layout agrees, 1 when one differs, 2 for bad input (one line,
    functitan.errors; ``--debug`` shows its traceback)."""
    return run(argv, _gradcheck_cli)


def _parser() -> CommandParser:
    parser = CommandParser(
        "gradcheck",
        description="Compare one step's loss and gradients (--steps N: N steps' losses and updates) under parallel "
        "layouts (gloo processes on this machine) with one process; list every parameter that differs. Keep the "
        "model tiny.",
        examples=EXAMPLE,
    )
    parser.add_argument(
        "--layouts", default="fsdp,hsdp,tp,tp_sp", help=f"comma-separated, from {','.join(GRADCHECK_LAYOUTS)}"
    )
    config_flag(parser, "training.batch_size", default=4, also=["--batch"])
    config_flag(parser, "training.seq_len", default=16)
    config_flag(parser, "training.steps", default=1)
    model_flags(parser)
    return parser


def _gradcheck_cli(argv: Sequence[str]) -> int:
    model, rest = parse_model_args(argv)
    ns = _parser().parse_args(rest)
    report = gradcheck(
        model.name or DEFAULT_MODEL,
        flavor=model.flavor or DEFAULT_FLAVOR,
        overrides=dict(model.overrides),
        layouts=ns.layouts.split(","),
        batch=ns.batch_size,
        seq_len=ns.seq_len,
        steps=ns.steps,
    )
    bad = 0
    for layout, diffs in report.items():
        if "error" in diffs:  # the layout raised; the others ran
            print(f"{layout:<12} error: {diffs['error']}")
            bad += 1
            continue
        print(f"{layout:<12} {'ok' if not diffs else f'{len(diffs)} differ'}")
        for what, d in sorted(diffs.items()):
            print(f"  {what}: max |difference| {d:.3g}")
        bad += len(diffs)
    return 1 if bad else 0
