"""functitan.checkpoint: bit-exact round trips, reshard on load, atomic commits under kill -9, corruption, errors."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from functitan.checkpoint import CheckpointError, CheckpointManager, restore, save, save_sync, verify
from functitan.mesh import make_mesh
from functitan.train_state import TrainState


class Adam(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Compare floats bit for bit (NaN-safe, -0.0 != 0.0)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _full(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _state(step: int) -> TrainState:
    params = {
        "w": _full((6, 5), step),
        "emb": _full((4, 3), step + 1, torch.bfloat16),
        "layers": [{"g": _full((5,), step + 2)}],
    }
    mu = {k: v for k, v in params.items()}
    opt = Adam(
        count=torch.tensor(step, dtype=torch.int64),
        mu=mu,
        nu={"w": _full((6, 5), step + 3), "emb": _full((4, 3), 9, torch.bfloat16), "layers": [{"g": torch.zeros(5)}]},
    )
    return TrainState(
        step=step, params=params, opt_state=opt, data_state={"epoch": 1, "offset": 1000 * step}, rng=2**62 + step
    )


def _zeros_like(tree):
    return torch.utils._pytree.tree_map(
        lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else type(x)(0), tree
    )


def _assert_tree_equal(a, b):
    fa, fb = torch.utils._pytree.tree_flatten(a), torch.utils._pytree.tree_flatten(b)
    assert fa[1] == fb[1]
    for x, y in zip(fa[0], fb[0]):
        assert type(x) is type(y), (x, y)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(_bits(x), _bits(y))
        else:
            assert x == y


# ----------------------------------------------------------------------------------------------- round trip


def test_round_trip_bit_exact_and_live_mutation_does_not_reach_the_file(tmp_path):
    state = _state(3)
    state.params["w"].requires_grad_(True)  # a live parameter
    state = state._replace(
        params={**state.params, "misc": [1, 2.5, True, np.float32(0.25), torch.tensor(-7, dtype=torch.int64)]}
    )
    expected = torch.utils._pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)
    handle = save(tmp_path / "ck", state)
    # the lazy-read trap: tensorstore must not be reading the live tensors
    with torch.no_grad():
        for leaf in torch.utils._pytree.tree_leaves(state):
            if isinstance(leaf, torch.Tensor):
                leaf.fill_(123)
    assert handle.wait() == str(tmp_path / "ck")
    exemplar = _zeros_like(expected)
    exemplar = exemplar._replace(params={**exemplar.params, "w": torch.empty(6, 5, device="meta", requires_grad=True)})
    got = restore(tmp_path / "ck", exemplar)
    assert got.params["w"].device.type == "cpu" and got.params["w"].requires_grad
    got.params["w"].requires_grad_(False)
    assert isinstance(got.rng, int) and got.rng == 2**62 + 3
    assert got.params["misc"][3] == np.float32(0.25) and isinstance(got.params["misc"][3], np.float32)
    _assert_tree_equal(got, expected)
    meta = json.loads((tmp_path / "ck" / "_METADATA").read_text())
    assert meta["tree_metadata"]["('opt_state', 'mu', 'layers', '0', 'g')"]["key_metadata"][3] == {
        "key": "0",
        "key_type": 1,
    }
    assert (tmp_path / "ck" / "opt_state.count" / "zarr.json").exists()


# ----------------------------------------------------------------------------------------------- reshard

SHAPES = {"a": (8, 6), "uneven": (9, 5), "rep": (4, 4), "tiny": (1, 3)}


def _refs():
    return {k: _full(s, i) for i, (k, s) in enumerate(SHAPES.items())}


def _fsdp(mesh, refs):
    """FSDP storage on make_mesh()'s 5-D mesh: Shard(0) on dp_shard, "rep" replicated."""
    out = {}
    for k, v in refs.items():
        pl = [Replicate(), Replicate(), Replicate() if k == "rep" else Shard(0), Replicate(), Replicate(), Replicate()]
        out[k] = distribute_tensor(v, mesh, pl, src_data_rank=None)
    return out


