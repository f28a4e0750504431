"""Where a run's records go besides metrics.jsonl, through `functitan train` as typed: W&B (offline), TensorBoard's
grouped tags and config text, torch.profiler traces; and the CUDA memory snapshots' logic (faked on CPU)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import textwrap
import tomllib
import zlib
from pathlib import Path

import pytest
import torch
from support import TINY_FLAGS, cli

from functitan.cli import main
from functitan.config import parse_config
from functitan.errors import UserNotice
from functitan.job_config import JobConfig, ProfileConfig
from functitan.metrics import GROUPS, Profiler

wandb = pytest.importorskip("wandb")  # the wandb extra (`make test` installs it)

TINY = [*TINY_FLAGS, "--training.steps=3", "--metrics.log_every=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[str]]:
    """One run with W&B (offline) and a traced step 2: ``(its directory, the arguments it ran with)``."""
    root = tmp_path_factory.mktemp("runs")
    args = [*TINY, f"--metrics.run_dir={root}", "--metrics.run_name=tiny", "--metrics.wandb", "--profile.steps=2"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.delenv("WANDB_DIR", raising=False)  # the default: W&B's files in the run's directory
        assert main(["train", *args]) == 0
    return root / "tiny", args


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (``run-<id>.wandb``), read as W&B's own reader does: a header, then
    LevelDB-log blocks of 32 KiB whose records carry a CRC-32 (seeded with their type) over their bytes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    magic, _, version = struct.unpack("<4sHB", data[:7])
    assert (magic, version) == (b":W&B", 0), (magic, version)
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        crc, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (crc, size, kind) == (0, 0, 0):
            break
        body = data[pos + 7 : pos + 7 + size]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos}"
        part, pos = part + body, pos + 7 + size
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def _wandb_history(records) -> dict[int, dict]:
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            out[r.history.step.num] = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item
            }
    return out


def test_wandb_offline_run_is_read_back_with_the_losses_of_metrics_jsonl(run):
    run_dir, _ = run
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    dry = subprocess.run(
        [sys.executable, "-m", "wandb", "sync", "--dry-run", str(log.parent)], capture_output=True, text=True
    )
    assert dry.returncode == 0 and "Would sync 1 run(s)" in dry.stdout + dry.stderr, dry.stdout + dry.stderr
    records = _wandb_records(log)
    (header,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    run_id = (run_dir / "wandb_id").read_text().strip()
    assert (header.display_name, header.project, header.run_id) == ("tiny", "functitan", run_id)
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert config["training"]["steps"] == 3 and config["profile"]["steps"] == [2]  # the whole job's config
    history = _wandb_history(records)
    jsonl = _jsonl(run_dir)
    assert sorted(history) == [r["step"] for r in jsonl] == [1, 2, 3]
    for r in jsonl:  # every number under its group's tag, as metrics.jsonl has it
        assert history[r["step"]]["train/loss"] == r["loss"]
        assert history[r["step"]]["perf/tokens_per_s"] == r["tokens_per_s"]
        assert history[r["step"]]["data/data_seq"] == r["data_seq"]


def test_the_same_run_continues_its_wandb_run_and_wandb_dir_moves_the_files(run, tmp_path, monkeypatch):
    run_id = (run[0] / "wandb_id").read_text()
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / "wandb_id").write_text(run_id)  # the run as the first start of it left it
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    args = [*TINY, "--training.steps=1", f"--metrics.run_dir={tmp_path / 'runs'}", "--metrics.run_name=tiny"]
    assert main(["train", *args, "--metrics.wandb", "--metrics.wandb_mode=offline"]) == 0
    (log,) = tmp_path.glob("elsewhere/wandb/offline-run-*/run-*.wandb")
    (header,) = [r.run for r in _wandb_records(log) if r.WhichOneof("record_type") == "run"]
    assert header.run_id == run_id.strip()  # the run's W&B id, kept in its directory
    assert not (tmp_path / "runs" / "tiny" / "wandb").exists()  # WANDB_DIR holds W&B's files


def test_tensorboard_tags_are_grouped_and_the_config_is_its_text(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, args = run
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/loss_avg", "train/grad_norm", "train/lr", "perf/tokens_per_s", "perf/mfu"):
        assert tag in tags, tags
    assert "memory/mem_max_rss_gib" in tags or "memory/mem_max_rss_since_start_gib" in tags, tags
    assert "data/data_seq" in tags and [t for t in tags if "/" not in t] == [], tags
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in _jsonl(run_dir)
    ]
    assert set(_jsonl(run_dir)[0]) >= {"loss", "loss_avg", "tokens_per_s", "data_seq"}  # metrics.jsonl: plain keys
    (text,) = acc.Tensors("config/text_summary")
    toml = textwrap.dedent(text.tensor_proto.string_val[0].decode())
    assert tomllib.loads(toml)["training"]["steps"] == 3
    (run_dir / "config.toml").write_text(toml)  # the text is the run's config: --config reads it back to it
    assert parse_config(JobConfig, ["--config", str(run_dir / "config.toml")]) == parse_config(JobConfig, args)


def test_profile_steps_write_a_chrome_trace_of_each_step(run):
    run_dir, _ = run
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["step-2-rank0.json"]
    events = json.loads((run_dir / "profile" / "step-2-rank0.json").read_text())["traceEvents"]
    matmuls = [e for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    assert matmuls and all(len(e["args"]["Input Dims"]) == 2 for e in matmuls), matmuls[:2]  # ops with shapes
    assert [e["name"] for e in events if e.get("cat") == "user_annotation"] == ["ProfilerStep#2"]  # step 2 alone


REPORTS_MD = Path(__file__).resolve().parents[1] / "docs" / "reports.md"


def test_the_tag_groups_docs_reports_md_lists_are_the_sinks_table():
    page = REPORTS_MD.read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", page, re.M)
    assert {group: tuple(re.findall(r"`(\w+)`", keys)) for group, keys in rows} == GROUPS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile.steps=2,0"], "profile.steps=2,0: training steps, each >= 1, e.g. 5,6"),
        (["--profile.steps=9"], "profile.steps=9: step 9 is past training.steps=3; choose steps in 1..3"),
        (["--profile.memory_snapshot_steps=4"], "profile.memory_snapshot_steps=4: step 4 is past training.steps=3"),
        (["--metrics.wandb_mode=onlin"], "metrics.wandb_mode='onlin' is not allowed; choose one of"),
        (["--metrics.wandb_project="], "metrics.wandb_project='': a W&B project name"),
    ],
)
def test_a_bad_profile_or_wandb_key_is_one_line_naming_it(argv, message):
    out = cli("train", *TINY, *argv)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_wandb_without_the_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec None, import fails
    out = cli("train", *TINY, "--metrics.wandb")
    assert out.returncode == 2 and out.stderr == (
        "functitan: error: metrics.wandb=True: needs wandb: pip install 'functitan[wandb]'\n"
    ), out.stderr


def test_wandb_that_cannot_start_is_one_line_with_the_way_out(monkeypatch, tmp_path):
    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    out = cli("train", *TINY, "--training.steps=1", f"--metrics.run_dir={tmp_path}", "--metrics.wandb")
    assert out.returncode == 2 and out.stderr == (
        "functitan: error: metrics.wandb=true: W&B did not start: No API key configured. Use `wandb login` to log "
        "in. (or train without it: --metrics.wandb_mode=offline keeps the run here for `wandb sync`)\n"
    ), out.stderr


def _fake_cuda(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", Path(path).name)))
    return calls


def test_cuda_memory_snapshots_after_chosen_steps_and_on_oom(monkeypatch, tmp_path):
    calls = _fake_cuda(monkeypatch)
    cfg = ProfileConfig(memory_snapshot_steps=(2,), memory_snapshot_on_oom=True)
    with pytest.raises(torch.OutOfMemoryError) as oom:
        with Profiler(cfg, tmp_path, rank=1, device=torch.device("cuda"), start=0) as profiler:
            profiler.step(1)
            profiler.step(2)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  # in step 3
    assert calls == [
        ("record", {"max_entries": 100_000}),
        ("dump", "memory-step-2-rank1.pickle"),
        ("dump", "memory-oom-step-3-rank1.pickle"),
        ("record", {"enabled": None}),  # the history stops with the loop
    ]
    assert oom.value.__notes__ == [
        f"functitan: the CUDA memory snapshot of step 3: {tmp_path}/profile/memory-oom-step-3-rank1.pickle "
        "(pytorch.org/memory_viz)"
    ]


def test_memory_snapshots_on_cpu_are_one_notice_and_nothing_recorded(monkeypatch, tmp_path):
    calls = _fake_cuda(monkeypatch)
    cfg = ProfileConfig(memory_snapshot_steps=(1,), memory_snapshot_on_oom=True)
    with pytest.warns(UserNotice, match=r"memory snapshots are CUDA's \(torch.cuda.memory\); none is written on cpu"):
        with Profiler(cfg, tmp_path, rank=0, device=torch.device("cpu")) as profiler:
            profiler.step(1)
    assert calls == [] and not (tmp_path / "profile").exists()


def test_the_train_commands_of_docs_reports_md_parse(monkeypatch):
    monkeypatch.chdir(REPORTS_MD.parents[1])  # as typed from the repository's root
    lines = [line.split("#")[0].split() for line in REPORTS_MD.read_text().splitlines()]
    commands = [words[2:] for words in lines if words[:2] == ["functitan", "train"]]
    assert len(commands) >= 5
    for argv in commands:
        parse_config(JobConfig, argv)  # a ConfigError names the key


def test_wandb_sink_logs_under_the_groups_skips_none_and_resumes_by_the_kept_id(monkeypatch, tmp_path):
    from functitan.metrics import WandbSink

    calls: list = []

    class Run:
        id = "abc123"

        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append("finish")

    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or Run())
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for _ in range(2):  # a first start, then the same run again
        sink = WandbSink(tmp_path / "r", project="p", mode="offline", config={"training": {"steps": 3}})
        sink.write(1, {"loss": torch.tensor(2.0), "mfu": None, "eval/loss": 3.0, "data_seq": 4})
        sink.close()
    first, second = calls[0], calls[3]
    assert first == {
        "project": "p",
        "entity": None,
        "name": "r",
        "id": None,
        "resume": None,
        "mode": "offline",
        "config": {"training": {"steps": 3}},
        "dir": str(tmp_path / "r"),
    }
    assert second == {**first, "id": "abc123", "resume": "allow"}  # the id kept in the run: the same W&B run
    assert calls[1:3] == [("log", 1, {"train/loss": 2.0, "eval/loss": 3.0, "data/data_seq": 4}), "finish"]
    assert (tmp_path / "r" / "wandb_id").read_text() == "abc123\n"
