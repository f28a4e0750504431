"""Orbax interop, both ways, bit for bit, through the paths users take.

* orbax.checkpoint restores what ``functitan train`` wrote (FSDP on 2 processes, adamw, whose state holds an
  empty ``EmptyState()``), fp32 and bf16, with every public entry point: Py/StandardCheckpointer without a
  target, with an abstract target and with a numpy target, and CheckpointManager.
* functitan restores what Orbax wrote: a small tree, and an optax adamw state (empty nodes of every kind),
  fp32 and bf16, from PyTreeCheckpointer, StandardCheckpointer and CheckpointManager directories.
* functitan's ``_METADATA`` for empty nodes is the one Orbax writes for the same tree.

JAX runs in a subprocess (tests/_orbax_jax.py): importing it into the pytest process is slow and brings its
own warnings. Expected values travel as raw bytes + a JSON index (no pickle).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

pytest.importorskip("orbax.checkpoint")

import optree  # noqa: E402
from support import dump_arrays  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from functitan import optim  # noqa: E402
from functitan.checkpoint import CheckpointManager, restore, save_sync  # noqa: E402
from functitan.checkpoint._layout import as_numpy  # noqa: E402
from functitan.mesh import make_mesh  # noqa: E402


def _ref():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(9, 5, generator=g),  # uneven over 2 writers
        "emb": torch.randn(4, 6, generator=g).bfloat16(),
        "rep": torch.randn(3, generator=g),
    }


def _write_sharded(path: str) -> int:
    mesh = make_mesh(device="cpu")
    ref = _ref()
    pl = {"w": Shard(0), "emb": Shard(1), "rep": Replicate()}
    params = {
        k: distribute_tensor(
            v, mesh, [Replicate(), Replicate(), pl[k], Replicate(), Replicate(), Replicate()], src_data_rank=None
        )
        for k, v in ref.items()
    }
    tree = {
        "params": params,
        "opt": [{"count": torch.tensor(5, dtype=torch.int64)}],
        "step": 11,
        "lr": 0.5,
        "flag": True,
    }
    save_sync(path, tree)
    return 0


def test_orbax_restores_a_sharded_functitan_checkpoint_bit_for_bit(tmp_path, gloo, orbax):
    ck = str(tmp_path / "ck")
    gloo.run(_write_sharded, 2, ck)
    ref = _ref()
    want = {f"params.{k}": as_numpy(v) for k, v in ref.items()}
    want.update(
        {
            "opt.0.count": np.array(5, np.int64),
            "step": np.array(11, np.int64),
            "lr": np.array(0.5),
            "flag": np.array(True),
        }
    )
    dump_arrays(want, tmp_path / "expected")
    report = orbax("read", ck, str(tmp_path / "expected"))
    assert report["pytree"] == {k: True for k in want}
    assert report["standard"] == {k: True for k in want}
    assert report["pytree_types"]["step"] == "int" and report["pytree_types"]["params.emb"] == "ndarray"


def test_functitan_restores_orbax_checkpoints_bit_for_bit(tmp_path, orbax):
    versions = orbax("write", str(tmp_path / "orbax"), str(tmp_path / "expected"))
    assert versions["jax"]
    index = json.loads((tmp_path / "expected" / "index.json").read_text())
    exemplar = {
        "params": {"w": torch.zeros(6, 5), "emb": torch.zeros(4, 3, dtype=torch.bfloat16)},
        "count": torch.tensor(0, dtype=torch.int64),
        "layers": [torch.zeros(5)],
        "j": torch.zeros(8),
        "step": 0,
        "lr": 0.0,
    }
    for kind in ("pytree", "standard"):
        path = tmp_path / f"orbax-{kind}"
        meta = json.loads((path / "_METADATA").read_text())
        got = restore(path, exemplar)
        assert got["step"] == 7 and isinstance(got["step"], int) and got["lr"] == 0.125
        for name, t in (
            ("params.w", got["params"]["w"]),
            ("params.emb", got["params"]["emb"]),
            ("count", got["count"]),
            ("layers.0", got["layers"][0]),
            ("j", got["j"]),
        ):
            raw = (tmp_path / "expected" / name).read_bytes()
            assert as_numpy(t).dtype == np.dtype(index[name]["dtype"]), (kind, name)
            assert as_numpy(t).tobytes() == raw, (kind, name, meta["use_ocdbt"], meta["use_zarr3"])
        assert got["count"].item() == 2**40 + 3


# ----------------------------------------------------------------------------------- the trainer's checkpoints


def _bf16(tree):
    return optree.tree_map(
        lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


def _train_fsdp2_and_dump(root: str) -> None:
    """``functitan train`` with FSDP on 2 processes and checkpoints; then the same TrainState cast to bf16, saved
    by a CheckpointManager on the same ranks. Rank 0 dumps both states (full values) as the expected values."""

    sys.path.insert(0, os.path.dirname(__file__))
    from support import SMALL

    from functitan.config import apply_overrides
    from functitan.job_config import JobConfig
    from functitan.train import run
    from functitan.tree import flatten_with_names

    cfg = apply_overrides(
        JobConfig(),
        {
            **SMALL,
            "parallelism.dp_shard": 2,
            "training.steps": 2,
            "checkpoint.enable": True,
            "checkpoint.interval": 2,
            "metrics.run_dir": root,
            "metrics.run_name": "fp32",
        },
    )
    state = run(cfg)["state"]
    bf16 = state._replace(params=_bf16(state.params), opt_state=_bf16(state.opt_state))
    with CheckpointManager(f"{root}/bf16/checkpoints", interval=2, keep_last=1) as mgr:
        mgr.maybe_save(bf16)
    for tag, s in (("fp32", state), ("bf16", bf16)):
        named = [(n, x.full_tensor() if isinstance(x, DTensor) else x) for n, x in flatten_with_names(s)[0]]
        if torch.distributed.get_rank() == 0:
            want = {
                n: as_numpy(x.detach()) if isinstance(x, torch.Tensor) else np.asarray(x, np.int64) for n, x in named
            }
            dump_arrays(want, Path(root) / f"expected-{tag}", scalars=tuple(n for n, x in named if isinstance(x, int)))


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory, gloo):
    root = tmp_path_factory.mktemp("trainer")
    gloo.run(_train_fsdp2_and_dump, 2, str(root))
    return root


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_orbax_restores_the_trainers_fsdp_checkpoint_bit_for_bit(trainer_run, dtype, orbax):
    index = json.loads((trainer_run / f"expected-{dtype}" / "index.json").read_text())
    assert "opt_state.0.mu.layers.0.attn.wq" in index and "opt_state.2.count" in index  # the adamw chain's state
    assert {v["dtype"] for k, v in index.items() if k.startswith("params.")} == {
        "float32" if dtype == "fp32" else "bfloat16"
    }
    meta = json.loads((trainer_run / dtype / "checkpoints" / "2" / "default" / "_METADATA").read_text())
    assert meta["tree_metadata"]["('opt_state', '1')"]["value_metadata"] == {
        "value_type": "None",
        "skip_deserialize": True,
    }
    report = orbax("trainer", str(trainer_run / dtype / "checkpoints"), "2", str(trainer_run / f"expected-{dtype}"))
    methods = ["pytree", "standard", "standard_abstract", "pytree_numpy_target", "manager_abstract", "manager_pytree"]
    for method in methods:
        assert report[method] == {k: True for k in index}, method  # every leaf, and no other, bit for bit
    assert report["steps"] == [2]
    # EmptyState() comes back as None without a target, and as the target's own type with one
    assert report["empty_node"] == {
        "pytree": "NoneType",
        "standard": "NoneType",
        "standard_abstract": "EmptyState",
        "pytree_numpy_target": "EmptyState",
        "manager_abstract": "EmptyState",
        "manager_pytree": "NoneType",
    }
    assert report["leaf_types"]["pytree_numpy_target"] == ["int", "ndarray"]
    assert report["leaf_types"]["standard_abstract"] == ["ArrayImpl", "int"]


def _train_moe_ep2_and_dump(root: str) -> None:
    """``functitan train`` of the tiny Qwen3-MoE under expert parallelism (ep 2: each rank holds half of every
    layer's routed experts) with a checkpoint at step 2; rank 0 dumps the state's full values."""
    from functitan.config import apply_overrides
    from functitan.job_config import JobConfig
    from functitan.train import run
    from functitan.tree import flatten_with_names

    cfg = apply_overrides(
        JobConfig(),
        {
            "model.name": "qwen3_moe",
            "model.flavor": "debug",
            "parallelism.dp_shard": 2,
            "parallelism.ep": 2,
            "training.steps": 2,
            "training.batch_size": 4,
            "training.seq_len": 16,
            "data.max_corpus_bytes": 50_000,
            "checkpoint.enable": True,
            "checkpoint.interval": 2,
            "metrics.run_dir": root,
            "metrics.run_name": "moe",
        },
    )
    state = run(cfg)["state"]
    named = [(n, x.full_tensor() if isinstance(x, DTensor) else x) for n, x in flatten_with_names(state)[0]]
    experts = [x for n, x in flatten_with_names(state.params)[0] if n.endswith("moe.experts.w_gate")]
    assert experts and all(x.to_local().shape[0] * 2 == x.shape[0] for x in experts)  # half the experts a rank
    if torch.distributed.get_rank() == 0:
        want = {n: as_numpy(x.detach()) if isinstance(x, torch.Tensor) else np.asarray(x, np.int64) for n, x in named}
        dump_arrays(want, Path(root) / "expected", scalars=tuple(n for n, x in named if isinstance(x, int)))


def test_orbax_restores_an_expert_parallel_moe_checkpoint_bit_for_bit(tmp_path, gloo, orbax):
    gloo.run(_train_moe_ep2_and_dump, 2, str(tmp_path))
    index = json.loads((tmp_path / "expected" / "index.json").read_text())
    w_gate = "params.layers.0.moe.experts.w_gate"
    assert index[w_gate]["shape"][0] == 8 and "opt_state.0.nu.layers.1.moe.router.weight" in index  # every expert
    report = orbax("trainer", str(tmp_path / "moe" / "checkpoints"), "2", str(tmp_path / "expected"))
    for method in ("pytree", "standard", "standard_abstract", "manager_abstract"):
        assert report[method] == {k: True for k in index}, method  # every leaf, and no other, bit for bit
    assert report["steps"] == [2]


# ----------------------------------------------------------------------------------- Orbax's optax checkpoints


def _optax_exemplar(dtype: torch.dtype):
    params = {
        "embed": torch.zeros(16, 8, dtype=dtype),
        "layers": [{"w": torch.zeros(8, 8, dtype=dtype)} for _ in range(2)],
    }
    opt = optim.adamw(optim.warmup_linear(1e-2, 0, 10, final=1e-3), weight_decay=0.1)
    # optax counts are int32 (functitan's int64): the exemplar says which dtype to build (see docs/checkpoints.md)
    opt_state = optree.tree_map(lambda x: x.int() if x.dtype == torch.int64 else x, opt.init(params))
    extras = {"no_dict": {}, "no_list": [], "no_tuple": (), "none": None}
    return opt, {"step": 0, "params": params, "opt_state": opt_state, "extras": extras}


@pytest.mark.skipif(importlib.util.find_spec("optax") is None, reason="optax is not installed (the orbax extra)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_functitan_restores_an_orbax_optax_state_with_empty_nodes(tmp_path, dtype, orbax):
    from functitan.tree import flatten_with_names

    report = orbax("optax", str(tmp_path / "orbax"), str(tmp_path / "expected"), dtype)
    assert report["opt_state_types"] == ["ScaleByAdamState", "EmptyState", "ScaleByScheduleState"]
    index = json.loads((tmp_path / "expected" / "index.json").read_text())
    opt, exemplar = _optax_exemplar(getattr(torch, dtype))
    paths = {"pytree": tmp_path / "orbax" / "pytree", "standard": tmp_path / "orbax" / "standard"}
    restored = {k: restore(p, exemplar) for k, p in paths.items()}
    manager = CheckpointManager(tmp_path / "orbax" / "manager", interval=1, keep_last=1)
    assert manager.all_steps() == [2]
    restored["manager"] = manager.restore_latest(exemplar)
    manager.close()
    for kind, got in restored.items():
        named = dict(flatten_with_names(got)[0])
        assert sorted(named) == sorted(index), kind
        for name, x in named.items():
            raw = (tmp_path / "expected" / name).read_bytes()
            a = as_numpy(x) if isinstance(x, torch.Tensor) else np.asarray(x, np.int64)
            assert a.dtype == np.dtype(index[name]["dtype"]) and a.tobytes() == raw, (kind, name)
        assert type(got["opt_state"][0]).__name__ == "ScaleByAdamState" and got["opt_state"][1] == optim.EmptyState()
        assert got["extras"] == {"no_dict": {}, "no_list": [], "no_tuple": (), "none": None}
        assert got["step"] == 2 and int(got["opt_state"][0].count) == 2
    # the restored optax state drives functitan's adamw on
    got = restored["manager"]
    _, new_state = opt.update(optree.tree_map(torch.ones_like, got["params"]), got["opt_state"], got["params"])
    assert int(new_state[0].count) == 3 and int(new_state[2].count) == 3


# ----------------------------------------------------------------------------------- empty nodes, as Orbax writes them


class _Empty(NamedTuple):
    pass


def test_empty_nodes_metadata_is_what_orbax_writes(tmp_path, orbax):
    tree = {
        "a": np.arange(3, dtype=np.float32),
        "opt": (np.zeros(2, np.int64), _Empty(), ()),
        "seq": [np.ones(1, np.float32), [], {}, None, np.zeros(1, np.float32)],
        "d": {},
        "n": None,
    }
    save_sync(tmp_path / "ours", tree)
    report = orbax("empties", str(tmp_path / "ours"), str(tmp_path / "theirs"))
    ours = json.loads((tmp_path / "ours" / "_METADATA").read_text())["tree_metadata"]
    assert ours == report["metadata"]  # entry for entry: keys, key types, value types, skip_deserialize
    assert report["restored"] == {
        "opt.1": "None",
        "opt.2": "()",
        "seq.1": "[]",
        "seq.2": "{}",
        "seq.3": "None",
        "d": "{}",
        "n": "None",
        "seq.4": [0.0],
    }
    got = restore(tmp_path / "ours", tree)
    assert got["opt"][1] == _Empty() and got["seq"][1:4] == [[], {}, None] and got["d"] == {} and got["n"] is None
    np.testing.assert_array_equal(got["seq"][4], tree["seq"][4])