def _reshard_worker(root: str, single_written: str):
    refs = _refs()
    rank = dist.get_rank()
    fsdp_mesh = make_mesh(device="cpu")
    # written by 2 processes (FSDP) through the manager
    mgr = CheckpointManager(root, interval=1, keep_last=2)
    mgr.maybe_save(TrainState(step=1, params=_fsdp(fsdp_mesh, refs), opt_state=(), data_state={"i": 7}, rng=5))
    mgr.close()
    # read back as TP: a 1-D mesh sharding dim 1 ("rep" replicated)
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp_ex = {
        k: distribute_tensor(torch.zeros(s), tp_mesh, [Replicate() if k == "rep" else Shard(1)])
        for k, s in SHAPES.items()
    }
    ex = TrainState(step=0, params=tp_ex, opt_state=(), data_state={"i": 0}, rng=0)
    got = CheckpointManager(root, interval=1, keep_last=2).restore_latest(ex)
    tp = {k: (tuple(v.placements), v.to_local().clone()) for k, v in got.params.items()}
    # the single-process checkpoint read by 2 processes as FSDP
    fs_ex = _fsdp(fsdp_mesh, {k: torch.zeros(s) for k, s in SHAPES.items()})
    got1 = restore(single_written, fs_ex)
    fs = {k: v.to_local().clone() for k, v in got1.items()}
    files = sorted(os.listdir(os.path.join(root, "1", "default", "params.uneven", "c", "0")))
    return {"rank": rank, "tp": tp, "fsdp": fs, "data": got.data_state, "files": files}


