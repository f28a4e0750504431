"""Pipeline schedules as data: torch as an oracle for the orders, validation, simulation, CSV, CLI."""

from __future__ import annotations

import csv
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from functitan import pipeline as P
from functitan.pipeline._cli import main as cli_main

A = P.Action
GRID = [(p, m) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p)]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- torch.distributed.pipelining as an oracle -------------------------------------------------

_FROM_TORCH = {"F": "F", "I": "B", "W": "W", "B": "BW"}


def _stub(stage: int, num_stages: int, pp: int):
    """What torch's schedule constructors read from a stage; no nn.Module, no process group."""
    return SimpleNamespace(
        stage_index=stage,
        num_stages=num_stages,
        group_size=pp,
        group_rank=0,
        is_first=stage == 0,
        is_last=stage == num_stages - 1,
        submod=None,
    )


def _torch_order(schedule) -> list[list[A]]:
    """torch's pipeline_order without idle steps (None) and non-compute (REDUCE_GRAD) actions."""
    order = schedule.pipeline_order
    return [
        [
            A(_FROM_TORCH[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in order[rank]
            if a is not None and a.is_compute_op
        ]
        for rank in sorted(order)
    ]


def _rows(schedule: P.Schedule) -> list[list[A]]:
    return [list(row) for row in schedule.actions]


@pytest.mark.parametrize("p,m", GRID + [(4, 2), (4, 5)])
def test_gpipe_equals_torch(p, m):
    torch_order = _torch_order(torch_schedules.ScheduleGPipe(_stub(0, p, p), m))
    assert _rows(P.gpipe(p, m)) == torch_order
    assert torch_order[0][m] == A("BW", 0, 0)  # all forwards first, backwards in microbatch order


@pytest.mark.parametrize("p,m", GRID + [(4, 5)])  # torch's 1F1B refuses m < p; ours allows it
def test_1f1b_equals_torch_except_torchs_last_rank_forward_labels(p, m):
    ours = _rows(P.one_f_one_b(p, m))
    torch_order = _torch_order(torch_schedules.Schedule1F1B(_stub(0, p, p), m))
    assert ours[: p - 1] == torch_order[: p - 1]
    # torch labels the last rank's forwards 1..m (its warm-up is empty, so its counter starts at 0
    # and is incremented before use); the positions and all backwards agree with ours.
    last = p - 1
    torch_forwards = [a.microbatch for a in torch_order[last] if a.kind == "F"]
    assert torch_forwards == list(range(1, m + 1))
    assert [a.microbatch for a in ours[last] if a.kind == "F"] == list(range(m))
    relabelled = [a._replace(microbatch=a.microbatch - 1) if a.kind == "F" else a for a in torch_order[last]]
    assert ours[last] == relabelled
    assert ours[last][:2] == [A("F", last, 0), A("BW", last, 0)]


@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("p,m", GRID + [(4, 2), (4, 6), (2, 8)])
def test_interleaved_1f1b_equals_torch(p, v, m):
    stages = [_stub(k * p, v * p, p) for k in range(v)]
    torch_order = _torch_order(torch_schedules.ScheduleInterleaved1F1B(stages, m))
    assert _rows(P.interleaved_1f1b(p, v, m)) == torch_order


def test_interleaved_1f1b_rejects_what_torch_rejects():
    with pytest.raises(ValueError, match="microbatches=7 must be a multiple of the number of rounds"):
        P.interleaved_1f1b(3, 2, 7)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        torch_schedules.ScheduleInterleaved1F1B([_stub(k * 3, 6, 3) for k in range(2)], 7)


@pytest.mark.parametrize("p,m", GRID + [(4, 2), (4, 7)])
def test_zb_v_equals_torch_zbv_zero_bubble(p, m):
    stages = [_stub(0, 2 * p, p), _stub(2 * p - 1, 2 * p, p)]
    torch_schedule = torch_schedules.ScheduleZBVZeroBubble(stages, m)
    ours = P.zb_v(p, m)
    assert _rows(ours) == _torch_order(torch_schedule)
    assert ours.stage_to_rank == tuple(torch_schedule.stage_index_to_group_rank[s] for s in range(2 * p))


@pytest.mark.parametrize("p,m", GRID + [(4, 2)])
def test_zb_h1_equals_torch_interleaved_zero_bubble_with_one_stage_per_rank(p, m):
    torch_order = _torch_order(torch_schedules.ScheduleInterleavedZeroBubble([_stub(0, p, p)], m))
    assert _rows(P.zb_h1(p, m)) == torch_order


# ---- validate -----------------------------------------------------------------------------------


def _all_schedules():
    for p, m in GRID:
        yield P.gpipe(p, m)
        yield P.one_f_one_b(p, m)
        yield P.zb_h1(p, m)
        yield P.zb_v(p, m)
        for v in (1, 2):
            yield P.interleaved_1f1b(p, v, m)


def test_every_generated_schedule_validates_and_its_links_keep_order():
    count = 0
    for schedule in _all_schedules():
        assert P.validate(schedule) is schedule
        programs = P.with_comms(schedule)
        sent, received = {}, {}
        for rank, program in enumerate(programs):
            assert [x for x in program if isinstance(x, A)] == list(schedule.actions[rank])
            for c in (x for x in program if isinstance(x, P.Comm)):
                producer = c.stage if c.op == "send" else c.stage - 1 if c.kind == "F" else c.stage + 1
                link = (rank, c.peer) if c.op == "send" else (c.peer, rank)
                (sent if c.op == "send" else received).setdefault(link, []).append((c.kind, producer, c.microbatch))
        assert sent == received  # every link: receiver posts in the sender's order
        count += 1
    assert count == 6 * len(GRID)


def test_with_comms_example_and_local_handoff():
    r0, r1 = P.with_comms(P.one_f_one_b(2, 1))
    assert r0 == (A("F", 0, 0), P.Comm("send", 1, "F", 0, 0), P.Comm("recv", 1, "B", 0, 0), A("BW", 0, 0))
    assert r1 == (P.Comm("recv", 0, "F", 1, 0), A("F", 1, 0), A("BW", 1, 0), P.Comm("send", 0, "B", 1, 0))
    # ZB-V with p=2: rank 1 holds stages 1 and 2, so 1 -> 2 (and its gradient) is a local hand-off.
    last = P.with_comms(P.zb_v(2, 2))[1]
    comms = {(c.op, c.kind, c.stage, c.peer) for c in last if isinstance(c, P.Comm)}
    assert comms == {("recv", "F", 1, 0), ("send", "F", 2, 0), ("recv", "B", 2, 0), ("send", "B", 1, 0)}


def _one_f_one_b_rows(p=2, m=2):
    return [list(r) for r in P.one_f_one_b(p, m).actions]


def _with_rows(rows, base=None):
    base = base or P.one_f_one_b(2, 2)
    return P.Schedule(
        name="broken",
        pp=base.pp,
        stages_per_rank=base.stages_per_rank,
        microbatches=base.microbatches,
        stage_to_rank=base.stage_to_rank,
        actions=rows,
    )


def test_validate_rejects_backward_before_forward():
    rows = _one_f_one_b_rows()
    assert rows[1][:2] == [A("F", 1, 0), A("BW", 1, 0)]
    rows[1][0], rows[1][1] = rows[1][1], rows[1][0]
    with pytest.raises(ValueError) as e:
        P.validate(_with_rows(rows))
    assert str(e.value) == (
        "schedule 'broken': rank 1, action 0 (BW(stage 1, mb 0)) needs F(stage 1, mb 0), which comes later "
        "on the same rank (action 1); move it after index 1"
    )


def test_validate_rejects_a_missing_w():
    base = P.zb_h1(2, 2)
    rows = [list(r) for r in base.actions]
    rows[0].remove(A("W", 0, 1))
    message = r"rank 0, action 4 \(B\(stage 0, mb 1\)\): no W for it; add W\(stage 0, mb 1\) after index 4"
    with pytest.raises(ValueError, match=message):
        P.validate(_with_rows(rows, base))


def test_validate_rejects_w_before_b_and_a_missing_f():
    base = P.zb_h1(2, 2)
    rows = [list(r) for r in base.actions]
    i = rows[1].index(A("W", 1, 0))
    rows[1].insert(0, rows[1].pop(i))
    with pytest.raises(ValueError, match=r"rank 1, action 0 \(W\(stage 1, mb 0\)\) needs B\(stage 1, mb 0\)"):
        P.validate(_with_rows(rows, base))
    rows = _one_f_one_b_rows()
    rows[0].remove(A("F", 0, 1))
    with pytest.raises(ValueError, match=r"rank 0: no F for stage 0, microbatch 1; add F\(stage 0, mb 1\)"):
        P.validate(_with_rows(rows))


def test_validate_rejects_a_cross_rank_deadlock():
    # Rank 0 waits for microbatch 0's gradient before forwarding microbatch 1, which rank 1 wants first.
    rows = [
        [A("F", 0, 0), A("BW", 0, 0), A("F", 0, 1), A("BW", 0, 1)],
        [A("F", 1, 1), A("BW", 1, 1), A("F", 1, 0), A("BW", 1, 0)],
    ]
    with pytest.raises(ValueError) as e:
        P.validate(_with_rows(rows))
    assert str(e.value) == (
        "schedule 'broken': deadlock: rank 0, action 1 (BW(stage 0, mb 0)) waits for BW(stage 1, mb 0) "
        "(rank 1, action 3); rank 1, action 0 (F(stage 1, mb 1)) waits for F(stage 0, mb 1) (rank 0, action 2); "
        "reorder one of these ranks' lists"
    )


def test_validate_rejects_wrong_rank_duplicates_and_bad_headers():
    rows = _one_f_one_b_rows()
    rows[0].append(A("F", 1, 0))
    with pytest.raises(ValueError, match=r"rank 0, action 4 .*: stage 1 lives on rank 1 \(stage_to_rank\)"):
        P.validate(_with_rows(rows))
    rows = _one_f_one_b_rows()
    rows[0].append(A("F", 0, 0))
    with pytest.raises(ValueError, match=r"rank 0, action 4 .*: duplicate of action 0 on the same rank"):
        P.validate(_with_rows(rows))
    bad = P.Schedule(name="x", pp=2, stages_per_rank=1, microbatches=2, stage_to_rank=(0, 0), actions=[[], []])
    with pytest.raises(ValueError, match=r"rank 0 holds stages \(0, 1\) in stage_to_rank, expected stages_per_rank=1"):
        P.validate(bad)


# ---- simulate -----------------------------------------------------------------------------------

EQUAL = P.Costs(f=1, b=1, w=1, p2p=0)  # f = b = w = 1, so a full backward BW costs 2


@pytest.mark.parametrize("p,m", GRID + [(4, 32)])
def test_1f1b_and_gpipe_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(p, m):
    for generate in (P.one_f_one_b, P.gpipe):
        sim = P.simulate(generate(p, m), EQUAL)
        assert sim.makespan == 3 * (m + p - 1)
        assert sim.idle == (3 * (p - 1),) * p
        assert sim.bubble_fraction == (p - 1) / (m + p - 1)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_h1_idles_a_third_of_1f1b_at_the_same_activation_memory(p):
    for m in (p, 2 * p, 8 * p):
        zb, base = P.simulate(P.zb_h1(p, m), EQUAL), P.simulate(P.one_f_one_b(p, m), EQUAL)
        assert zb.idle == tuple(Fraction(i, 3) for i in base.idle) == (p - 1,) * p
        assert zb.bubble_fraction == (p - 1) / (3 * m + p - 1)
        assert zb.peak_activations == base.peak_activations == tuple(range(p, 0, -1))
    ratio = zb.bubble_fraction / base.bubble_fraction  # at m = 8p: (m+p-1)/(3m+p-1) -> 1/3
    assert 1 / 3 < ratio < 1 / 3 + 0.03


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_v_and_interleaved_bubbles(p):
    m = 2 * p
    zbv = P.simulate(P.zb_v(p, m), EQUAL)  # 2p stages of f=b=w=1: each rank computes 6m
    assert zbv.busy == (6 * m,) * p and zbv.idle == (p - 1,) * p
    assert zbv.peak_activations == (2 * p,) * p  # p per chunk of half size: 1F1B's memory
    inter = P.simulate(P.interleaved_1f1b(p, 2, m), EQUAL)
    assert inter.idle == (3 * (p - 1),) * p  # (p-1)(f+bw) with v=2 chunks: half of 1F1B relative
    assert zbv.bubble_fraction < inter.bubble_fraction


def test_simulate_of_a_validated_schedule_skips_only_the_check():
    # the planner times hundreds of built-in schedules; validating one costs more than timing it
    for schedule in (P.zb_v(4, 8), P.interleaved_1f1b(3, 2, 6), P.zb_h1(4, 12)):
        assert P.simulate(schedule, EQUAL, validated=True) == P.simulate(schedule, EQUAL)
    rows = _one_f_one_b_rows()
    rows[1][0], rows[1][1] = rows[1][1], rows[1][0]  # a backward before its forward: unvalidated, refused
    with pytest.raises(ValueError, match=r"needs F\(stage 1, mb 0\), which comes later"):
        P.simulate(_with_rows(rows), EQUAL)


def test_simulate_p2p_and_per_stage_costs_exactly():
    p, m, c = 3, 6, Fraction(1, 2)
    sim = P.simulate(P.gpipe(p, m), P.Costs(f=1, b=1, w=1, p2p=c))
    assert sim.makespan == 3 * (m + p - 1) + 2 * (p - 1) * c  # each hop pays c, forward and back
    sim = P.simulate(P.gpipe(2, 1), P.Costs(f=(1, 2), b=(1, 3), w=(2, 1), p2p=0))
    assert sim.spans == (((0, 1), (7, 10)), ((1, 3), (3, 7)))
    with pytest.raises(ValueError, match="Costs.f: got 3 per-stage values, the schedule has 2 stages"):
        P.simulate(P.gpipe(2, 1), P.Costs(f=(1, 1, 1)))
    with pytest.raises(ValueError, match=r"Costs.w: costs must be non-negative numbers, got -1"):
        P.simulate(P.gpipe(2, 1), P.Costs(w=-1))


def test_simulate_replays_per_action_durations():
    """A slow first forward on stage 0 delays everything after it by its excess, on both ranks."""
    s = P.gpipe(2, 1)
    base = P.simulate(s, EQUAL)
    slow = P.simulate(s, EQUAL, durations={P.Action("F", 0, 0): 4})
    assert slow.makespan == base.makespan + 3 and slow.spans[1][0] == (4, 5)
    assert slow.busy == (base.busy[0] + 3, base.busy[1])
    with pytest.raises(ValueError, match=r"durations\[.*\]: must be a non-negative number, got -1"):
        P.simulate(s, EQUAL, durations={P.Action("F", 0, 0): -1})


def test_simulate_per_action_overhead_is_idle():
    """Host time before each action delays it on its rank and counts as idle, not busy."""
    sim = P.simulate(P.one_f_one_b(2, 1), P.Costs(f=1, b=1, w=1, p2p=0, overhead=1))
    # rank 0: F at 1-2, BW waits for rank 1's BW (ends 6): 6-8; rank 1: F at 2-3, BW after an overhead: 4-6
    assert sim.spans == (((1, 2), (6, 8)), ((2, 3), (4, 6)))
    assert sim.busy == (3, 3) and sim.bubble_fraction == Fraction(10, 16)
    with pytest.raises(ValueError, match=r"Costs.overhead: must be a non-negative number, got -1"):
        P.simulate(P.gpipe(2, 1), P.Costs(overhead=-1))


def _timelines(schedule: P.Schedule, costs: P.Costs) -> list[list[P.StepTimeline]]:
    """One step per rank as the executor records it, from a simulation with ``costs`` (float seconds)."""
    sim = P.simulate(schedule, costs)
    out = []
    for row, spans in zip(schedule.actions, sim.spans):
        free, recorded = 0.0, []
        for a, (start, end) in zip(row, spans):
            recorded.append(P.Span(a, start, end, wait=start - (free + costs.overhead)))
            free = end
        out.append([P.StepTimeline(0.0, float(sim.makespan), tuple(recorded))])
    return out


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb_h1", "zb_v"])
def test_fit_costs_recovers_the_costs_of_a_timeline(name):
    """fit_costs on a step timed by the simulator gives back its costs: compute per stage, P2P latency and
    per-action host time, so the fitted simulation has the step's idle fraction."""
    schedule = {
        "1f1b": P.one_f_one_b(2, 4),
        "interleaved": P.interleaved_1f1b(2, 2, 4),
        "zb_h1": P.zb_h1(2, 4),
        "zb_v": P.zb_v(2, 4),
    }[name]
    n = schedule.num_stages
    split = any(a.kind == "W" for row in schedule.actions for a in row)
    costs = P.Costs(f=[2.0 + s for s in range(n)], b=[3.0] * n, w=[1.0 if split else 0.0] * n, p2p=0.5, overhead=0.25)
    fitted = P.fit_costs(schedule, _timelines(schedule, costs))
    assert fitted == costs
    assert P.simulate(schedule, fitted).bubble_fraction == P.simulate(schedule, costs).bubble_fraction
    with pytest.raises(ValueError, match=r"fit_costs: got timelines of 1 ranks, the schedule has pp=2"):
        P.fit_costs(schedule, _timelines(schedule, costs)[:1])


def test_render_text_timeline():
    s = P.one_f_one_b(2, 2)
    assert P.render_text(s, P.simulate(s, EQUAL)) == (
        "rank 0 |[F0 ][F1 ]..........[BW0     ].....[BW1     ]\nrank 1 |.....[F0 ][BW0     ][F1 ][BW1     ].........."
    )
    v = P.zb_v(2, 3)
    first_row = P.render_text(v, P.simulate(v, EQUAL)).splitlines()[0]
    assert first_row.startswith("rank 0 |[F0 ][F1 ][F2 ][F0'][B0'][W0']")


def test_render_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    s = P.gpipe(2, 2)
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # also the submodules an earlier test may have imported
    with pytest.raises(ImportError, match=r"pip install 'functitan\[plot\]'"):
        P.render_png(s, P.simulate(s), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ---- CSV ----------------------------------------------------------------------------------------


def test_csv_round_trip(tmp_path):
    for schedule in (P.zb_v(3, 6), P.interleaved_1f1b(2, 2, 4), P.zb_h1(3, 3), P.gpipe(2, 3)):
        path = tmp_path / f"{schedule.name}.csv"
        P.save_csv(schedule, path)
        assert P.load_csv(path) == schedule  # the name comes from the file name
    assert path.read_text().splitlines()[0] == "0F0,0F1,0F2,0B0,0B1,0B2"  # torch letters: B = full


def test_csv_interoperates_with_torch(tmp_path):
    p, m = 3, 5
    stages = [_stub(0, 2 * p, p), _stub(2 * p - 1, 2 * p, p)]
    torch_file = tmp_path / "torch_zbv.csv"
    torch_schedules.ScheduleZBVZeroBubble(stages, m)._dump_csv(str(torch_file), format="compute_only")
    ours = P.load_csv(torch_file, name="zb_v")
    assert ours == P.zb_v(p, m)  # torch's idle steps (empty cells) are skipped, I -> B, B -> BW
    assert ours.actions[0][5:8] == (A("F", 5, 0), A("B", 5, 0), A("W", 5, 0))
    our_file = tmp_path / "ours.csv"
    P.save_csv(P.zb_v(p, m), our_file)
    torch_back = torch_schedules.ScheduleZBVZeroBubble(stages, m)
    torch_back._load_csv(str(our_file), format="compute_only")  # torch validates it on load
    assert _torch_order(torch_back) == _rows(P.zb_v(p, m))


def test_csv_errors_name_file_row_and_cell(tmp_path):
    path = tmp_path / "custom.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1X0,1F1,1B1\n")
    with pytest.raises(ValueError) as e:
        P.load_csv(path)
    assert str(e.value).startswith(f"{path}: row 2 (rank 1), cell 2: cannot parse '1X0'; expected")
    path.write_text("0F0,0B0\n0F1,1F0,1B0,0B1\n")
    with pytest.raises(ValueError, match=r"custom.csv: stage 0 appears in row 1 and row 2"):
        P.load_csv(path)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["0F0", "", "0B0"], ["1F0", "1B0"]])
    loaded = P.load_csv(path)  # empty cells are idle steps
    assert loaded.actions == ((A("F", 0, 0), A("BW", 0, 0)), (A("F", 1, 0), A("BW", 1, 0)))
    assert P.validate(loaded).microbatches == 1


