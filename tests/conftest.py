"""Shared fixtures and the suite's time budget.

- ``gloo``: persistent gloo worker pools, one per world size, shared by every test of the session (tests/README.md
  says when to use it and when a test needs processes of its own).
- ``orbax``: the JAX + Orbax side of the interop tests, one process for the session.
- The budget: each test file's wall time (setup + call + teardown of its tests) is printed at the end of the run and
  checked against tests/budget.toml; a file over its budget fails the run, naming the file, its time and its budget.
"""

from __future__ import annotations

import os
import time
import tomllib
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import OrbaxSide

from functitan.testing import WorkerPool

BUDGET_FILE = Path(__file__).with_name("budget.toml")
pytest_plugins = ["pytester"]  # tests/test_budget.py runs the budget on a suite of its own


class Gloo:
    """One :class:`~functitan.testing.WorkerPool` per world size, started on first use and closed at the end of the
    session. ``gloo.run(fn, world_size, *args, **kwargs)`` is :func:`functitan.testing.run_distributed` without a
    process group per call."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def run(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, threads: int = 1, **kwargs
    ) -> list[Any]:
        return self._pool(world_size).run(fn, *args, timeout=timeout, threads=threads, **kwargs)

    def submit(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, threads: int = 1, **kwargs
    ) -> Callable[[], list[Any]]:
        """Start ``fn`` on the ranks and return; the returned function waits for the results (the test computes its
        reference meanwhile)."""
        return self._pool(world_size).submit(fn, *args, timeout=timeout, threads=threads, **kwargs)

    def _pool(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture(scope="session")
def gloo() -> Iterator[Gloo]:
    pools = Gloo()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture(scope="session")
def orbax() -> Iterator[OrbaxSide]:
    """The JAX + Orbax side of the interop tests (tests/_orbax_jax.py), one process for the session."""
    side = OrbaxSide()
    try:
        yield side
    finally:
        side.close()


# ---- the time budget ------------------------------------------------------------------------------------------


class _Budget:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: dict[str, float] = defaultdict(float)
        self.start = time.monotonic()
        with open(os.environ.get("FUNCTITAN_BUDGET_FILE", BUDGET_FILE), "rb") as f:
            budget = tomllib.load(f)
        self.files: dict[str, float] = budget["files"]
        self.total: float = budget["total"]
        self.default: float = budget["default"]
        # a loaded machine runs the same suite slower: FUNCTITAN_BUDGET_SCALE=2 doubles every budget
        self.scale = float(os.environ.get("FUNCTITAN_BUDGET_SCALE", "1"))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::")[0].removeprefix("tests/")] += report.duration

    def over(self) -> list[str]:
        over = [
            f"{name}: {secs:.0f} s, budget {self.files.get(name, self.default) * self.scale:.0f} s"
            for name, secs in sorted(self.seconds.items())
            if secs > self.files.get(name, self.default) * self.scale
        ]
        wall = time.monotonic() - self.start
        if self._whole_suite() and wall > self.total * self.scale:
            over.append(f"the whole suite: {wall:.0f} s, budget {self.total * self.scale:.0f} s")
        return over

    def _whole_suite(self) -> bool:
        tests = self.config.rootpath / "tests"
        ran_all = [Path(a).resolve() for a in self.config.args] in ([tests], [self.config.rootpath])
        return ran_all and not self.config.option.keyword and not self.config.option.markexpr

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        tr.section("wall time per test file (tests/budget.toml)")
        for name, secs in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            tr.write_line(f"{secs:8.1f} s  / {self.files.get(name, self.default) * self.scale:6.0f} s  {name}")
        tr.write_line(f"{sum(self.seconds.values()):8.1f} s  in tests, {time.monotonic() - self.start:.1f} s wall")
        for line in self.over():
            tr.write_line(f"over budget: {line}", red=True)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == 0 and self.over():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    # under pytest-xdist the controller sees every worker's reports: the budget is kept there, once
    if not config.getoption("--no-budget") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Budget(config), "functitan-budget")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-budget", action="store_true", help="do not check tests/budget.toml (profiling, bisecting)")