def test_reshard_matrix_2_to_1_1_to_2_fsdp_to_tp_uneven(tmp_path, gloo):
    refs = _refs()
    save_sync(tmp_path / "single", refs)
    root = str(tmp_path / "run")
    results = gloo.run(_reshard_worker, 2, root, str(tmp_path / "single"))
    for r, res in enumerate(results):
        assert res["data"] == {"i": 7}
        for k, ref in refs.items():
            placements, local = res["tp"][k]
            want = ref if k == "rep" else torch.tensor_split(ref, [-(-ref.shape[1] // 2)], dim=1)[r]
            assert torch.equal(local, want), (k, r)
            want_fs = (
                ref if k == "rep" else torch.chunk(ref, 2, dim=0)[r] if r < len(torch.chunk(ref, 2, dim=0)) else ref[:0]
            )
            assert torch.equal(res["fsdp"][k], want_fs), (k, r)
    # uneven 9 rows over 2 writers: two files (rows 0-4 and 5-8), each written once
    assert results[0]["files"] == ["0"] and sorted(
        os.listdir(tmp_path / "run" / "1" / "default" / "params.uneven" / "c")
    ) == ["0", "1"]
    # the replicated leaf was written once (by rank 0): one chunk file
    assert os.listdir(tmp_path / "run" / "1" / "default" / "params.rep" / "c") == ["0"]
    # 2 writers -> 1 reader, as plain tensors (full values)
    got = restore(
        tmp_path / "run" / "1" / "default",
        {
            "step": 0,
            "params": {k: torch.zeros(s) for k, s in SHAPES.items()},
            "opt_state": (),
            "data_state": {"i": 0},
            "rng": 0,
        },
    )
    for k, ref in refs.items():
        assert torch.equal(got["params"][k], ref)
    # and into a one-rank mesh (DTensor exemplar)
    mesh = make_mesh(device="cpu")
    ex = TrainState(
        step=0,
        params=_fsdp(mesh, {k: torch.zeros(s) for k, s in SHAPES.items()}),
        opt_state=(),
        data_state={"i": 0},
        rng=0,
    )
    got = restore(tmp_path / "run" / "1" / "default", ex)
    assert isinstance(got.params["a"], DTensor) and torch.equal(got.params["uneven"].full_tensor(), refs["uneven"])


# ----------------------------------------------------------------------------------------------- atomicity


def _tree_for(step: int) -> dict:
    return {"step": step, "w": torch.full((256, 1024), float(step)), "b": torch.arange(1000) + step}


def _saver_loop(root: str, start: int, ready) -> None:
    mgr = CheckpointManager(root, interval=1, keep_last=2)
    step = start
    while True:
        mgr.maybe_save(_tree_for(step), step=step)
        if step == start:  # once the first is on disk: on a loaded machine an async save can outlast the kill delay
            mgr.wait()
            ready.set()
        step += 1


def test_kill_9_during_async_saves_never_leaves_a_partial_checkpoint(tmp_path):
    root = str(tmp_path / "run")
    ctx = mp.get_context("forkserver")
    rng = random.Random(0)
    ex = {"step": 0, "w": torch.zeros(256, 1024), "b": torch.zeros(1000, dtype=torch.int64)}
    restored_steps = []
    for _trial in range(10):
        mgr = CheckpointManager(root, interval=1, keep_last=2)
        start = (mgr.latest_step() or 0) + 1
        ready = ctx.Event()
        p = ctx.Process(target=_saver_loop, args=(root, start, ready), daemon=True)
        p.start()
        assert ready.wait(60)
        time.sleep(rng.uniform(0.0, 0.25))
        p.kill()
        p.join()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback (warning) would mean a damaged newest checkpoint
            got = mgr.restore_latest(ex)
        step = mgr.latest_step()
        if step is None:
            continue
        _assert_tree_equal(got, _tree_for(step))
        for s in mgr.all_steps():  # every listed step is complete
            _assert_tree_equal(mgr.restore(s, ex), _tree_for(s))
        restored_steps.append(step)
    assert len(restored_steps) >= 8 and restored_steps == sorted(restored_steps)
    leftovers = [e for e in os.listdir(root) if not e.isdigit()]
    assert all(".tmp-" in e for e in leftovers)
    # each trial's manager removed the leftovers of the previous kill: at most the last kill's remain
    assert len(leftovers) <= 2, leftovers
    CheckpointManager(root, interval=1, keep_last=2).close()  # a restart
    assert all(e.isdigit() for e in os.listdir(root)), os.listdir(root)


def test_a_restart_removes_leftovers_of_cut_short_saves_and_deletes(tmp_path):
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=3, async_save=False)
    for step in (1, 2):
        mgr.maybe_save(_state(step))
    mgr.close()
    shutil.copytree(tmp_path / "2", tmp_path / "3.tmp-0a1b2c3d4e5f")  # a save cut short before its rename
    (tmp_path / "3.tmp-0a1b2c3d4e5f" / "default" / "_COMMIT").unlink()
    shutil.copytree(tmp_path / "1", tmp_path / "0.tmp-deleting-89abcdef")  # a retention delete cut short
    (tmp_path / "notes.tmp-keep").mkdir()  # not a step's: left alone
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=3)
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "notes.tmp-keep"]
    _assert_tree_equal(mgr.restore_latest(_zeros_like(_state(0))), _state(2))
    mgr.close()


# ----------------------------------------------------------------------------------------------- deferred staging


def _donated_step_and_state():
    from functitan import optim
    from functitan.step import make_train_step
    from functitan.transforms import value_and_grad

    params = {"w": _full((64, 32), 0).requires_grad_(), "b": _full((32,), 1).requires_grad_()}
    opt = optim.adamw(1e-2, weight_decay=0.1)
    step = make_train_step(value_and_grad(lambda p, x: ((x @ p["w"] + p["b"]) ** 2).mean()), opt, donate=True)
    state = TrainState(step=0, params=params, opt_state=opt.init(params), data_state={"i": 0}, rng=3)
    return step, state


def _snapshot(state):
    return torch.utils._pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)