# ---- CLI ----------------------------------------------------------------------------------------


def test_cli_show_prints_timeline_and_bubble_and_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    argv = ["show", "--schedule", "zb_v", "--pp", "4", "--microbatches", "8", "--costs", "1,1,1,0", "--out", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert [line[:8] for line in lines[:4]] == ["rank 0 |", "rank 1 |", "rank 2 |", "rank 3 |"]
    assert "bubble fraction: 0.0588" in printed  # 4 ranks x 3 idle / (4 x 51)
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_cli_show_makes_the_folder_of_its_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "not" / "yet" / "timeline.png"  # as `report --out` and `plan --png` do
    assert cli_main(["show", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert cli_main(["show", "--schedule", "1f1b", "--pp", "2", "--out", str(blocked / "t.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("functitan: error: ") and str(blocked) in err[0]


def test_cli_reports_bad_input(tmp_path, capsys):
    assert cli_main(["show", "--schedule", "zb_v", "--stages-per-rank", "3"]) == 2
    assert "--stages-per-rank applies to --schedule interleaved_1f1b only" in capsys.readouterr().err
    path = tmp_path / "s.csv"
    P.save_csv(P.one_f_one_b(2, 4), path)
    assert cli_main(["show", "--csv", str(path)]) == 0
    assert "bubble fraction: 0.2000" in capsys.readouterr().out  # (p-1)/(m+p-1) = 1/5
    assert cli_main(["show", "--schedule", "1f1b", "--costs", "1,2"]) == 2  # argparse's error: one line too
    err = capsys.readouterr().err
    assert err.startswith("functitan: error: argument --costs: expected four non-negative numbers f,b,w,p2p")
    assert err.count("\n") == 1, err


def test_one_spelling_per_schedule_name():
    # the config's Literal, the CLI's choices and make_schedule share SCHEDULE_NAMES
    import typing

    from functitan.job_config import ParallelismConfig

    hint = typing.get_type_hints(ParallelismConfig)["pipeline_schedule"]
    assert typing.get_args(hint) == P.SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v")
    assert [P.make_schedule(n, 2, 4).name for n in P.SCHEDULE_NAMES] == list(P.SCHEDULE_NAMES)
    with pytest.raises(ValueError, match=r"pipeline schedule 'zbv' is unknown; choose one of"):
        P.make_schedule("zbv", 2, 4)
