"""Run a function on N local processes over gloo (loopback): the harness for distributed tests and benchmarks.

Every distributed test in functitan compares N processes against a single-process reference computed in the
same test; this module starts the N processes. Processes come from a forkserver that has imported torch once,
so each start costs a fork, not a fresh interpreter.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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

__all__ = ["run_distributed", "free_port", "WorkerPool"]


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
    import torch.distributed as dist

    failed = _join(rank, world_size, port, threads, crash_log)
    if failed:  # a lost rendezvous (a port taken meanwhile): the parent retries
        queue.put((rank, "init", failed))
        return
    try:
        # plain pickle: torch's queue reducer would pass tensors as shared-memory fds, which die with the worker
        queue.put((rank, "ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the worker's traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(rank: int, world_size: int, port: int, threads: int, crash_log: str) -> str | None:
    """Set up a worker process and join the gloo group; the traceback if the rendezvous failed, else None."""
    import torch
    import torch.distributed as dist

    # a crash that skips Python's handlers (a signal, a fatal error) leaves its traceback here for the parent
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
    except BaseException:  # noqa: BLE001 - the caller reports it; the parent retries
        return traceback.format_exc()
    return None


INIT_ATTEMPTS = 3
# Threads a pool rank may gain over its life before it retires. A destroyed gloo group can outlive its call in
# C++ (2 pt_gloo_runloop + 1 gloo_tcp_loop threads each); idle tcp loops still wake, so a rank that had gathered
# 67 of them by a quarter of the suite used 7% of a core doing nothing, and the suite's process-lifetime tests
# (elastic membership, kills) starved behind six such ranks on a loaded 2-core machine. Not lower: a call that
# builds a few six-axis meshes leaves 15-18 threads per mesh (every axis has its groups, size 1 or not), and a
# limit of 24 retired a 4-rank pool every second call: test_parallel.py took 72 s against 59 s at 96 and 45 s
# with no limit (2026-12-06, quiet).
POOL_THREADS_GROWTH = 96
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


# What the forkserver imports once, before it forks the ranks (run_distributed's and the pools'): each rank started
# without them imported torch's compiler on its first autograd call (1.5 s), ml_dtypes on its first checkpoint
# (0.8 s) and functitan's trainer with DTensor (1 s) on its own, CPU-seconds per rank that every test starting
# ranks paid again (measured on 2 cores, torch 2.13). A module that fails to import is skipped (multiprocessing).
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "ml_dtypes", "functitan.train")


class _InitFailed(Exception):
    pass


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float, threads: int
) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
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


class WorkerPool:
    """``world_size`` gloo processes that stay up between calls: the harness for tests about numbers.

    :func:`run_distributed` starts a process group per call (a fork per rank, a rendezvous, a teardown: about a
    second on 2 cores, most of it waiting). A pool forms its group once, then each :meth:`run` sends the function
    to every rank and waits for the results, so a call costs what the function costs. Between calls each rank puts
    back what a function may have changed: the environment, the working directory, the thread count, the RNG seed,
    the default dtype, grad mode, torch.compile's caches, and every process group but the default one. A call that
    fails on any rank, hangs, or loses a rank closes the pool (its group may be mid-collective); the next call
    starts a new one. Tests of process lifetime (signals, kills, launchers) keep using :func:`run_distributed`.

    Example::

        with WorkerPool(2) as pool:
            pool.run(_allreduce_rank)  # [(0, 3.0), (1, 3.0)]: one result per rank, in rank order
    """

    def __init__(self, world_size: int, *, threads: int = 1) -> None:
        self.world_size = world_size
        self.threads = threads
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._queue: Any = None
        self._logs: tempfile.TemporaryDirectory | None = None
        self._calls = 0
        self._waiting: str | None = None  # the function submitted and not yet waited for

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, threads: int | None = None, **kwargs: Any
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the per-rank results in rank order (as :func:`run_distributed`)."""
        return self.submit(fn, *args, timeout=timeout, threads=threads, **kwargs)()

    def submit(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, threads: int | None = None, **kwargs: Any
    ) -> Callable[[], list[Any]]:
        """Send ``fn`` to every rank and return at once; calling the returned function waits for the results.

        The caller computes meanwhile (a test's single-process reference beside the ranks' run); one call at a
        time: wait for one before submitting the next."""
        if self._waiting:
            raise RuntimeError(f"{self._waiting} was submitted to this pool and not waited for; call its result first")
        if not self._procs:
            self._start()
        self._calls += 1
        call = self._calls
        task = pickle.dumps((call, fn, args, kwargs, self.threads if threads is None else threads))
        try:
            for conn in self._conns:
                conn.send_bytes(task)
        except BaseException:
            self.close(kill=True)
            raise
        self._waiting = fn.__name__
        deadline = time.monotonic() + timeout

        def result() -> list[Any]:
            try:
                results, errors, retired = self._collect(fn.__name__, call, timeout, deadline)
            except BaseException:
                self.close(kill=True)
                raise
            finally:
                self._waiting = None
            if errors:
                self.close(kill=True)
                raise RuntimeError(f"distributed run of {fn.__name__} failed on " + "\n".join(errors))
            if retired:
                self.close()
            return [results[r] for r in range(self.world_size)]

        return result

    def _collect(self, name: str, call: int, timeout: float, deadline: float) -> tuple[dict[int, Any], list[str], bool]:
        """``(results by rank, errors, whether a rank retired)`` of one call, due by ``deadline``."""
        results: dict[int, Any] = {}
        errors: list[str] = []
        retired = False
        reported: set[int] = set()
        grace: float | None = None  # after one rank fails, how long the others get to report
        while len(results) + len(errors) < self.world_size:
            try:
                rank, got, status, value, retire = self._queue.get(timeout=POLL_S)
            except queue_mod.Empty:
                died = [r for r, p in enumerate(self._procs) if p.exitcode is not None and r not in reported]
                if died:
                    errors[:0] = [_death(r, self._procs[r].exitcode, self._crash_log(r)) for r in died]
                    break
                now = time.monotonic()
                if grace is not None and now > grace:
                    break  # the others wait in a collective for the failed rank
                if now > deadline:
                    raise RuntimeError(f"distributed run of {name} timed out after {timeout}s") from None
                continue
            if got != call:
                continue  # a late report of a call that already failed
            retired = retired or retire
            reported.add(rank)
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                grace = grace or time.monotonic() + 2.0
        return results, errors, retired

    def _crash_log(self, rank: int) -> str:
        if self._logs is None:
            raise RuntimeError("the pool is closed: its ranks have no crash logs")
        return os.path.join(self._logs.name, f"rank{rank}.crash")

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        for attempt in range(INIT_ATTEMPTS):
            self._logs = tempfile.TemporaryDirectory(prefix="functitan-pool-")
            self._queue = ctx.Queue()
            port = free_port()
            pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]
            self._conns = [send for _, send in pipes]
            self._procs = [
                ctx.Process(
                    target=_pool_worker,
                    args=(r, self.world_size, port, pipes[r][0], self._queue, self.threads, self._crash_log(r)),
                    daemon=True,
                )
                for r in range(self.world_size)
            ]
            for p in self._procs:
                p.start()
            for recv, _ in pipes:
                recv.close()  # the worker holds its own end: when this process dies, the worker reads EOF and exits
            _, errors, _ = self._collect("the pool's start", 0, 120.0, time.monotonic() + 120.0)
            if not errors:
                return
            self.close(kill=True)
            if attempt == INIT_ATTEMPTS - 1:
                raise RuntimeError(f"a pool of {self.world_size} gloo processes did not start:\n" + "\n".join(errors))

    def close(self, *, kill: bool = False) -> None:
        """Stop every rank: they exit when their pipe closes; ``kill`` (after a failure, when a rank may be stuck in
        a collective) or a rank still up after 2 s is killed."""
        for conn in self._conns:
            conn.close()
        deadline = time.monotonic() + (0 if kill else 2)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        if self._queue is not None:
            self._queue.close()
        if self._logs is not None:
            self._logs.cleanup()
        self._procs, self._conns, self._queue, self._logs = [], [], None, None


