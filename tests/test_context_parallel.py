"""Context parallelism: each cp rank holds two balanced chunks of the sequence, and loss and every gradient equal
one process's (issue 27), and packed documents attend only within themselves.

Each layout runs one real train step (``make_train_step`` with SGD at lr 1: the gradient is ``before - after``)
of llama, gpt2 and qwen3 (tiny flavors of models/, unchanged by CP) against the same step on one process, for
each attention algorithm; attention alone (forward and backward, packed documents under all-gather K/V and
Ulysses); the sequence split itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import train_small

from functitan import optim
from functitan._model_setup import check_model
from functitan._seq import SequenceSplit
from functitan.mesh import make_mesh
from functitan.model import check_names, gradcheck, init, load_model
from functitan.model import specs as model_specs
from functitan.random import key
from functitan.sharding import Layout, default_rules, is_spec, place
from functitan.step import make_train_step
from functitan.train_state import TrainState
from functitan.transforms import value_and_grad
from functitan.tree import flatten_with_names
from models import gpt2, llama, qwen3

BATCH, SEQ = 2, 16
TOL = dict(atol=1e-6, rtol=1e-5)
FAMILIES = {
    "llama": (llama, dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)),
    "gpt2": (gpt2, dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64)),
    "qwen3": (qwen3, dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                          max_seq_len=64)),
}  # fmt: skip
# width 30 does not divide by dp_shard 2 x cp 2: it is split over dp_shard alone (DTensor reassembles a dim split
# twice into unequal pieces out of order)
ODD = {"llama_odd": (llama, dict(vocab_size=64, dim=30, n_layers=2, n_heads=5, n_kv_heads=1, ffn_dim=48,
                                 max_seq_len=64))}  # fmt: skip


def _model(family: str) -> tuple[Any, Any]:
    mod, over = {**FAMILIES, **ODD}[family]
    return mod.MODEL, mod.MODEL.config("debug", **over)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g)
    batch = {"inputs": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()}
    # prompts that are not trained on: the count differs by cp chunk (not by row: the models' loss is a mean,
    # exact over data-parallel ranks when each rank holds as many tokens; test_objectives covers the rest)
    batch["targets"][0, :5] = -100
    batch["targets"][1, 9:14] = -100
    return batch


SEGMENTS = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [0] * 9 + [1] * 7])  # packed documents of ragged lengths


def _qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, h, SEQ, 8, generator=g) for h in (4, 2, 2)]  # q, k, v: grouped-query


def _attention(degrees: dict, algorithm: str, segments: bool) -> tuple[torch.Tensor, ...]:
    """On every rank: ``layout.attention`` of this rank's chunks -> (output, dq, dk, dv) of those chunks."""
    layout = Layout(make_mesh(**degrees, device="cpu"), cp_attention=algorithm)
    q, k, v = (layout.seq.cut(t, 2).requires_grad_() for t in _qkv())
    o = layout.attention(q, k, v, segment_ids=SEGMENTS if segments else None)
    (o * layout.seq.cut(torch.linspace(0.1, 1.0, SEQ), 0)[:, None]).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


def _attention_reference(segments: bool) -> list[torch.Tensor]:
    q, k, v = (t.requires_grad_() for t in _qkv())
    o = Layout().attention(q, k, v, segment_ids=SEGMENTS if segments else None)
    (o * torch.linspace(0.1, 1.0, SEQ)[:, None]).sum().backward()
    return [o.detach(), q.grad, k.grad, v.grad]


def _step(
    family: str, degrees: dict, sp: bool, algorithm: str, param_dtype: torch.dtype | None = None
) -> tuple[float, dict, dict]:
    """On every rank: one train step under this layout -> (loss, full gradients, local shapes of the params)."""
    model, c = _model(family)
    mesh = make_mesh(**degrees, device="cpu")
    rules = default_rules(sequence_parallel=sp)
    layout = Layout(mesh, rules, cp_attention=algorithm, param_dtype=param_dtype)
    full, specs = init(model.params(c), key(0)), model_specs(model.params(c))
    params = place(full, specs, rules, mesh)
    opt = optim.sgd(1.0)
    step = make_train_step(value_and_grad(lambda p, b: model.loss(p, b, c, layout)), opt)
    state = TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=0)
    local = {k: v.chunk(layout.dp_size)[layout.dp_rank] for k, v in _batch().items()}
    new, metrics = step(state, local)
    before, after = flatten_with_names(state.params)[0], flatten_with_names(new.params)[0]
    grads = {n: (p.full_tensor() - q.full_tensor()).detach() for (n, p), (_, q) in zip(before, after)}
    return metrics["loss"], grads, {n: tuple(p.to_local().shape) for n, p in before}


