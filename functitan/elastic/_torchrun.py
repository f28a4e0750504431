"""``python -m functitan.elastic._torchrun ARGS`` is ``torchrun ARGS`` that dies with the launcher (``_orphans``)."""

from __future__ import annotations

import os
import sys

from ._orphans import LAUNCHER_PID, die_with_parent


def main() -> None:
    launcher = os.environ.get(LAUNCHER_PID, "")
    if launcher.isdigit():
        die_with_parent(int(launcher))
    from torch.distributed.run import main as torchrun

    sys.argv[0] = "torchrun"
    torchrun()


if __name__ == "__main__":
    main()
