"""What several test files share: the small trainer run every equivalence test compares, tiny model flavors.

Test files import from here (``from support import SMALL, train_small``), never from each other; the fixtures that
hold processes or files live in conftest.py.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import torch

from functitan import cli as _cli
from functitan.config import apply_overrides
from functitan.job_config import JobConfig
from functitan.train import run
from functitan.tree import flatten_with_names
from models import llama

# the tiny flavors the unit tests share (2 layers, GQA 4/2 heads, milliseconds a step)
TINY_LLAMA = llama.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
# the planner's tests: llama debug overridden to 4 layers x 64 wide, traced at world 4
PLAN_TINY = {"dim": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 128}

# the trainer on one process as small as it gets, as `functitan train` flags (in-process: `functitan.cli.main`)
TINY_FLAGS = (
    "--model.n_layers=1",
    "--model.dim=32",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--model.ffn_dim=64",
    "--training.batch_size=2",
    "--training.seq_len=16",
    "--data.max_corpus_bytes=100000",
)

SMALL = {
    "model.n_layers": 2,
    "model.dim": 64,
    "model.n_heads": 8,
    "model.n_kv_heads": 4,
    "model.ffn_dim": 128,
    "training.steps": 5,
    "training.batch_size": 8,
    "training.seq_len": 32,
    "optimizer.lr": 1e-2,
    "optimizer.warmup_steps": 2,
    "metrics.log_every": 1,
    "data.max_corpus_bytes": 400_000,
    # AdamW divides by sqrt(v) + eps: with the default 1e-8, the rounding noise of a near-zero gradient (a
    # token that appears once) becomes a full-size update. 1e-6 keeps the comparison about the layout.
    "optimizer.eps": 1e-6,
}


def train_small(overrides: dict, base: dict = SMALL):
    """The trainer on ``base`` (SMALL) plus ``overrides``; every rank returns (rank 0's logged losses, the params
    as full tensors, the data state)."""
    out = run(apply_overrides(JobConfig(), {**base, **overrides}))
    losses = None
    if torch.distributed.get_rank() == 0:
        with open(f"{out['run_dir']}/metrics.jsonl") as f:
            losses = [json.loads(line)["loss"] for line in f]
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        for n, p in flatten_with_names(out["state"].params)[0]
    }
    return losses, params, out["state"].data_state


# equivalence layouts of the trainer at world 4 (tests/test_parallel.py, tests/test_dtensor_dispatch.py)
LAYOUTS = {
    "ddp4": {"parallelism.dp_replicate": 4, "parallelism.dp_shard": 1},
    "fsdp4": {"parallelism.dp_shard": 4},
    "hsdp2x2": {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 2},
    "fsdp2_tp2": {"parallelism.dp_shard": 2, "parallelism.tp": 2, "parallelism.sequence_parallel": False},
    "tp4_sp": {"parallelism.dp_shard": 1, "parallelism.tp": 4, "parallelism.sequence_parallel": True},
    "cp2_fsdp2": {"parallelism.cp": 2, "parallelism.dp_shard": 2},
}


class Crash(Exception):
    pass


@contextlib.contextmanager
def crashing_at_step(step: int | None) -> Iterator[None]:
    """Inside the block, the trainer's step raises Crash once ``step`` steps are done (None: no crash); the trainer
    is put back on exit, since a pool rank runs the next test's function in the same process."""
    import functitan.train as train_module

    make = train_module.make_train_step

    def crashing(*args, **kwargs):
        train_step = make(*args, **kwargs)

        def step_fn(state, batch, **kwargs):
            if state.step == step:
                raise Crash(f"simulated crash after step {step}")
            return train_step(state, batch, **kwargs)

        return step_fn

    if step is not None:
        train_module.make_train_step = crashing
    try:
        yield
    finally:
        train_module.make_train_step = make


JAX_SIDE = os.path.join(os.path.dirname(__file__), "_orbax_jax.py")


class OrbaxSide:
    """tests/_orbax_jax.py in serve mode: one process (one import of JAX) answers every Orbax request of a session.
    ``side("read", ckpt, expected)`` returns that mode's JSON report."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def __call__(self, *args: str) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}
            cmd = [sys.executable, JAX_SIDE, "serve"]
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(list(args)) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith("REPLY "):
                reply = json.loads(line[len("REPLY ") :])
                assert "error" not in reply, reply.get("error")
                return reply["ok"]
        raise AssertionError(f"the JAX side exited with {self._proc.wait()} before answering {args}")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc.stdout.close()  # type: ignore[union-attr]
            self._proc = None


def dump_arrays(named: dict[str, np.ndarray], d, scalars: tuple[str, ...] = ()) -> None:
    """Raw bytes + index.json of ``named`` in folder ``d``: what the JAX side compares against."""
    os.makedirs(d)
    index = {}
    for k, a in named.items():
        index[k] = {"dtype": str(a.dtype), "shape": list(a.shape), "scalar": k in scalars}
        (d / k).write_bytes(np.ascontiguousarray(a).tobytes())
    (d / "index.json").write_text(json.dumps(index))


def cli(*args: str) -> subprocess.CompletedProcess:
    """``functitan *args`` in this process, as a test of messages and parsing wants it: the exit code (argparse's
    SystemExit included), stdout and stderr, shaped like ``subprocess.run``'s result. Only for commands that stop
    before any process group or training starts; what a process does (torchrun, signals) needs a subprocess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = _cli.main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return subprocess.CompletedProcess(["functitan", *args], code, out.getvalue(), err.getvalue())


def merged_ranks(ranks: list[dict]) -> dict:
    """``functitan.model._gradcheck._worker``'s per-rank results as one: rank 0's, with each pipeline rank's
    params (its stages') added; the other ranks of a layout without pp hold none (None)."""
    out = dict(ranks[0])
    for lname, (losses, grads, change) in ranks[0].items():
        if losses is None:
            continue
        for other in ranks[1:]:
            _, g, c = other[lname]
            if g is not None:
                grads, change = {**grads, **g}, {**change, **c}
        out[lname] = (losses, grads, change)
    return out