def _reference(family: str, param_dtype: torch.dtype | None = None) -> tuple[float, dict]:
    model, c = _model(family)
    layout = Layout(param_dtype=param_dtype)
    value, grads = value_and_grad(lambda p, b: model.loss(p, b, c, layout))(init(model.params(c), key(0)), _batch())
    return value.item(), dict(flatten_with_names(grads)[0])


def _steps(cases: list, attention: list) -> dict[str, Any]:
    out = {name: _step(*case) for name, *case in cases}
    out.update({name: _attention(*case) for name, *case in attention})
    return out


# (name, family, mesh degrees, sequence parallel, algorithm)
CASES_2 = [(f"{f}_cp2_{a}", f, dict(cp=2), False, a) for f in FAMILIES for a in ("allgather", "ring", "ulysses")]
CASES_4 = [(f"{f}_cp4_{a}", f, dict(cp=4), False, a) for f in FAMILIES for a in ("allgather", "ring")] + [
    ("llama_cp2_tp2_sp", "llama", dict(cp=2, tp=2), True, "allgather"),
    ("gpt2_cp2_tp2_sp_ring", "gpt2", dict(cp=2, tp=2), True, "ring"),
    ("qwen3_cp2_fsdp2", "qwen3", dict(cp=2, dp_shard=2), False, "allgather"),
    ("llama_hsdp_cp2", "llama", dict(cp=2, dp_replicate=2, dp_shard=1), False, "ring"),
    ("llama_odd_cp2_fsdp2", "llama_odd", dict(cp=2, dp_shard=2), False, "ring"),
]
# bf16 compute (fp32 params and gradients), against one process in bf16: equal up to bf16's rounding, which the
# layouts reach in other orders (the loss within 0.1%, each gradient within 3% in norm; fp32 is exact to 1e-6)
CASES_BF16 = [
    ("llama_cp2_allgather_bf16", "llama", dict(cp=2), False, "allgather", torch.bfloat16),
    ("qwen3_cp2_ring_bf16", "qwen3", dict(cp=2), False, "ring", torch.bfloat16),
    ("gpt2_cp2_ulysses_bf16", "gpt2", dict(cp=2), False, "ulysses", torch.bfloat16),
]
# attention alone, forward and backward (name, degrees, algorithm, packed documents)
ATTENTION_2 = [(f"attention_cp2_{a}", dict(cp=2), a, False) for a in ("allgather", "ring", "ulysses")] + [
    ("attention_cp2_packed", dict(cp=2), "allgather", True),
    ("attention_cp2_packed_ulysses", dict(cp=2), "ulysses", True),
]
ATTENTION_4 = [
    ("attention_cp4_ring", dict(cp=4), "ring", False),
    ("attention_cp4_packed", dict(cp=4), "allgather", True),
]