@pytest.mark.parametrize("fenced", [True, False])
def test_deferred_staging_saves_step_k_while_step_k_plus_1_updates_in_place(tmp_path, monkeypatch, fenced):
    """The save of step k copies in the background while the donated step k+1 runs; the step's ``before_update``
    fence makes the checkpoint hold step k's bits. The staging thread is held until the step reaches its update
    (fenced) or has finished it (no fence): without the fence the checkpoint holds step k+1's values, so this
    comparison catches a missing fence."""
    import functitan.checkpoint._save as S

    go = threading.Event()
    stage = S._stage
    monkeypatch.setattr(S, "_stage", lambda *a, **k: (go.wait(), stage(*a, **k))[1])
    step, state = _donated_step_and_state()
    x = _full((8, 64), 5)
    state, _ = step(state, x)  # step k = 1
    at_k = _snapshot(state)
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=2)
    handle = mgr.maybe_save(state, defer_staging=True)
    assert not handle._staged.is_set()  # the copy has not started: the loop is not blocked by it

    def fence():
        go.set()
        mgr.staged()

    def buffers(state):  # params and Adam's moments (the counts are new 0-d tensors each step)
        return [t.data_ptr() for t in torch.utils._pytree.tree_leaves((state.params, state.opt_state[0][1:]))]

    before = buffers(state)
    state, _ = step(state, x, before_update=fence if fenced else None)  # step k + 1, in place
    go.set()
    mgr.wait()
    assert buffers(state) == before and len(before) == 6  # donated: the same buffers now hold step k + 1
    assert not torch.equal(state.params["w"], at_k.params["w"])
    saved = mgr.restore(1, _zeros_like(at_k))
    if fenced:
        _assert_tree_equal(saved, at_k)
    else:
        assert torch.equal(saved.params["w"], state.params["w"]) and not torch.equal(
            saved.params["w"], at_k.params["w"]
        )
    mgr.close()


def test_the_functional_step_never_calls_the_fence_and_the_donated_one_calls_it_once():
    from functitan import optim
    from functitan.step import make_train_step
    from functitan.transforms import value_and_grad

    calls = []
    loss = value_and_grad(lambda p, x: ((x @ p["w"]) ** 2).mean())
    ends = {}
    for donate in (False, True):
        params = {"w": _full((16, 4), 0).requires_grad_()}
        opt = optim.adamw(1e-2)
        state = TrainState(step=0, params=params, opt_state=opt.init(params), data_state={}, rng=0)
        step = make_train_step(loss, opt, donate=donate)
        calls.clear()
        state, _ = step(state, _full((3, 16), 1), before_update=lambda: calls.append(1))
        assert len(calls) == int(donate)
        ends[donate] = state.params["w"].detach()
    torch.testing.assert_close(ends[True], ends[False], rtol=0, atol=1e-6)  # the fence changes nothing else
    assert not torch.equal(ends[True], _full((16, 4), 0))


def test_a_failed_deferred_staging_is_raised_by_the_fence(tmp_path, monkeypatch):
    import functitan.checkpoint._save as S

    def broken(*a, **k):
        raise OSError("no memory for the staging buffers")

    monkeypatch.setattr(S, "_stage", broken)
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=2)
    mgr.maybe_save(_state(1), defer_staging=True)
    with pytest.raises(RuntimeError, match=r"staging checkpoint .*/1 failed: no memory for the staging buffers"):
        mgr.staged()
    with pytest.raises(RuntimeError, match=r"saving checkpoint .*/1 failed"):
        mgr.close()
    assert mgr.all_steps() == []


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice values are a Linux feature")
def test_an_async_saves_writers_run_at_the_lowest_priority_and_a_sync_saves_do_not(tmp_path, monkeypatch):
    import functitan.checkpoint._fastwrite as FW

    seen = []
    write = FW.write_block

    def recording(*a, **k):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return write(*a, **k)

    monkeypatch.setattr(FW, "write_block", recording)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    save(tmp_path / "async", _state(1)).wait()
    assert seen and set(seen) == {19}
    seen.clear()
    save_sync(tmp_path / "sync", _state(1))
    assert seen and set(seen) == {mine}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller keeps its own
    _assert_tree_equal(restore(tmp_path / "async", _zeros_like(_state(0))), _state(1))


# ----------------------------------------------------------------------------------------------- corruption


def _data_file(step_dir, name):
    d = step_dir / "default" / name / "c"
    return next(p for p in d.rglob("*") if p.is_file())


