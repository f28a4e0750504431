"""``functitan gradcheck``: a model's gradients under each parallel layout against one process.

functitan gradcheck --model.name=path/to/my_model.py --model.flavor=tiny --layouts=fsdp,tp,tp_sp,hsdp
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..errors import UserError, pop_debug, user_errors_exit
from ..job_config import DEFAULT_FLAVOR, DEFAULT_MODEL
from ._gradcheck import GRADCHECK_LAYOUTS, gradcheck


def main(argv: Sequence[str]) -> int:
    """``functitan gradcheck``: 0 when every layout agrees, 1 when one differs, 2 for bad input (one line,
    functitan.errors; ``--debug`` shows its traceback)."""
    debug, args = pop_debug(argv)
    return user_errors_exit(lambda: _gradcheck_cli(args), debug=debug)


def _gradcheck_cli(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="functitan gradcheck",
        description="Compare one step's loss and gradients (--steps N: N steps' losses and updates) under parallel layouts (gloo processes on this machine) "
        "with one process; list every parameter that differs. Keep the model tiny.",
        epilog="example: functitan gradcheck --model.name=models.gpt2 --model.flavor=debug --layouts=fsdp,tp_sp",
    )
    parser.add_argument(
        "--model.name", dest="name", default=DEFAULT_MODEL, help=f"as for functitan train (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--model.flavor", dest="flavor", default=DEFAULT_FLAVOR)
    parser.add_argument(
        "--layouts", default="fsdp,hsdp,tp,tp_sp", help=f"comma-separated, from {','.join(GRADCHECK_LAYOUTS)}"
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps to compare (default 1)")
    ns, rest = parser.parse_known_args(list(argv))
    for flag, value in (("--batch", ns.batch), ("--seq-len", ns.seq_len), ("--steps", ns.steps)):
        if value < 1:
            raise UserError(f"{flag}={value}: must be >= 1, e.g. {flag} 4")
    overrides = {}
    for arg in rest:
        key, eq, value = arg.removeprefix("--").partition("=")
        if not (arg.startswith("--model.") and eq):
            parser.error(f"unexpected argument {arg!r}; model fields look like --model.<field>=value")
        overrides[key.removeprefix("model.")] = value
    report = gradcheck(
        ns.name,
        flavor=ns.flavor,
        overrides=overrides,
        layouts=ns.layouts.split(","),
        batch=ns.batch,
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