def _check(results: list[dict], cases: list, attention: list) -> None:
    refs: dict[str, tuple] = {}
    for name, family, degrees, *_ in cases:
        ref_loss, ref_grads = refs.setdefault(family, _reference(family))
        model, c = _model(family)
        specs = dict(flatten_with_names(model_specs(model.params(c)), is_leaf=is_spec)[0])
        split = [n for n in (degrees.get("dp_shard", 1), degrees["cp"]) if n > 1]
        for rank, got in enumerate(results):
            loss, grads, shapes = got[name]
            assert abs(loss - ref_loss) < 1e-6, (name, rank, loss, ref_loss)
            assert grads.keys() == ref_grads.keys()
            for k, g in grads.items():
                torch.testing.assert_close(g, ref_grads[k], **TOL, msg=lambda m, k=k: f"{name} rank {rank} {k}: {m}")
                if "embed" in specs[k]:  # FSDP shards over dp_shard x cp: a cp rank holds its share, no copy
                    d = specs[k].index("embed")  # (a width that does not divide by both: over dp_shard alone)
                    n = math.prod(split) if g.shape[d] % math.prod(split) == 0 else split[0]
                    assert shapes[k][d] in (g.shape[d] // n, -(-g.shape[d] // n)), (name, rank, k, shapes[k])
    for name, degrees, _, segments in attention:
        ref = _attention_reference(segments)
        for rank, got in enumerate(results):
            layout_rank = SequenceSplit(degrees["cp"], rank, "cp", "", balanced=True)
            for what, g, r in zip(("out", "dq", "dk", "dv"), got[name], ref):
                torch.testing.assert_close(g, layout_rank.cut(r, 2), **TOL, msg=lambda m: f"{name} {rank} {what}: {m}")


def test_cp2_equals_one_process_for_three_families_and_three_algorithms(gloo):
    results = gloo.run(_steps, 2, CASES_2 + CASES_BF16, ATTENTION_2, timeout=240)
    _check(results, CASES_2, ATTENTION_2)
    for name, family, *_, dtype in CASES_BF16:
        ref_loss, ref_grads = _reference(family, dtype)
        assert all(r[name][1].keys() == ref_grads.keys() for r in results)
        for rank, (loss, grads, _) in enumerate(r[name] for r in results):
            assert abs(loss - ref_loss) < 1e-3 * abs(ref_loss), (name, rank, loss, ref_loss)  # measured 7e-6
            for k, g in grads.items():
                assert g.dtype == torch.float32 and torch.isfinite(g).all(), (name, k)
                err = (g - ref_grads[k]).norm() / ref_grads[k].norm().clamp_min(1e-12)
                assert err < 3e-2, (name, rank, k, err.item())  # relative norm; measured at most 1.3%


def test_cp4_and_cp_with_tp_sp_fsdp_hsdp_equal_one_process(gloo):
    _check(gloo.run(_steps, 4, CASES_4, ATTENTION_4, timeout=300), CASES_4, ATTENTION_4)


def test_balanced_split_holds_chunks_i_and_2cp_minus_1_minus_i_and_composes_with_sp():
    cp = [SequenceSplit(4, r, "cp", "fix", balanced=True) for r in range(4)]
    assert [s.ranges(16) for s in cp][1] == [(2, 4), (12, 14)]
    held = torch.cat([s.positions(16) for s in cp])
    assert sorted(held.tolist()) == list(range(16))  # every position once
    sp = SequenceSplit(2, 1, "sp", "fix", outer=SequenceSplit(2, 0, "cp", "fix", balanced=True))
    assert sp.ranges(16) == [(12, 16)] and sp.total == 4  # cp rank 0 holds 0..4 and 12..16; SP's second half
    assert SequenceSplit(4, 1, "sp", "", outer=sp.outer).ranges(16) == [(2, 4)]
    assert SequenceSplit(4, 2, "sp", "", outer=sp.outer).ranges(16) == [(12, 14)]
    x = torch.arange(16)[None]
    assert sp.cut(x).tolist() == [[12, 13, 14, 15]] and cp[2].cut(x).tolist() == [[4, 5, 10, 11]]
    with pytest.raises(ValueError, match="divisible by 8"):
        cp[0].ranges(12)
    with pytest.raises(ValueError, match="layout.positions"):
        cp[0].range(16)
    assert dataclasses.replace(sp, outer=None).ranges(8) == [(4, 8)]


def test_the_ring_computes_only_the_chunk_pairs_a_query_sees():
    from functitan._cp import _RingPlan, _tiles

    tiles = [_tiles(SequenceSplit(2, r, "cp", "", balanced=True).ranges(16)) for r in range(2)]
    assert tiles == [[(0, 4, 0), (4, 4, 12)], [(0, 4, 4), (4, 4, 8)]]  # (local start, length, global start)
    blocks = lambda rank, src, causal=True: [  # noqa: E731
        (q[2], k[2], m) for q, k, m in _RingPlan(None, rank, 2, tiles, causal, 1.0).blocks(src)
    ]
    # its own chunks: each over itself masked, the late one over the early one whole, the early over the late never
    assert blocks(0, 0) == [(0, 0, True), (12, 0, False), (12, 12, True)]
    assert blocks(0, 1) == [(12, 4, False), (12, 8, False)]  # rank 1's chunks 4..8 and 8..12: half the pairs
    assert blocks(1, 0) == [(4, 0, False), (8, 0, False)]
    assert len(blocks(0, 1, causal=False)) == 4 and not any(m for *_, m in blocks(0, 0, causal=False))


TINY_GPT = str(Path(__file__).parent / "assets" / "tiny_gpt.py")  # a user's model with its own attention


def test_gradcheck_passes_llama_under_cp_and_finds_a_model_whose_attention_ignores_cp():
    llama_small = {"dim": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "n_layers": 2}
    assert gradcheck("llama", overrides=llama_small, layouts=("cp", "cp_tp_sp")) == {"cp": {}, "cp_tp_sp": {}}
    wrong = gradcheck(TINY_GPT, layouts=("cp",))["cp"]  # F.scaled_dot_product_attention on the local chunks
    assert any(k.endswith("qkv") for k in wrong), wrong


def test_a_model_calling_sdpa_itself_is_refused_by_name_under_cp_before_step_1():
    model = load_model(TINY_GPT)
    cfg = model.config("debug")
    check_names(model, cfg)  # one process and every other layout: its own attention is fine
    with pytest.raises(
        ValueError, match=r"parallelism.cp=2: .*tiny_gpt.py:\d+ in .* calls F.scaled_dot_product_attention"
    ):
        check_names(model, cfg, cp=2)
    with pytest.raises(
        ValueError, match="training.seq_len=12: context parallelism cuts the sequence into 2 x cp=2 x tp=2"
    ):
        check_model(model, cfg, tp=2, pp=1, cp=2, seq_len=12, sequence_parallel=True)
    # Ulysses splits heads over tp x cp: llama's 2 kv heads take cp 2, not tp 2 x cp 2, refused before step 1
    lm, lc = _model("llama")
    check_model(lm, lc, tp=1, pp=1, cp=2, seq_len=16, sequence_parallel=False, cp_attention="ulysses")
    with pytest.raises(ValueError, match=r"ulysses splits attention's heads over tp=2 x cp=2 = 4 ranks, but the mo"):
        check_model(lm, lc, tp=2, pp=1, cp=2, seq_len=16, sequence_parallel=True, cp_attention="ulysses")
    check_model(lm, lc, tp=2, pp=1, cp=2, seq_len=16, sequence_parallel=True, cp_attention="ring")


CLI_RUN = {"training.steps": 3, "training.seq_len": 32, "model.n_layers": 2, "model.dim": 32, "model.n_heads": 4,
           "model.n_kv_heads": 2, "model.ffn_dim": 64, "training.batch_size": 4, "data.max_corpus_bytes": 200_000,
           "optimizer.eps": 1e-6, "metrics.log_every": 1}  # fmt: skip


def test_train_cli_as_typed_with_cp2_tp2_equals_one_process(tmp_path, gloo):
    """``functitan train --nproc 4 --parallelism.cp=2 --parallelism.tp=2`` (SP on, the default llama, the
    bundled corpus): each step's loss equals the trainer's on one process."""
    ref, *_ = gloo.run(
        train_small, 1, {**CLI_RUN, "metrics.run_dir": str(tmp_path), "metrics.run_name": "one"}, base={}
    )[0]
    flags = [f"--{k}={v}" for k, v in CLI_RUN.items()]
    cmd = [sys.executable, "-m", "functitan.cli", "train", "--nproc", "4", "--parallelism.cp=2", "--parallelism.tp=2"]
    out = subprocess.run(
        [*cmd, *flags, f"--metrics.run_dir={tmp_path}", "--metrics.run_name=cp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cp=2 tp=2" in out.stdout  # the banner names the layout
    got = [json.loads(line)["loss"] for line in (tmp_path / "cp" / "metrics.jsonl").read_text().splitlines()]
    assert len(got) == len(ref) == 3 and got[-1] < got[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=2e-5, rtol=1e-4)
