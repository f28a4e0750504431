"""``functitan rendezvous``: the standalone store that elastic agents meet in, so no agent is a single point of failure.

torchrun's c10d rendezvous keeps its state in a TCPStore. By default the first agent hosts it, and when that
node dies the whole job dies with it. Run this process on a host that outlives the workers (the SLURM batch
host, a small Kubernetes Deployment behind a Service) and start every node with
``--rdzv-endpoint=HOST:PORT``: the launcher then tells torchrun not to host a store (``is_host=false``).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta

from .._command import CommandParser, run
from ..errors import UserError
from ._reach import listen_problem

__all__ = ["main", "serve"]


def serve(host: str, port: int, *, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Host a TCPStore on ``host:port`` until ``stop`` is set (or forever)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"functitan: rendezvous store on {host}:{store.port}", flush=True)
    if ready is not None:
        ready.set()
    (stop or threading.Event()).wait()
    del store


def main(argv: Sequence[str] | None = None) -> int:
    """``functitan rendezvous``: serves until SIGTERM/SIGINT; bad input is one line and exit 2 (functitan.errors;
    ``--debug`` shows its traceback)."""
    return run(argv, _serve_cli)


def _serve_cli(argv: Sequence[str]) -> int:
    parser = CommandParser(
        "rendezvous",
        description=__doc__.split("\n")[0],
        examples="example:\n  functitan rendezvous --port 29400        # on one host, then on every node:\n"
        "  functitan train --config configs/debug.toml --nproc 1 --nnodes 2:3 --rdzv-endpoint HOST:29400 --rdzv-id run1",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    parser.add_argument("--port", type=int, default=29400, help="TCP port (default 29400)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port={args.port}: a TCP port is 0..65535, e.g. 29400")
    problem = listen_problem(args.host, args.port)  # before torch: its failure prints C++ stack frames, or waits
    if problem is not None:
        raise UserError(
            f"cannot listen on {args.host}:{args.port}: {problem}; pick another --port, or a --host address of this "
            "machine (default 0.0.0.0: all of them)"
        )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(args.host, args.port, stop=stop)
    except RuntimeError as e:  # torch's DistNetworkError: the port is taken, or the host is not this machine's
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"cannot listen on {args.host}:{args.port} ({reason}); pick another --port, or a --host address of this "
            "machine"
        ) from e
    return 0


if __name__ == "__main__":
    sys.exit(main())