def test_truncated_newest_checkpoint_warns_and_falls_back(tmp_path):
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=3, async_save=False)
    for step in (1, 2):
        mgr.maybe_save(_state(step))
    f = _data_file(tmp_path / "2", "params.w")
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.warns(RuntimeWarning, match=r"step 2 .*damaged.*truncated.*restored step 1"):
        got = mgr.restore_latest(_zeros_like(_state(0)))
    _assert_tree_equal(got, _state(1))
    with pytest.raises(CheckpointError, match=r"params\.w/c/0/0 has \d+ bytes, the commit marker"):
        restore(tmp_path / "2" / "default", _zeros_like(_state(0)))
    mgr.close()


def test_a_damaged_step_is_resaved_in_place_and_never_counts_toward_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=3, async_save=False)
    for step in (1, 2, 3):
        mgr.maybe_save(_state(step))
    mgr.close()
    f = _data_file(tmp_path / "2", "params.w")  # the two newest damaged: one truncated, one without _COMMIT
    f.write_bytes(f.read_bytes()[:-10])
    (tmp_path / "3" / "default" / "_COMMIT").unlink()
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=2, async_save=False)
    with pytest.warns(
        RuntimeWarning, match=r"step 3 .*damaged.*_COMMIT is missing.*step 2 .*damaged.*truncated.*restored step 1"
    ):
        got = mgr.restore_latest(_zeros_like(_state(0)))
    _assert_tree_equal(got, _state(1))
    # the resumed run reaches step 2 again: saved, replacing the damaged one; the damaged 3 does not count
    # toward keep_last=2, so the intact step 1 stays and 3 goes (it is re-saved when the run gets there)
    assert mgr.maybe_save(_state(2)) is not None
    assert mgr.all_steps() == [1, 2] and sorted(os.listdir(tmp_path)) == ["1", "2"]
    _assert_tree_equal(mgr.restore(2, _zeros_like(_state(0))), _state(2))
    assert mgr.maybe_save(_state(3)) is not None and mgr.all_steps() == [2, 3]
    mgr.close()


def test_a_functitan_checkpoint_without_its_commit_marker_is_incomplete(tmp_path):
    save_sync(tmp_path / "ck", {"w": torch.ones(3)})
    (tmp_path / "ck" / "_COMMIT").unlink()
    with pytest.raises(
        CheckpointError, match=r"ck/_COMMIT is missing: .*ck was written by functitan but never committed"
    ):
        restore(tmp_path / "ck", {"w": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="_COMMIT is missing"):
        verify(tmp_path / "ck")


# a 16 KiB chunk, and a 3 MiB one that the reader checksums 1 MiB piece by piece: a flip in the first piece, in
# a later one, and in the stored crc32c itself
@pytest.mark.parametrize("rows, at", [(64, 100), (12288, (5 << 19) + 7), (12288, -2)])
def test_flipped_bits_are_caught_by_the_chunk_checksum(tmp_path, rows, at):
    w = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0))
    save_sync(tmp_path / "ck", {"w": w})
    torch.testing.assert_close(restore(tmp_path / "ck", {"w": torch.zeros(rows, 64)})["w"], w, atol=0, rtol=0)
    f = tmp_path / "ck" / "w" / "c" / "0" / "0"
    data = bytearray(f.read_bytes())
    assert len(data) == rows * 64 * 4 + 4  # one chunk: the bytes and their crc32c
    data[at] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"^w: reading .*/ck/w failed: .*Digest mismatch.*the checkpoint is corrupted"
    ):
        restore(tmp_path / "ck", {"w": torch.zeros(rows, 64)})


