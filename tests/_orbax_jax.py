"""The JAX side of the Orbax interop tests, run in a subprocess: ``python _orbax_jax.py MODE ARGS...``, or
``python _orbax_jax.py serve`` to answer many requests (one JSON list ``[MODE, *ARGS]`` per stdin line) with one
import of JAX (tests/conftest.py's ``orbax`` fixture keeps one such process for the session).

JAX is not imported into the pytest process (slow to import, brings its own warnings). Expected values travel
as raw bytes + a JSON index (``{name: {dtype, shape, scalar}}``, no pickle); the report is the last stdout line
(in serve mode, the line that starts with ``REPLY ``), as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp


def flat(tree: Any) -> dict[str, Any]:
    """``{dotted key path: leaf}``: dict keys, sequence indices and NamedTuple fields, as functitan names them."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
        out[".".join(map(str, names))] = leaf
    return out


def load_expected(d: str) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    index = json.load(open(os.path.join(d, "index.json")))
    arrays = {
        k: np.frombuffer(open(os.path.join(d, k), "rb").read(), dtype=v["dtype"]).reshape(v["shape"])
        for k, v in index.items()
    }
    return arrays, index


def dump_expected(tree: Any, d: str) -> None:
    os.makedirs(d)
    index = {}
    for k, v in flat(tree).items():
        a = np.asarray(v)
        index[k] = {"dtype": str(a.dtype), "shape": list(a.shape), "scalar": isinstance(v, (int, float))}
        open(os.path.join(d, k), "wb").write(a.tobytes())
    json.dump(index, open(os.path.join(d, "index.json"), "w"))


def same(got: Any, want: np.ndarray) -> bool:
    a = np.asarray(got)
    return a.dtype == want.dtype and a.shape == want.shape and a.tobytes() == want.tobytes()


def compare(got: Any, want: dict[str, np.ndarray]) -> dict[str, bool]:
    got = flat(got)
    return {k: k in got and same(got[k], want[k]) for k in sorted(set(want) | set(got))}


# ---------------------------------------------------------------------------------- a functitan checkpoint


def mode_read(ck: str, exp: str) -> dict:
    """A functitan checkpoint of a small tree, by PyTreeCheckpointer and StandardCheckpointer without target."""
    want, _ = load_expected(exp)
    report = {}
    for name, ckptr in (("pytree", ocp.PyTreeCheckpointer()), ("standard", ocp.StandardCheckpointer())):
        got = ckptr.restore(ck)
        report[name] = compare(got, want)
        report[name + "_types"] = {k: type(v).__name__ for k, v in flat(got).items()}
    return report


# The trainer's TrainState as a JAX user would declare it (optax's field names; NamedTuples are pytrees in JAX).
class ScaleByAdamState(NamedTuple):
    count: Any
    mu: Any
    nu: Any


class EmptyState(NamedTuple):
    pass


class ScaleByScheduleState(NamedTuple):
    count: Any


class TrainState(NamedTuple):
    step: Any
    params: Any
    opt_state: Any
    data_state: Any
    rng: Any


def nest(names: dict[str, Any]) -> dict:
    """``{"a.0.b": x}`` -> ``{"a": [{"b": x}]}`` (a level keyed 0..n-1 is a list)."""
    out: dict = {}
    for k, v in names.items():
        *head, last = k.split(".")
        d = out
        for h in head:
            d = d.setdefault(h, {})
        d[last] = v

    def lists(t: Any) -> Any:
        if not isinstance(t, dict):
            return t
        t = {k: lists(v) for k, v in t.items()}
        return [t[str(i)] for i in range(len(t))] if set(t) == {str(i) for i in range(len(t))} else t

    return lists(out)


def user_state(values: dict[str, Any]) -> TrainState:
    """The TrainState (adamw with a schedule) holding ``values`` ({dotted name: leaf})."""
    t = nest(values)
    o = t["opt_state"]
    opt = (ScaleByAdamState(**o["0"]), EmptyState(), ScaleByScheduleState(**o["2"]))  # no leaf under opt_state.1
    return TrainState(step=t["step"], params=t["params"], opt_state=opt, data_state=t["data_state"], rng=t["rng"])


def mode_trainer(root: str, step: str, exp: str) -> dict:
    """A run directory written by ``functitan train``, through each public restore entry point of Orbax."""
    jax.config.update("jax_enable_x64", True)  # int64 leaves (Adam's count) restore as int64 jax arrays
    want, index = load_expected(exp)
    item = os.path.join(root, step, "default")
    value = {k: (int(a) if index[k]["scalar"] else a) for k, a in want.items()}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # with a sharding: restored as jax arrays
    abstract = user_state(
        {k: v if isinstance(v, int) else jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in value.items()}
    )
    numpy_target = user_state({k: v if isinstance(v, int) else np.zeros_like(v) for k, v in value.items()})
    results = {
        "pytree": ocp.PyTreeCheckpointer().restore(item),
        "standard": ocp.StandardCheckpointer().restore(item),
        "standard_abstract": ocp.StandardCheckpointer().restore(item, abstract),
        "pytree_numpy_target": ocp.PyTreeCheckpointer().restore(
            item, item=numpy_target, restore_args=ocp.checkpoint_utils.construct_restore_args(numpy_target)
        ),
    }
    manager = ocp.CheckpointManager(root)
    steps = manager.all_steps()
    results["manager_abstract"] = manager.restore(int(step), args=ocp.args.StandardRestore(abstract))
    results["manager_pytree"] = ocp.CheckpointManager(root).restore(int(step), args=ocp.args.PyTreeRestore())
    report = {name: compare(got, want) for name, got in results.items()}
    report["steps"] = steps
    report["empty_node"] = {
        name: type(got[2][1] if isinstance(got, TrainState) else got["opt_state"][1]).__name__
        for name, got in results.items()
    }
    report["leaf_types"] = {
        name: sorted({type(v).__name__ for v in flat(got).values()}) for name, got in results.items()
    }
    return report


