"""Run a function on N local processes over gloo (loopback): the harness for distributed tests and benchmarks.

Every distributed test in functitan compares N processes against a single-process reference computed in the
same test; this module starts the N processes. Processes come from a forkserver that has imported torch once,
so each start costs a fork, not a fresh interpreter.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_mod
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_distributed", "free_port"]


# The smallest Llama (and corpus) a CLI test or benchmark trains: the bundled default at 2 layers x 64 wide, so a
# step takes milliseconds and a whole run a few seconds. The caller adds batch, seq and what it tests.
TINY_RUN_ARGS: tuple[str, ...] = (
    "--model.n_layers=2",
    "--model.dim=64",
    "--model.n_heads=8",
    "--model.n_kv_heads=4",
    "--model.ffn_dim=128",
    "--data.max_corpus_bytes=400000",
    "--metrics.log_every=1",
    "--optimizer.eps=1e-6",
    "--training.threads=1",
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, queue, threads: int, crash_log: str
):
    import torch
    import torch.distributed as dist

    # a crash that skips the except below (a signal, a fatal error) leaves its Python traceback here for the parent
    crash_file = open(crash_log, "w")  # noqa: SIM115 - open until the process ends, as faulthandler needs
    faulthandler.enable(file=crash_file)

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001 - a lost rendezvous (a port taken meanwhile): the parent retries
        queue.put((rank, "init", traceback.format_exc()))
        return
    try:
        # plain pickle: torch's queue reducer would pass tensors as shared-memory fds, which die with the worker
        queue.put((rank, "ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the worker's traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


INIT_ATTEMPTS = 3
POLL_S = 0.5  # how often the parent checks, while it waits for results, that no worker has died without reporting


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, threads: int = 1, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo processes; return the per-rank results in rank order.

    ``fn`` must be importable (a module-level function) and its result picklable. A failure on any rank raises
    RuntimeError carrying that rank's traceback; a rank that dies without reporting (``os._exit``, a signal) raises
    within a second, naming its exit code or signal, since the others may wait for it in a collective until
    ``timeout``; a hang past ``timeout`` seconds kills every process. When the
    process group cannot form (the free port was taken between choosing and binding it, which happens on a
    busy machine), the whole run starts again on a new port, up to ``INIT_ATTEMPTS`` times; ``fn`` has not
    run then.
    """
    for _ in range(INIT_ATTEMPTS - 1):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout, threads)
        except _InitFailed:
            continue
    try:
        return _run_once(fn, world_size, args, kwargs, timeout, threads)
    except _InitFailed as e:
        raise RuntimeError(
            f"distributed run of {fn.__name__}: the gloo process group did not form in {INIT_ATTEMPTS} attempts:\n{e}"
        ) from None


class _InitFailed(Exception):
    pass


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float, threads: int
) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    queue = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="functitan-run-") as logs:
        crash_logs = [os.path.join(logs, f"rank{r}.crash") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, fn, args, kwargs, queue, threads, crash_logs[r]),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        failed: set[int] = set()  # the ranks whose failure is in errors
        init_failed = False
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size and not errors:
                try:
                    rank, status, value = queue.get(timeout=POLL_S)
                except queue_mod.Empty:
                    # a worker that died without reporting (os._exit, a signal, the OOM killer) never will: the
                    # others may be blocked in a collective with it, so waiting out the timeout would learn nothing
                    died = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                    if died:
                        try:  # its report may have reached the pipe just before it exited
                            rank, status, value = queue.get(timeout=POLL_S)
                        except queue_mod.Empty:
                            errors.append(_death(died[0], procs[died[0]].exitcode, crash_logs[died[0]]))
                            failed.add(died[0])
                            break
                    elif time.monotonic() > deadline:
                        raise RuntimeError(f"distributed run of {fn.__name__} timed out after {timeout}s") from None
                    else:
                        continue
                if status == "ok":
                    results[rank] = pickle.loads(value)
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    failed.add(rank)
                    init_failed = status == "init"
        finally:
            killed = set()
            for r, p in enumerate(procs):
                p.join(timeout=5 if not errors and len(results) == world_size else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
                    killed.add(r)
            queue.close()
        if errors and not init_failed:
            # a rank that died without reporting is the likely cause of the others' errors (a peer gone): first
            errors[:0] = [
                _death(r, p.exitcode, crash_logs[r])
                for r, p in enumerate(procs)
                if r not in results and r not in failed and r not in killed and p.exitcode != 0
            ]
    if init_failed:
        raise _InitFailed("\n".join(errors))
    if errors:
        raise RuntimeError(f"distributed run of {fn.__name__} failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _death(rank: int, exitcode: int | None, crash_log: str) -> str:
    """One rank's death without a report: its exit code or signal, and the traceback faulthandler left, if any."""
    if exitcode is None:
        how = "stopped"
    elif exitcode < 0:
        try:
            how = f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with exit code {exitcode}"
    try:
        with open(crash_log) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return f"rank {rank}:\nthe process {how} before reporting a result" + (f"\n{text}" if text else "")
