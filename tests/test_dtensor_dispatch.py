"""No DTensor op is dispatched on the hot path: steps 2..n of the trainer, for every layout of the equivalence
matrix (tests/test_parallel.py) and a pipeline, with gradient accumulation, clipping and checkpoint staging on.

Why it matters: an op on DTensors pays sharding propagation, which took 150-240 s on the first step of a 4-D
mesh (gradient accumulation ran foreach ops on DTensor gradients). The count is exact: zero.
"""

import time

import torch
from support import LAYOUTS, train_small

from functitan import _dtensor as _dt

PIPELINE = {
    "parallelism.pp": 2,
    "parallelism.dp_shard": 2,
    "parallelism.pipeline_schedule": "zb_h1",
    "training.microbatches": 4,
}
STEPS = 3


def _counted_run(layouts: dict, run_dir: str) -> dict:
    """{layout: [(dtensor ops, their names, seconds) per step]} of the trainer, counting from step 2 on."""
    import functitan.train as T

    make_step, manager = T.make_train_step, T.CheckpointManager
    record: list = []

    def counting(fn, first_step: int):
        def counted(state, *args, **kwargs):
            t0 = time.perf_counter()
            if state.step == first_step:  # step 1 and the save after it may build DTensor's caches: not counted
                return fn(state, *args, **kwargs)
            with _dt.CountDTensorOps() as c:
                out = fn(state, *args, **kwargs)
            record.append((c.count, dict(c.ops), time.perf_counter() - t0))
            return out

        return counted

    class CountedManager(manager):
        def maybe_save(self, state, **kwargs):
            return counting(super().maybe_save, 1)(state, **kwargs)  # after step 1, state.step is 1

    T.make_train_step = lambda *a, **k: counting(make_step(*a, **k), 0)
    T.CheckpointManager = CountedManager
    out = {}
    try:
        for name, layout in layouts.items():
            record.clear()
            ckpt = {} if "parallelism.pp" in layout else {"checkpoint.enable": True, "checkpoint.interval": 1}
            train_small(
                {
                    "training.microbatches": 2,
                    "optimizer.max_norm": 1.0,
                    "training.steps": STEPS,
                    **layout,
                    **ckpt,
                    "metrics.run_dir": run_dir,
                    "metrics.run_name": name,
                }
            )
            out[name] = list(record)
    finally:
        T.make_train_step, T.CheckpointManager = make_step, manager
    return out


def test_no_dtensor_dispatch_after_the_first_step(tmp_path, gloo):
    results = gloo.run(_counted_run, 4, {**LAYOUTS, "pp2_fsdp2_zb": PIPELINE}, str(tmp_path), timeout=600)
    for rank, per_layout in enumerate(results):
        assert per_layout.keys() == {*LAYOUTS, "pp2_fsdp2_zb"}
        for name, steps in per_layout.items():
            saves = 0 if name.startswith("pp") else STEPS - 1
            assert len(steps) == STEPS - 1 + saves, (name, steps)  # steps 2..n, and their checkpoint saves
            for count, ops, _ in steps:
                assert count == 0, f"rank {rank} {name}: {count} DTensor ops dispatched: {ops}"


def test_counter_sees_dtensor_ops_and_the_shim_round_trips(gloo):
    results = gloo.run(_shim_round_trip, 1)
    assert results[0] == (1, {"aten.add.Tensor": 1}, 0, True)


def _shim_round_trip():
    from torch.distributed.tensor import Shard, distribute_tensor

    from functitan.mesh import make_mesh

    mesh = make_mesh(dp_shard=1)
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)] * mesh.ndim)
    with _dt.CountDTensorOps() as c:
        y = x + 1  # one DTensor op
    with _dt.CountDTensorOps() as c2:
        z = _dt.wrap(_dt.local(y) * 2, _dt.spec(y))  # local math: none
    same = (
        type(z) is _dt.DTensor
        and z.placements == x.placements
        and torch.equal(z.full_tensor(), (torch.arange(4.0) + 1) * 2)
    )
    return c.count, dict(c.ops), c2.count, same
