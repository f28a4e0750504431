"""Checkpoints under pipeline parallelism: every stage writes its leaves under the whole model's key paths,
so a pipelined run resumes bit for bit, and any layout (pp, FSDP, none) restores it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import train_small

ROOT = Path(__file__).resolve().parents[1]
CKPT = {"checkpoint.enable": True, "checkpoint.interval": 3, "checkpoint.keep_last": 3, "training.steps": 6}
PP2 = {
    "parallelism.pp": 2,
    "parallelism.dp_shard": 1,
    "parallelism.pipeline_schedule": "1f1b",
    "training.microbatches": 2,
}


def _losses(run_dir) -> dict[int, float]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _run(layout: dict, root: str, name: str):
    """One run; every rank returns (its params as full tensors, the data state)."""
    _, params, data_state = train_small({**layout, **CKPT, "metrics.run_dir": root, "metrics.run_name": name})
    return params, data_state


def _crash_then_resume(layout: dict, root: str):
    import contextlib

    from support import Crash, crashing_at_step

    with crashing_at_step(3), contextlib.suppress(Crash):
        _run(layout, root, "resumed")
    return _run(layout, root, "resumed")


def _merged(per_rank) -> dict[str, torch.Tensor]:
    """The whole model's params from the pipeline ranks' parts."""
    out = {}
    for params, _ in per_rank:
        for name, p in params.items():
            assert name not in out or torch.equal(out[name], p), name
            out[name] = p
    return out


@pytest.mark.parametrize("world,layout", [(2, PP2), (4, {**PP2, "parallelism.dp_shard": 2})], ids=["pp2", "pp2_fsdp2"])
def test_pipeline_resume_is_bit_exact(world, layout, tmp_path, gloo):
    straight = gloo.run(_run, world, layout, str(tmp_path), "straight", timeout=600)
    resumed = gloo.run(_crash_then_resume, world, layout, str(tmp_path), timeout=600)
    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert [s for s in b if s > 3] == [4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == a[step], step  # bit for bit
    want, got = _merged(straight), _merged(resumed)
    assert len(want) == 3 + 2 * 9  # embed, norm, output and 2 layers x 9: every leaf of the model came back
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    # the on-disk layout is the unpipelined one: `layers` a sequence, as written without pp
    meta = json.loads((tmp_path / "straight" / "checkpoints" / "6" / "default" / "_METADATA").read_text())
    keys = meta["tree_metadata"]["('params', 'layers', '1', 'attn', 'wq')"]["key_metadata"]
    assert [k["key_type"] for k in keys] == [2, 2, 1, 2, 2]


def _resume_from(layout: dict, root: str, src: str):
    """Start run "b" in ``layout`` from run ``src``'s step-3 checkpoint."""
    dst = Path(root) / "b" / "checkpoints"
    if int(os.environ.get("RANK", "0")) == 0:
        dst.mkdir(parents=True)
        shutil.copytree(Path(root) / src / "checkpoints" / "3", dst / "3")
    torch.distributed.barrier()
    return _run(layout, root, "b")


@pytest.mark.parametrize(
    "src_world,src,dst_world,dst",
    [(2, PP2, 1, {}), (2, {"parallelism.dp_shard": 2}, 2, PP2)],
    ids=["pp2_to_pp1", "fsdp2_to_pp2"],
)
def test_pipeline_checkpoints_reshard_on_load(src_world, src, dst_world, dst, tmp_path, gloo):
    straight = gloo.run(_run, src_world, src, str(tmp_path), "a", timeout=600)
    resumed = gloo.run(_resume_from, dst_world, dst, str(tmp_path), "a", timeout=600)
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == pytest.approx(a[step], rel=1e-5), step  # other layout: the same math, other rounding
    want, got = _merged(straight), _merged(resumed)
    assert want.keys() == got.keys()
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-4, atol=1e-5, msg=name)