def test_direct_reader_reads_only_the_inner_chunks_a_box_needs(tmp_path, monkeypatch):
    from functitan.checkpoint import _fastread

    w = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0))  # 8 MiB: two 4 MiB inner chunks
    save_sync(tmp_path / "ck", {"w": w})
    spec = _fastread.parse(json.loads((tmp_path / "ck" / "w" / "zarr.json").read_text()))
    assert spec.inner == (1024, 1024)
    read = []
    real = _fastread._pread
    monkeypatch.setattr(_fastread, "_pread", lambda fd, off, n, *a: read.append(n) or real(fd, off, n, *a))
    got = _fastread.read_box(str(tmp_path / "ck" / "w"), spec, (100, 0), (500, 1024))  # inside the first inner chunk
    assert np.array_equal(got, w[100:600].numpy())
    assert sum(read) == (4 << 20) + 4 + 2 * 16 + 4  # one inner chunk + its crc32c, the index + its crc32c
    # a flipped bit in the chunk read is caught; one in the other chunk is not read at all
    f = tmp_path / "ck" / "w" / "c" / "0" / "0"
    data = bytearray(f.read_bytes())
    data[(4 << 20) + 4 + 100] ^= 1  # inside the second inner chunk
    f.write_bytes(bytes(data))
    assert np.array_equal(_fastread.read_box(str(tmp_path / "ck" / "w"), spec, (0, 0), (1024, 1024)), w[:1024].numpy())
    with pytest.raises(
        CheckpointError,
        match=r"^w: reading .*/ck/w failed: Digest mismatch: the crc32c of .*c/0/0 inner "
        r"chunk \(1, 0\) does not match.*the checkpoint is corrupted",
    ):
        restore(tmp_path / "ck", {"w": torch.zeros(2048, 1024)})


def test_row_block_chunks_are_read_straight_into_the_output_and_checked(tmp_path, monkeypatch):
    from functitan.checkpoint import _fastread

    w = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(1))  # inner chunks: (1024, 1024) row blocks
    save_sync(tmp_path / "ck", {"w": w})
    buffered = []
    real = _fastread._pread
    monkeypatch.setattr(_fastread, "_pread", lambda fd, off, n, *a: buffered.append(n) or real(fd, off, n, *a))
    for in_place in (False, True):
        got = restore(tmp_path / "ck", {"w": torch.zeros(2048, 1024)}, in_place=in_place)
        assert torch.equal(got["w"], w)
    assert buffered == [2 * 16 + 4, 2 * 16 + 4]  # only the shard index went through the buffer
    f = tmp_path / "ck" / "w" / "c" / "0" / "0"
    data = bytearray(f.read_bytes())
    data[7] ^= 0x10  # inside inner chunk (0, 0)
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"crc32c of .*c/0/0 inner chunk \(0, 0\) does not match"):
        restore(tmp_path / "ck", {"w": torch.zeros(2048, 1024)}, in_place=True)


def test_direct_writer_writes_the_files_tensorstore_writes(tmp_path, monkeypatch):
    from functitan.checkpoint import _fastwrite

    g = torch.Generator().manual_seed(0)
    tree = {
        "rows": torch.randn(2048, 1024, generator=g),  # inner chunks (1024, 1024): contiguous, written in place
        "cols": torch.randn(2048, 1280, generator=g),  # inner chunks (1024, 640): gathered first
        "cube": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),  # a plain chunk file
        "c": torch.randn(4, 3, dtype=torch.complex64, generator=g),  # not _fastwrite's: tensorstore writes it
        "mask": torch.tensor([True, False, True]),
        "step": 7,
        "lr": 0.5,
    }
    assert _fastwrite.writable({"shape": [4, 3], "data_type": "complex64", **_zarr_rest()}) is None
    save_sync(tmp_path / "fast", tree)
    monkeypatch.setattr(_fastwrite, "writable", lambda metadata: None)  # every leaf through tensorstore
    save_sync(tmp_path / "ts", tree)
    files = sorted(p.relative_to(tmp_path / "ts") for p in (tmp_path / "ts").rglob("*") if p.is_file())
    assert len(files) == 2 + 2 * len(tree)  # _METADATA, _COMMIT, and a zarr.json + one chunk file per leaf
    for rel in files:
        assert (tmp_path / "fast" / rel).read_bytes() == (tmp_path / "ts" / rel).read_bytes(), rel
    got = restore(tmp_path / "fast", tree)
    assert all(torch.equal(got[k], tree[k]) for k in ("rows", "cols", "cube", "c", "mask"))
    assert (got["step"], got["lr"]) == (7, 0.5)