def _pool_worker(rank: int, world_size: int, port: int, tasks: Any, queue: Any, threads: int, crash_log: str) -> None:
    import torch
    import torch.distributed as dist

    failed = _join(rank, world_size, port, threads, crash_log)
    if failed:  # a lost rendezvous: the parent starts the pool again on another port
        queue.put((rank, 0, "init", failed, True))
        return
    queue.put((rank, 0, "ok", pickle.dumps(None), False))
    seed, environ, cwd = torch.initial_seed(), dict(os.environ), os.getcwd()
    threads_at_start = _thread_count()
    while True:
        try:
            call, fn, args, kwargs, task_threads = pickle.loads(tasks.recv_bytes())
        except EOFError:  # the pool closed, or the process that owns it died
            break
        torch.set_num_threads(task_threads)
        torch.manual_seed(seed)
        report: tuple[int, int, str, bytes | str]
        try:
            report = (rank, call, "ok", pickle.dumps(fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the parent re-raises with the worker's traceback
            report = (rank, call, "error", traceback.format_exc())
        # a function that destroyed the default group (a CLI's main does) leaves this rank nothing to run on, one
        # that patched the library with its own code (a test's crash injection left in place) would change the
        # next test's, and threads of groups that did not die with their call (POOL_THREADS_GROWTH) burn CPU:
        # the rank says so with its report, and the pool starts anew for the next call
        retire = not dist.is_initialized() or _library_patched()
        if not retire:
            _reset(environ, cwd)
            retire = _thread_count() > threads_at_start + POOL_THREADS_GROWTH  # leaked groups: start afresh
        queue.put((*report, retire))
        if retire:
            return
    dist.destroy_process_group()


def _reset(environ: dict[str, str], cwd: str) -> None:
    """Put back what one call may have changed in a pool rank, so the next call finds a fresh process."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    _malloc_trim()
    default = c10d._world.default_pg
    for pg in list(c10d._world.pg_map):
        if pg is not default:
            dist.destroy_process_group(pg)


def _thread_count() -> int:
    """This process's threads (Linux; 0 where /proc is missing, so nothing retires)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return 0


def _malloc_trim() -> None:
    """Hand the heap a call freed back to the system (glibc; the trainer asks malloc to keep freed memory)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _library_patched() -> bool:
    """Whether a module of functitan or models now holds a function or class defined outside the installed code
    (a test's, a script's): a monkeypatch that was not undone."""
    import sys
    import sysconfig

    installed = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    files = [getattr(sys.modules.get(name), "__file__", None) for name in ("functitan", "models")]
    roots = tuple(os.path.dirname(f) + os.sep for f in files if f)
    for name, module in list(sys.modules.items()):
        if not name.startswith(("functitan.", "models.")):
            continue
        for value in list(vars(module).values()):
            owner = sys.modules.get(getattr(value, "__module__", None) or "")
            where = getattr(owner, "__file__", None)
            if callable(value) and where and not where.startswith(installed) and not where.startswith(roots):
                return True
    return False