# ---------------------------------------------------------------------------------- Orbax checkpoints


def mode_write(ck: str, exp: str) -> dict:
    """A small tree (bf16, int64, a jax array, scalars) by PyTreeCheckpointer and StandardCheckpointer."""
    tree = {
        "params": {
            "w": (np.arange(30, dtype=np.float32).reshape(6, 5) - 7.5) / 3,
            "emb": (np.arange(12).reshape(4, 3) / 7 - 0.6).astype(ml_dtypes.bfloat16),
        },
        "count": np.array(2**40 + 3, dtype=np.int64),
        "layers": [np.linspace(-1, 1, 5, dtype=np.float32)],
        "j": jnp.arange(8, dtype=jnp.float32) * 0.1,
        "step": 7,
        "lr": 0.125,
    }
    dump_expected(tree, exp)
    ocp.PyTreeCheckpointer().save(ck + "-pytree", tree)
    standard = ocp.StandardCheckpointer()  # asynchronous
    standard.save(ck + "-standard", tree)
    standard.wait_until_finished()
    return {"jax": jax.__version__}


def optax_tree(dtype: str) -> dict:
    """An optax adamw (with a schedule) state after 2 updates, its params and empty nodes of every kind."""
    import optax

    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    key = jax.random.PRNGKey(0)
    params = {
        "embed": jax.random.normal(key, (16, 8), dt),
        "layers": [{"w": jax.random.normal(jax.random.fold_in(key, i), (8, 8), dt)} for i in range(2)],
    }
    opt = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1)
    state = opt.init(params)
    for i in range(2):
        grads = jax.tree.map(lambda p: jnp.cos(p * (i + 1)).astype(p.dtype), params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return {
        "step": 2,
        "params": params,
        "opt_state": state,
        "extras": {"no_dict": {}, "no_list": [], "no_tuple": (), "none": None},
    }


def mode_optax(out: str, exp: str, dtype: str) -> dict:
    """The optax-like tree with empty nodes by PyTreeCheckpointer, StandardCheckpointer and CheckpointManager."""
    import optax

    tree = optax_tree(dtype)
    dump_expected(tree, exp)
    ocp.PyTreeCheckpointer().save(os.path.join(out, "pytree"), tree)
    standard = ocp.StandardCheckpointer()
    standard.save(os.path.join(out, "standard"), tree)
    standard.wait_until_finished()
    manager = ocp.CheckpointManager(os.path.join(out, "manager"))
    manager.save(2, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()
    opt_types = [type(s).__name__ for s in tree["opt_state"]]
    return {"optax": optax.__version__, "opt_state_types": opt_types}


def mode_empties(ours: str, theirs: str) -> dict:
    """Orbax's own ``_METADATA`` for a tree with empty nodes of every kind, and Orbax reading functitan's."""

    class Empty(NamedTuple):
        pass

    tree = {
        "a": np.arange(3, dtype=np.float32),
        "opt": (np.zeros(2, np.int64), Empty(), ()),
        "seq": [np.ones(1, np.float32), [], {}, None, np.zeros(1, np.float32)],
        "d": {},
        "n": None,
    }
    ocp.PyTreeCheckpointer().save(theirs, tree)
    got = ocp.PyTreeCheckpointer().restore(ours)
    return {
        "metadata": json.load(open(os.path.join(theirs, "_METADATA")))["tree_metadata"],
        "restored": {
            "opt.1": repr(got["opt"][1]),
            "opt.2": repr(got["opt"][2]),
            "seq.1": repr(got["seq"][1]),
            "seq.2": repr(got["seq"][2]),
            "seq.3": repr(got["seq"][3]),
            "d": repr(got["d"]),
            "n": repr(got["n"]),
            "seq.4": np.asarray(got["seq"][4]).tolist(),
        },
    }


def serve() -> None:
    """One reply line per request line, until stdin closes; a failing request replies with its traceback."""
    import traceback

    for line in sys.stdin:
        mode, *args = json.loads(line)
        try:
            reply = {"ok": globals()[f"mode_{mode}"](*args)}
        except Exception:  # noqa: BLE001 - the test shows the JAX side's traceback
            reply = {"error": traceback.format_exc()}
        print("REPLY " + json.dumps(reply), flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "serve":
        serve()
    else:
        print(json.dumps(globals()[f"mode_{mode}"](*args)))