def _zarr_rest() -> dict:
    leaf = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    grid = {"name": "regular", "configuration": {"chunk_shape": [4, 3]}}
    return {"chunk_grid": grid, "chunk_key_encoding": {"name": "default"}, "fill_value": 0, "codecs": leaf}


def test_in_place_restore_fills_the_exemplars_tensors(tmp_path):
    tree = {"w": _full((64, 48), 3), "n": torch.arange(5), "step": 7}
    save_sync(tmp_path / "ck", tree)
    ex = {"w": torch.zeros(64, 48, requires_grad=True), "n": torch.zeros(5, dtype=torch.int64), "step": 0}
    new = restore(tmp_path / "ck", ex)  # default: new tensors, the exemplar untouched
    assert torch.equal(new["w"], tree["w"]) and not ex["w"].any() and new["w"].requires_grad
    got = restore(tmp_path / "ck", ex, in_place=True)
    assert got["w"] is ex["w"] and got["n"] is ex["n"] and got["step"] == 7
    assert torch.equal(ex["w"], tree["w"]) and torch.equal(ex["n"], tree["n"])


# ----------------------------------------------------------------------------------------------- errors


def test_errors_name_the_key_path_and_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"params\.a\.b: the dict key 'a\.b' contains '\.'"):
        save(tmp_path / "bad", {"params": {"a.b": torch.zeros(2)}})
    save_sync(tmp_path / "ck", {"params": {"w": torch.zeros(2, 3), "v": torch.zeros(4)}})
    with pytest.raises(
        ValueError, match=r"params\.w: the checkpoint holds shape \(2, 3\) \(.*/ck/params\.w\), the exemplar \(3, 2\)"
    ):
        restore(tmp_path / "ck", {"params": {"w": torch.zeros(3, 2), "v": torch.zeros(4)}})
    with pytest.raises(ValueError, match=r"params\.u: not in the checkpoint \(.*/ck/_METADATA\)"):
        restore(tmp_path / "ck", {"params": {"w": torch.zeros(2, 3), "v": torch.zeros(4), "u": torch.zeros(1)}})
    with pytest.raises(ValueError, match=r"params\.v: in the checkpoint \(.*_METADATA\) but not in the exemplar"):
        restore(tmp_path / "ck", {"params": {"w": torch.zeros(2, 3)}})
    with pytest.raises(
        ValueError, match=r"params\.w: the checkpoint holds torch.float32 .* the exemplar torch.bfloat16"
    ):
        restore(tmp_path / "ck", {"params": {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "v": torch.zeros(4)}})
    # an unknown dtype (hand-edited metadata, same size: the commit marker's checksum notices, check=False not)
    zj = tmp_path / "ck" / "params.v" / "zarr.json"
    zj.write_text(zj.read_text().replace('"float32"', '"float42"'))
    with pytest.raises(CheckpointError, match=r"params\.v/zarr\.json does not match its checksum in .*_COMMIT"):
        restore(tmp_path / "ck", {"params": {"w": torch.zeros(2, 3), "v": torch.zeros(4)}})
    with pytest.raises(ValueError, match=r"params\.v: cannot open the array .*/ck/params\.v.*float42"):
        restore(tmp_path / "ck", {"params": {"w": torch.zeros(2, 3), "v": torch.zeros(4)}}, check=False)
    zj.write_text(zj.read_text().replace('"float42"', '"float32" '))
    with pytest.raises(CheckpointError, match=r"params\.v/zarr\.json has \d+ bytes, the commit marker .* recorded"):
        restore(tmp_path / "ck", {"params": {"w": torch.zeros(2, 3), "v": torch.zeros(4)}})
    with pytest.raises(ValueError, match="already exists"):
        save(tmp_path / "ck", {"x": torch.zeros(1)})


# ----------------------------------------------------------------------------------------------- manager