def test_hf_export_of_a_pipeline_checkpoint_loads_in_transformers(tmp_path, gloo):
    transformers = pytest.importorskip("transformers")
    params = _merged(gloo.run(_run, 2, PP2, str(tmp_path), "a", timeout=600))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functitan.cli",
            "export",
            "hf",
            str(tmp_path / "a" / "checkpoints" / "6"),
            str(tmp_path / "exported"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported")
    sd = model.state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], params["embed.weight"])
    assert torch.equal(sd["lm_head.weight"], params["output.weight"])
    assert torch.equal(sd["model.layers.1.mlp.down_proj.weight"], params["layers.1.mlp.w_down"])


# Orbax rebuilds the tree from _METADATA alone: `layers` comes back as a list, as from an unpipelined run
def test_orbax_restores_a_pipeline_checkpoint(tmp_path, gloo, orbax):
    pytest.importorskip("orbax.checkpoint")

    from support import dump_arrays

    from functitan.checkpoint import _fastread
    from functitan.checkpoint._layout import names_in_metadata

    params = _merged(gloo.run(_run, 2, PP2, str(tmp_path), "a", timeout=600))
    item = tmp_path / "a" / "checkpoints" / "6" / "default"
    names = names_in_metadata(json.loads((item / "_METADATA").read_text()))
    stored = {}
    for n in names:
        spec = _fastread.parse(json.loads((item / n / "zarr.json").read_text()))
        stored[n] = _fastread.read_box(str(item / n), spec, (0,) * len(spec.shape), spec.shape)
    for k, v in params.items():
        assert np.array_equal(stored[f"params.{k}"], v.numpy()), k
    dump_arrays(stored, tmp_path / "expected", scalars=tuple(n for n, t in names.items() if t == "scalar"))
    report = orbax("read", str(item), str(tmp_path / "expected"))
    assert report["pytree"] and all(report["pytree"].values()), [k for k, ok in report["pytree"].items() if not ok]
    assert "params.layers.1.attn.wq" in report["pytree"]


def _chain_run(layout: dict, root: str, name: str, src: str | None, src_step: int, steps: int):
    """Run ``name`` to ``steps`` in ``layout``, starting from run ``src``'s checkpoint at ``src_step``."""
    if src is not None and int(os.environ.get("RANK", "0")) == 0:
        (Path(root) / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(
            Path(root) / src / "checkpoints" / str(src_step), Path(root) / name / "checkpoints" / str(src_step)
        )
    if src is not None:
        torch.distributed.barrier()
    _, params, data_state = train_small(
        {**layout, **CHAIN, "training.steps": steps, "metrics.run_dir": root, "metrics.run_name": name}
    )
    return params, data_state


# a constant learning rate: the runs of the chain stop at different training.steps, which a schedule would see
CHAIN = {
    "model.n_layers": 4,
    "training.microbatches": 4,
    "checkpoint.enable": True,
    "checkpoint.interval": 2,
    "checkpoint.keep_last": 3,
    "optimizer.schedule": "constant",
    "optimizer.lr": 3e-3,
}


def test_pipeline_checkpoint_goes_pp4_pp2_pp1_and_back(tmp_path, gloo):
    pp = lambda n: {"parallelism.pp": n, "parallelism.dp_shard": 1, "parallelism.pipeline_schedule": "1f1b"}  # noqa: E731
    root = str(tmp_path)
    straight = _merged(gloo.run(_chain_run, 1, {}, root, "straight", None, 0, 8, timeout=900))
    for i, (world, layout, src) in enumerate([(4, pp(4), None), (2, pp(2), "r0"), (1, {}, "r1"), (4, pp(4), "r2")]):
        got = _merged(gloo.run(_chain_run, world, layout, root, f"r{i}", src, 2 * i, 2 * (i + 1), timeout=900))
    want = _losses(tmp_path / "straight")
    losses = {s: v for i in range(4) for s, v in _losses(tmp_path / f"r{i}").items()}
    assert sorted(losses) == list(range(1, 9))
    for step, loss in losses.items():
        assert loss == pytest.approx(want[step], rel=1e-5), step
    for name, p in straight.items():
        torch.testing.assert_close(got[name], p, rtol=1e-4, atol=1e-5, msg=name)
