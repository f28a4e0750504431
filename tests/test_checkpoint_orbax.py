"""Orbax interop, both ways, bit for bit: orbax.checkpoint restores what functitan wrote (sharded, 2 writers),
and functitan restores what Orbax wrote (OCDBT/zarr2 PyTreeCheckpointer and StandardCheckpointer).

JAX runs in a subprocess: importing it into the pytest process is slow and brings its own warnings.
Expected values travel as raw bytes + a JSON index (no pickle).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

pytest.importorskip("orbax.checkpoint")

from functitan.checkpoint import restore, save_sync  # noqa: E402
from functitan.checkpoint._layout import as_numpy  # noqa: E402
from functitan.mesh import make_mesh  # noqa: E402
from functitan.testing import run_distributed  # noqa: E402

ORBAX = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np, ml_dtypes
    import jax, jax.numpy as jnp
    import orbax.checkpoint as ocp

    def flat(tree, prefix=""):
        if isinstance(tree, dict):
            items = tree.items()
        elif isinstance(tree, (list, tuple)):
            items = enumerate(tree)
        else:
            return {prefix[:-1]: tree}
        out = {}
        for k, v in items:
            out.update(flat(v, f"{prefix}{k}."))
        return out

    def load_expected(d):
        index = json.load(open(os.path.join(d, "index.json")))
        return {k: np.frombuffer(open(os.path.join(d, k), "rb").read(), dtype=v["dtype"]).reshape(v["shape"])
                for k, v in index.items()}

    mode, ck, exp = sys.argv[1:4]
    if mode == "read":
        want = load_expected(exp)
        report = {}
        for name, ckptr in (("pytree", ocp.PyTreeCheckpointer()), ("standard", ocp.StandardCheckpointer())):
            got = flat(ckptr.restore(ck))
            report[name] = {k: (np.asarray(got[k]).dtype == want[k].dtype and np.asarray(got[k]).shape == want[k].shape
                                and np.asarray(got[k]).tobytes() == want[k].tobytes()) for k in want}
            report[name + "_keys"] = sorted(got)
            report[name + "_types"] = {k: type(v).__name__ for k, v in got.items()}
        print(json.dumps(report))
    else:
        tree = {
            "params": {"w": (np.arange(30, dtype=np.float32).reshape(6, 5) - 7.5) / 3,
                       "emb": (np.arange(12).reshape(4, 3) / 7 - 0.6).astype(ml_dtypes.bfloat16)},
            "count": np.array(2**40 + 3, dtype=np.int64),
            "layers": [np.linspace(-1, 1, 5, dtype=np.float32)],
            "j": jnp.arange(8, dtype=jnp.float32) * 0.1,
            "step": 7,
            "lr": 0.125,
        }
        os.makedirs(exp)
        index = {}
        for k, v in flat(tree).items():
            a = np.asarray(v)
            index[k] = {"dtype": str(a.dtype), "shape": list(a.shape)}
            open(os.path.join(exp, k), "wb").write(a.tobytes())
        json.dump(index, open(os.path.join(exp, "index.json"), "w"))
        ocp.PyTreeCheckpointer().save(ck + "-pytree", tree)
        standard = ocp.StandardCheckpointer()  # asynchronous
        standard.save(ck + "-standard", tree)
        standard.wait_until_finished()
        print(json.dumps({"jax": jax.__version__}))
    """
)


def _orbax(*args: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", ORBAX, *args], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dump(named: dict[str, np.ndarray], d) -> None:
    os.makedirs(d)
    index = {}
    for k, a in named.items():
        index[k] = {"dtype": str(a.dtype), "shape": list(a.shape)}
        (d / k).write_bytes(np.ascontiguousarray(a).tobytes())
    (d / "index.json").write_text(json.dumps(index))


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
    params = {k: distribute_tensor(v, mesh, [Replicate(), Replicate(), pl[k], Replicate()], src_data_rank=None) for k, v in ref.items()}
    tree = {"params": params, "opt": [{"count": torch.tensor(5, dtype=torch.int64)}], "step": 11, "lr": 0.5, "flag": True}
    save_sync(path, tree)
    return 0


def test_orbax_restores_a_sharded_functitan_checkpoint_bit_for_bit(tmp_path):
    ck = str(tmp_path / "ck")
    run_distributed(_write_sharded, 2, ck)
    ref = _ref()
    want = {f"params.{k}": as_numpy(v) for k, v in ref.items()}
    want.update({"opt.0.count": np.array(5, np.int64), "step": np.array(11, np.int64), "lr": np.array(0.5), "flag": np.array(True)})
    _dump(want, tmp_path / "expected")
    report = _orbax("read", ck, str(tmp_path / "expected"))
    assert report["pytree"] == {k: True for k in want}
    assert report["standard"] == {k: True for k in want}
    assert report["pytree_types"]["step"] == "int" and report["pytree_types"]["params.emb"] == "ndarray"


def test_functitan_restores_orbax_checkpoints_bit_for_bit(tmp_path):
    versions = _orbax("write", str(tmp_path / "orbax"), str(tmp_path / "expected"))
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
        for name, t in (("params.w", got["params"]["w"]), ("params.emb", got["params"]["emb"]), ("count", got["count"]), ("layers.0", got["layers"][0]), ("j", got["j"])):
            raw = (tmp_path / "expected" / name).read_bytes()
            assert as_numpy(t).dtype == np.dtype(index[name]["dtype"]), (kind, name)
            assert as_numpy(t).tobytes() == raw, (kind, name, meta["use_ocdbt"], meta["use_zarr3"])
        assert got["count"].item() == 2**40 + 3