def test_manager_retention_exclude_and_weights_only(tmp_path):
    mgr = CheckpointManager(tmp_path, interval=2, keep_last=2, keep_every=4, exclude=("opt_state",))
    saved = [s for s in range(1, 13) if mgr.maybe_save(_state(s)) is not None]
    mgr.wait()
    assert saved == [2, 4, 6, 8, 10, 12]
    assert mgr.all_steps() == [4, 8, 10, 12] and mgr.latest_step() == 12
    assert not (tmp_path / "12" / "default" / "opt_state.count").exists()
    ex = _zeros_like(_state(0))
    got = mgr.restore_latest(ex)
    _assert_tree_equal(got._replace(opt_state=None), _state(12)._replace(opt_state=None))
    assert got.opt_state is ex.opt_state or torch.equal(got.opt_state.count, ex.opt_state.count)
    params = mgr.restore(8, _zeros_like(_state(0).params), only="params")
    _assert_tree_equal(params, _state(8).params)
    assert mgr.maybe_save(_state(12)) is None  # already saved
    mgr.close()
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointManager(tmp_path, interval=1, keep_last=0)


def test_every_file_is_flushed_to_disk_before_the_commit_marker(tmp_path, monkeypatch):
    """Durability: each chunk file (flushed by its writer, overlapping the other writes), each zarr.json and
    tensorstore's chunks (flushed after the writes) reach the disk before ``_COMMIT`` names them."""
    from functitan.checkpoint import _layout

    flushed: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", fsync)
    g = torch.Generator().manual_seed(0)
    tree = {
        "rows": torch.randn(2048, 1024, generator=g),  # _fastwrite, a shard file of inner chunks
        "cube": torch.randn(3, 5, 7, generator=g),  # _fastwrite, a plain chunk file
        "c": torch.randn(4, 3, dtype=torch.complex64, generator=g),  # tensorstore's chunk
        "step": 7,
    }
    save_sync(tmp_path / "ck", tree)
    rel = [p.split(_layout.TMP_MARK, 1)[1].partition("/")[2] for p in flushed if _layout.TMP_MARK in p]
    assert rel[-2:] == [_layout.COMMIT, ""]  # the marker, then its directory
    assert flushed[-1] == str(tmp_path)  # then the parent, after the rename to the final name
    files = {str(p.relative_to(tmp_path / "ck")) for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    assert files - {_layout.COMMIT} <= set(rel[:-2]), files - set(rel[:-2])
    assert len(files) == 2 + 2 * len(tree)


@pytest.mark.parametrize(
    ("cores", "local", "threads"), [(8, None, 8), (8, "4", 2), (2, "2", 1), (2, "4", 1), (64, "1", 16)]
)
def test_a_restore_reads_with_its_share_of_the_hosts_cores(monkeypatch, cores, local, threads):
    from functitan.checkpoint import _restore

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert _restore._read_threads() == threads


@pytest.mark.parametrize("dies_at", [1, 2])
def test_a_peer_dying_during_a_save_is_one_line_or_nothing_when_the_step_committed(tmp_path, monkeypatch, dies_at):
    import functitan.checkpoint._save as S

    calls = []

    def all_gather(out, obj, group=None):  # the survivors' gloo error when a rank of the save is killed
        calls.append(1)
        if len(calls) == dies_at:
            raise RuntimeError(
                "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32178. This is "
                "typically caused by a remote worker crashing. Check the logs of the remote worker"
            )
        out[0] = obj

    mgr = CheckpointManager(tmp_path, interval=1, keep_last=2)
    mgr._group.pg = "one rank, as if distributed"  # the commit's collectives run: 1 before the rename, 2 after
    monkeypatch.setattr(S.dist, "all_gather_object", all_gather)
    monkeypatch.setattr(S.dist, "broadcast", lambda *a, **k: None)
    mgr.maybe_save(_state(1))
    if dies_at == 2:  # after the commit (the rename): the step is saved, nothing to report
        mgr.close()
        assert mgr.all_steps() == [1]
        return
    with pytest.raises(CheckpointError) as err:  # a user error: one line, exit 2, no traceback
        mgr.close()
    assert str(err.value) == (
        f"saving checkpoint {tmp_path / '1'} did not complete: a rank left during the save (gloo: "
        "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32178); the committed "
        "checkpoints are untouched: run the same command to resume from the newest (an elastic run restarts "
        "from it by itself)"
    )
    assert mgr.all_steps() == []
