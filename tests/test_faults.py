"""Faults and bad input (issue 25), through the CLI as typed: no process outlives its launcher, a run folder is
used by one job at a time, a slow save holds the loop back rather than falling behind, and each user error is
one line with exit code 2."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from functitan.cli import COMMANDS
from functitan.testing import TINY_RUN_ARGS

ROOT = Path(__file__).resolve().parents[1]
TINY = [*TINY_RUN_ARGS, "--training.batch_size=4", "--training.seq_len=32"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _train(run_dir: Path, name: str, *args: str, log: Path, stdout: bool = False) -> subprocess.Popen:
    """``functitan train`` as typed, on the tiny model, training for long enough to be killed while it trains
    (``stdout``: its stdout goes to ``log`` too)."""
    cmd = [sys.executable, "-m", "functitan.cli", "train", *TINY, "--training.steps=100000"]
    cmd += [f"--metrics.run_dir={run_dir}", f"--metrics.run_name={name}", *args]
    with open(log, "wb") as err:
        out = err if stdout else subprocess.DEVNULL
        return subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=_env())


def _wait_for_metrics(run: Path, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no metrics line in {timeout} s: {log.read_text()[-3000:]}"
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------ processes (/proc)


def _stat(pid: int) -> tuple[int, str, str] | None:
    """``(ppid, state, start time)`` of a live process; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every process below ``root``: pid -> its start time (so a reused pid is not taken for it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append(int(entry))
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if (st := _stat(child)) is not None:
                out[child] = st[2]
                todo.append(child)
    return out


def _alive(procs: dict[int, str]) -> list[int]:
    return [pid for pid, start in procs.items() if (st := _stat(pid)) is not None and st[1] != "Z" and st[2] == start]


def _listening_sockets(pids) -> set[tuple[int, str]]:
    """``(port, socket inode)`` of each TCP port these processes listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with_link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if with_link.startswith("socket:["):
                    inodes.add(with_link[8:-1])
        except OSError:
            continue
    return {(port, inode) for port, inode in _listening() if inode in inodes}


def _holders(sockets: set[tuple[int, str]]) -> dict[int, str]:
    """pid -> command line of the processes that hold these sockets (for a failure's message)."""
    inodes = {inode for _, inode in sockets}
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = {os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")}
            if {f"socket:[{i}]" for i in inodes} & links:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_text().replace("\0", " ")[:200]
        except OSError:
            continue
    return out


def _listening() -> list[tuple[int, str]]:
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    out.append((int(cols[1].rsplit(":", 1)[1], 16), cols[9]))
    return out


# ------------------------------------------------------------------------------------------ 1. no orphans


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "functitan.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=timeout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_the_launcher_leaves_no_process_and_no_port_and_frees_the_run_folder(tmp_path):
    # a scheduler's kill -9 of `functitan train --nproc N`: torchrun and every worker go with it (they kept
    # training, listening and writing the run), and a job requeued on the same run folder starts
    jobs = {n: _train(tmp_path, f"n{n}", "--nproc", str(n), log=tmp_path / f"n{n}.log") for n in (1, 2)}
    below: dict[int, dict[int, str]] = {}
    try:
        for n, proc in jobs.items():
            _wait_for_metrics(tmp_path / f"n{n}", proc, tmp_path / f"n{n}.log")
        below = {n: _descendants(proc.pid) for n, proc in jobs.items()}
        ports = _listening_sockets(pid for procs in below.values() for pid in procs)
        assert all(len(procs) >= n + 1 for n, procs in below.items()), below  # torchrun and its n workers
        assert ports  # torchrun's store and gloo listen while training

        # a second job on a run folder in use is refused, naming the holder: the first job's rank 0
        second = _cli("train", *TINY, "--training.steps=1", f"--metrics.run_dir={tmp_path}", "--metrics.run_name=n2")
        assert second.returncode == 2, second.stderr[-3000:]
        (line,) = second.stderr.strip().splitlines()
        holder = int(line.split("(pid ")[1].split()[0])
        assert holder in below[2], (line, below[2])
        assert line == (
            f"functitan: error: run folder {tmp_path}/n2 is in use by another job (pid {holder} on host "
            f"{os.uname().nodename} since {json.loads((tmp_path / 'n2' / 'run.lock').read_text())['since']}, "
            f"{tmp_path}/n2/run.lock); stop that job first, or give this one another metrics.run_name (or "
            "metrics.run_dir)"
        )

        for proc in jobs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 10
        left = {n: _alive(procs) for n, procs in below.items()}
        while any(left.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            left = {n: _alive(procs) for n, procs in below.items()}
        assert not any(left.values()), f"still running 10 s after the launcher's SIGKILL: {left}"
        # (a socket's inode number is reused once it is closed: a match held by another process is not ours)
        ours = {pid: cmd for pid, cmd in _holders(ports & set(_listening())).items() if str(tmp_path) in cmd}
        assert not ours, f"sockets the job listened on are still open in {ours}"

        # the dead job's lock is no obstacle: the requeued job trains on the run folder
        again = _cli("train", *TINY, "--training.steps=1", f"--metrics.run_dir={tmp_path}", "--metrics.run_name=n2")
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads((tmp_path / "n2" / "run.lock").read_text())["pid"] not in below[2]
    finally:
        for procs in below.values():
            for pid in _alive(procs):
                os.kill(pid, signal.SIGKILL)
        for proc in jobs.values():
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_plan_measure_stops_its_training_job_and_waits_for_it(tmp_path):
    # `plan --measure N` runs each candidate as a child job through _run_child; SIGTERM used to leave it training
    script = "import sys; from functitan.plan._measure import _run_child; _run_child(sys.argv[1:], 600)"
    cmd = [sys.executable, "-c", script, sys.executable, "-m", "functitan.cli", "train", *TINY]
    cmd += ["--training.steps=100000", f"--metrics.run_dir={tmp_path}", "--metrics.run_name=m"]
    log = tmp_path / "plan.log"
    with open(log, "wb") as err:
        planner = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=_env())
    try:
        _wait_for_metrics(tmp_path / "m", planner, log)
        below = _descendants(planner.pid)
        assert below, "no measured job"
        planner.send_signal(signal.SIGTERM)
        assert planner.wait(60) == 128 + signal.SIGTERM
        assert not _alive(below), "the planner exited before its measured job stopped"
        assert log.read_text().strip().splitlines()[-1] == "functitan plan: stopped by SIGTERM while measuring"
    finally:
        planner.kill()
        planner.wait()


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_torchrun_killed_or_a_second_signal_at_the_final_save_is_one_line_naming_the_newest_step(tmp_path):
    # a kill -9 of torchrun made the launcher exit 247 without a word; a second SIGTERM while the workers saved
    # printed torchrun's SignalException traceback and said nothing of the checkpoints
    ckpt = ("--checkpoint.enable=true", "--checkpoint.interval=2", "--nproc", "1")
    jobs = {
        name: _train(tmp_path, name, *ckpt, log=tmp_path / f"{name}.log", stdout=True) for name in ("kill", "twice")
    }
    try:
        for name, proc in jobs.items():
            deadline = time.monotonic() + 180
            while not _committed(tmp_path / name / "checkpoints"):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()
                time.sleep(0.2)
        torchrun = [p for p in _descendants(jobs["kill"].pid) if b"elastic._torchrun" in _cmdline(p)]
        os.kill(torchrun[0], signal.SIGKILL)
        jobs["twice"].send_signal(signal.SIGTERM)
        time.sleep(0.05)
        jobs["twice"].send_signal(signal.SIGTERM)  # while the worker finishes its step and saves
        codes = {name: proc.wait(60) for name, proc in jobs.items()}
    finally:
        for proc in jobs.values():
            proc.kill()
            proc.wait()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in jobs}
    newest = {name: _committed(tmp_path / name / "checkpoints")[-1] for name in jobs}
    assert codes["kill"] == 128 + signal.SIGKILL, logs["kill"][-3000:]
    assert logs["kill"].strip().splitlines()[-1] == (
        f"functitan: error: torchrun (pid {torchrun[0]}) was killed by SIGKILL, and its workers with it; the newest "
        f"checkpoint is step {newest['kill']} ({tmp_path}/kill/checkpoints/{newest['kill']})"
    )
    assert "Traceback" not in logs["twice"], logs["twice"][-3000:]
    last = logs["twice"].strip().splitlines()[-1]
    if codes["twice"] == 0:  # the worker saved before torchrun went down: its own line says where
        assert f"checkpoint saved in {tmp_path}/twice/checkpoints/{newest['twice']};" in last, last
    else:
        assert codes["twice"] == 128 + signal.SIGTERM, logs["twice"][-3000:]
        assert last == (
            "functitan: stopped by SIGTERM (and 1 more) before every worker saved (0 of 1 did); the newest checkpoint "
            f"is step {newest['twice']} ({tmp_path}/twice/checkpoints/{newest['twice']})"
        )


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _flock_free(path: Path) -> bool:
    import fcntl

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_lock_left_by_a_dead_job_is_taken_over_and_released_at_the_end(tmp_path):
    # the kernel drops an flock with its holder; the file may still name the dead job: it is rewritten, not obeyed
    from functitan.checkpoint import lock_run

    (tmp_path / "run.lock").write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname().nodename}))
    with lock_run(tmp_path):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        assert not _flock_free(tmp_path / "run.lock")  # held: another job's flock fails
    assert _flock_free(tmp_path / "run.lock")


# ------------------------------------------------------------------------------------------ 3. checkpoint lag


def _slow_writes(monkeypatch, seconds: float) -> None:
    """Every save's write takes ``seconds`` longer (a loaded host, a slow file system)."""
    from functitan.checkpoint._orbax import OrbaxFormat

    write = OrbaxFormat.write

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return write(*args, **kwargs)

    monkeypatch.setattr(OrbaxFormat, "write", slow)


def _trails(mgr, steps: int) -> list[int]:
    """Run ``steps`` quick steps saving through ``mgr``; how far the newest commit trails each step."""
    import torch

    state, trails = {"w": torch.zeros(8)}, []
    for step in range(1, steps + 1):
        time.sleep(0.02)  # the step
        state = {"w": state["w"] + 1}
        mgr.maybe_save(state, step=step, force=step == steps)
        trails.append(step - (mgr.latest_step() or 0))
    mgr.close()
    return trails


def test_a_slow_save_holds_the_loop_so_the_newest_commit_trails_by_at_most_one_interval_plus_the_save(
    tmp_path, monkeypatch
):
    from functitan.checkpoint import CheckpointManager

    _slow_writes(monkeypatch, 0.5)  # a save writes for 25 steps
    interval = 2
    waits = CheckpointManager(tmp_path / "wait", interval=interval, keep_last=2)
    assert max(_trails(waits, 12)) <= 2 * interval - 1  # one interval, plus the save in flight
    assert waits.pop_wait_s() > 5 * 0.4 and waits.pop_wait_s() == 0.0  # 5 saves waited for the one before

    # when_busy="skip": the loop never waits for a save it could skip; the commit trails further instead
    skips = CheckpointManager(tmp_path / "skip", interval=interval, keep_last=2, when_busy="skip")
    trails = _trails(skips, 12)
    assert skips.skipped == [4, 6, 8, 10] and max(trails) == 11  # step 2's save committed with the last
    assert skips.all_steps() == [2, 12]

    # the trainer shows the time waited since the previous line (a line is written before its step's save)
    from functitan.train import main

    args = [*TINY, "--training.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=1"]
    assert main([*args, f"--metrics.run_dir={tmp_path}", "--metrics.run_name=t"]) == 0
    records = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    waited = [r["checkpoint_wait_s"] for r in records]
    assert len(waited) == 4 and waited[:2] == [0.0, 0.0] and all(w > 0.3 for w in waited[2:]), waited


# ------------------------------------------------------------------------------------------ 4. user errors


def _bad_inputs(d: Path) -> None:
    """The files the bad commands below point at."""
    (d / "bin.dat").write_bytes(b"ok\x00\xff\xfe binary \x80")
    (d / "data").mkdir()
    (d / "data" / "notes.txt").write_text("text " * 1000)
    (d / "data" / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0 a jpeg")
    (d / "good.txt").write_text("some text\n")
    (d / "syntax.py").write_text("def loss(:\n")
    (d / "three.py").write_text("MODEL = 3\n")
    (d / "binary.toml").write_bytes(b"\xff\xfe\x00[training]")
    hf = d / "hf"
    hf.mkdir()
    hf_config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
    hf_config |= {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256}
    (hf / "config.json").write_text(json.dumps(hf_config))
    (hf / "model.safetensors").write_bytes(b"\x13\x00\x00\x00\x00\x00\x00\x00not json, not tensors")
    (d / "ck" / "default").mkdir(parents=True)
    (d / "ck" / "default" / "_METADATA").write_text("{}")


BAD_INPUTS = {  # the command as typed ({d}: a folder of bad files) -> what its one line must contain
    "train --data.paths {d}/bin.dat": "{d}/bin.dat: byte 0xff at offset 3 (line 1) is not UTF-8; it is not a text "
    "file (remove it from data.paths, or convert it to UTF-8)",
    "train --data.paths {d}/data": "{d}/data/photo.jpg: byte 0xff at offset 0",  # a folder holding one
    "gradcheck --batch 0": "--batch=0: must be >= 1 (--batch is training.batch_size)",
    "rendezvous --port 70000": "--port=70000: a TCP port is 0..65535, e.g. 29400",
    "pipeline show --schedule 1f1b --pp 100000 --microbatches 100000": "--pp 100000 --microbatches 100000: "
    "10000000000 rank-microbatches is more than the 16384 a timeline shows; lower --pp or --microbatches",
    "train --model.name={d}/syntax.py": "model.name='{d}/syntax.py': a syntax error at line 1",
    "train --model.name={d}/three.py": "model.name='{d}/three.py' resolves to a int, not a functitan.model.Model; "
    "assign `MODEL = functitan.model.Model(...)` there",
    "import hf {d}/hf {d}/imported": "{d}/hf/model.safetensors is not a readable safetensors file (",
    "plan --device cpu --out /sys/functitan-test/plan.toml": "--out /sys/functitan-test/plan.toml: cannot write in "
    "/sys/functitan-test (",
    "train --config {d}/binary.toml": "config file '{d}/binary.toml' is not a text file (byte 0xff at offset 0 is "
    "not UTF-8); pass a TOML file such as configs/debug.toml",
    "train --training.steps": "--training.steps needs a value, e.g. --training.steps=VALUE",
    "train --config": "--config needs a value, e.g. --config=configs/debug.toml",
    "plan --device cpu --seq-len 0": "--seq-len=0: must be >= 1 (--seq-len is training.seq_len)",
    "data prepare {d}/good.txt --out {d}/shards --workers 0": "--workers=0: must be >= 1 (omit it for one per CPU)",
    "export hf {d}/ck {d}/exported --max-shard-bytes -5": "--max-shard-bytes=-5: must be >= 1",
    "trian": "unknown command 'trian'; did you mean 'train'?",
    "train --data.max_corpus_bytes=-1": "data.max_corpus_bytes=-1: must be >= 1",
    "pipeline shwo": "functitan: error: unknown command 'shwo' of functitan pipeline; did you mean 'show'?",
    "data prepaer": "functitan: error: unknown command 'prepaer' of functitan data; did you mean 'prepare'?",
    "export hff {d}/ck {d}/exported": "functitan: error: unknown command 'hff' of functitan export; did you mean 'hf'?",
    "import hff {d}/hf {d}/imported": "functitan: error: unknown command 'hff' of functitan import; did you mean 'hf'?",
    # 4 TB for one weight: refused from the declared shapes, before init allocates
    "train --model.dim=1048576": "model.dim=1048576: the model (llama, 6,598,421,381,120 params) needs 26.4 TB to "
    "initialise its fp32 parameters, and this host has ",
    "rendezvous --host nosuch.invalid": "cannot listen on nosuch.invalid:29400: the host 'nosuch.invalid' does not "
    "resolve",
    "rendezvous --host 192.0.2.1 --port 0": "cannot listen on 192.0.2.1:0: 192.0.2.1 (192.0.2.1) is not an address "
    "of this machine; pick another --port",
    "train --nnodes 1 --rdzv-endpoint nosuch.invalid:29400 --rdzv-id r --rdzv-conf read_timeout=1": "functitan: "
    "error: --rdzv-endpoint=nosuch.invalid:29400: no rendezvous store there within 1 s: the host 'nosuch.invalid' "
    "does not resolve",
}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    _bad_inputs(d)
    return d


@pytest.mark.parametrize("command", list(BAD_INPUTS))
def test_each_bad_input_is_one_line_and_exit_code_2(command, bad_files, capsys, monkeypatch):
    from functitan.cli import main

    if command.startswith("plan") and "/sys/" in command and os.access("/sys", os.W_OK | os.X_OK):
        with contextlib.suppress(OSError):
            os.rmdir(tempfile.mkdtemp(dir="/sys"))
            pytest.skip("needs an unwritable directory (/sys)")
    monkeypatch.chdir(bad_files / "ck")  # a train that got past its checks would write runs/ here
    argv = [a.format(d=bad_files) for a in command.split()]
    if argv[0] == "train":  # the tiny model, unless the command says otherwise (a later value wins)
        argv[1:1] = [*TINY, "--training.steps=1"]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err[-3000:])
    (line,) = err.splitlines()  # one line, no traceback
    assert line.startswith("functitan"), line
    assert BAD_INPUTS[command].format(d=bad_files) in line, line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_misspelt_command_suggests_the_command(command, capsys):  # and the subcommands: BAD_INPUTS
    from functitan.cli import main

    typo = command + command[-1]  # a letter typed twice: trainn, rendezvouss, ...
    assert main([typo]) == 2
    assert capsys.readouterr().err == (
        f"functitan: error: unknown command {typo!r}; did you mean {command!r}? (functitan --help)\n"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_in_use_or_no_store_at_the_rendezvous_endpoint_is_one_line_within_the_bound(capsys):
    # torchrun waited 111 s on an endpoint nobody answered on, then printed a traceback; rendezvous on a port
    # in use printed C++ stack frames after its one line
    import socket

    from functitan.cli import main

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["rendezvous", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (
        f"functitan: error: cannot listen on 0.0.0.0:{port}: port {port} is in use on this machine (by "
        "another program or another store); pick another --port, or a --host address of this machine (default "
        "0.0.0.0: all of them)\n"
    )
    nobody = _free_port()
    t0 = time.monotonic()
    rdzv = [
        "--nnodes",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{nobody}",
        "--rdzv-id",
        "r",
        "--rdzv-conf",
        "read_timeout=1",
    ]
    assert main(["train", *TINY, "--nproc", "2", *rdzv]) == 2
    assert time.monotonic() - t0 < 5
    assert capsys.readouterr().err == (
        f"functitan: error: --rdzv-endpoint=127.0.0.1:{nobody}: no rendezvous store there within 1 s: nothing "
        f"listens on port {nobody} of 127.0.0.1; start `functitan rendezvous --port {nobody}` on 127.0.0.1 first (or "
        "fix the address; --rdzv-conf read_timeout=SECONDS waits longer)\n"
    )


def test_a_fallback_warning_is_one_line_without_the_source_line(tmp_path, capsys):
    # warnings.warn's format printed `warnings.warn(` and the file:line of the trainer under the message
    import warnings

    import torch

    from functitan.checkpoint import CheckpointManager
    from functitan.errors import user_errors_exit

    state = {"w": torch.arange(4.0)}
    with CheckpointManager(tmp_path, interval=1, keep_last=2, async_save=False) as mgr:
        for step in (1, 2):
            mgr.maybe_save(state, step=step)
    (tmp_path / "2" / "default" / "_COMMIT").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert (
            user_errors_exit(
                lambda: 0 if CheckpointManager(tmp_path, interval=1, keep_last=2).restore_latest(state) else 1
            )
            == 0
        )
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"functitan: warning: checkpoint step 2 in {tmp_path} is damaged ("), line
    assert line.endswith("restored step 1 instead (a damaged step is saved again when the run reaches it)"), line


def test_a_full_disk_during_a_save_is_one_line_naming_the_checkpoint_folder(tmp_path, capsys, monkeypatch):
    # the device fills up while step 2 saves (the writer's ENOSPC), after step 1 committed
    import errno

    from functitan.checkpoint import _fastwrite
    from functitan.cli import main

    write = _fastwrite.write_block

    def fills_up(path, *args, **kwargs):
        if f"{os.sep}2.tmp-" in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write(path, *args, **kwargs)

    monkeypatch.setattr(_fastwrite, "write_block", fills_up)
    args = [*TINY, "--training.steps=3", "--checkpoint.enable=true", "--checkpoint.interval=1"]
    assert main(["train", *args, f"--metrics.run_dir={tmp_path}", "--metrics.run_name=full"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    root = tmp_path / "full" / "checkpoints"
    assert line.startswith(f"functitan: error: saving checkpoint {root}/2: no space left on the device of {root} ("), (
        line
    )
    assert line.endswith(
        "the committed steps are untouched: free space (or lower checkpoint.keep_last, or point checkpoint.folder "
        "at a larger disk) and run the same command to resume"
    ), line
    assert sorted(p.name for p in root.iterdir() if p.name.isdigit()) == ["1"]


def _train_on_a_disk_that_fills_up(argv: list[str], error_dir: str) -> tuple[int, str]:
    """On a pool rank: ``functitan train`` while the disk fills up during step 2's save, seen by rank 0 only
    (rank 1's shards fit), then by TensorBoard's event writer. ``(exit code, what the rank printed on stderr)``."""
    import contextlib
    import errno
    import io

    import torch.distributed as dist
    from tensorboard.summary.writer import record_writer

    from functitan.checkpoint import _fastwrite
    from functitan.cli import main

    os.environ["FUNCTITAN_ERROR_DIR"] = error_dir
    write, record = _fastwrite.write_block, record_writer.RecordWriter.write
    full = dist.get_rank() == 0 and []

    def fills_up(path, *args, **kwargs):
        if full is not False and f"{os.sep}2.tmp-" in path:
            full.append(path)
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write(path, *args, **kwargs)

    def events(self, data):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return record(self, data)

    _fastwrite.write_block, record_writer.RecordWriter.write = fills_up, events
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = main(["train", *argv])
    finally:
        _fastwrite.write_block, record_writer.RecordWriter.write = write, record
    return code, err.getvalue()


def test_a_full_disk_seen_by_one_of_two_ranks_is_the_same_line_on_both_and_no_traceback(tmp_path, gloo):
    # rank 1 waited at the commit barrier and failed naming no path; TensorBoard's writer thread printed a traceback
    run = tmp_path / "full"
    argv = [*TINY, "--parallelism.dp_shard=2", "--training.steps=2", "--checkpoint.enable=true"]
    argv += ["--checkpoint.interval=1", f"--metrics.run_dir={tmp_path}", "--metrics.run_name=full"]
    (code0, err0), (code1, err1) = gloo.run(_train_on_a_disk_that_fills_up, 2, argv, str(tmp_path), timeout=300)
    assert (code0, code1) == (2, 2), (err0[-3000:], err1[-3000:])
    root = run / "checkpoints"
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    # each rank reads the free space itself (on several nodes, of its own disk): it may differ by a megabyte here
    same = {re.sub(r"\(\d+ MB free", "(N MB free", line) for line in lines}
    assert len(same) == 1, lines
    assert lines[0].startswith(f"saving checkpoint {root}/2: no space left on the device of {root} ("), lines[0]
    assert "MB free; this save writes about " in lines[0] and "the committed steps are untouched" in lines[0]
    for err in (err0, err1):  # the one line, no writer thread's traceback, no message naming no path
        assert err.strip() == "functitan: error: " + lines[0].strip(), err[-3000:]
    assert sorted(p.name for p in root.iterdir() if p.name.isdigit()) == ["1"]


# ------------------------------------------------------------------------------------------ 5. metadata integrity


@pytest.mark.parametrize("damaged", ["params.w/zarr.json", "_METADATA"])
def test_a_same_size_edit_of_a_metadata_file_is_damage_and_falls_back(tmp_path, damaged):
    # a shape edited in place (same size) passed the size check and was blamed on the model config
    import torch

    from functitan.checkpoint import CheckpointManager

    state = {"params": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 0}
    with CheckpointManager(tmp_path, interval=1, keep_last=2, async_save=False) as mgr:
        for step in (1, 2):
            mgr.maybe_save({**state, "step": step}, step=step)
    target = tmp_path / "2" / "default" / damaged
    text = target.read_text()
    edited = text.replace("3", "4", 1) if damaged != "_METADATA" else text.replace('"step"', '"stap"', 1)
    assert edited != text and len(edited) == len(text)
    target.write_text(edited)
    with pytest.warns(RuntimeWarning) as warned:
        restored = CheckpointManager(tmp_path, interval=1, keep_last=2).restore_latest(state)
    assert restored["step"] == 1  # the older, intact step
    (message,) = [str(w.message) for w in warned]
    assert f"{target} does not match its checksum in {tmp_path}/2/default/_COMMIT: the file is corrupted" in message


def _blocked_on_a_peer_that_failed(timeout_s: float) -> float | None:
    """Two ranks on a torchft gloo group; rank 1 waits in an allreduce that rank 0 never joins: its collective
    failed and it left for the next quorum (functitan.elastic.live). Rank 0 hangs up; rank 1 returns how long
    its wait lasted."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    import torchft

    from functitan.elastic.live import LiveStepper

    rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
    pg.configure(f"127.0.0.1:{port[0]}/hangup", f"r{rank}", rank, 2)
    x = torch.ones(1024)
    pg.allreduce([x], dist.AllreduceOptions()).wait()  # connected
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)
        LiveStepper._hang_up(SimpleNamespace(_pg=pg))  # type: ignore[arg-type]
        dist.barrier()
        return None
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection closed by peer|Connection reset"):
        pg.allreduce([x], dist.AllreduceOptions()).wait()
    waited = time.monotonic() - t0
    dist.barrier()
    return waited


def test_a_live_group_whose_collective_failed_hangs_up_so_a_peer_blocked_on_it_fails_at_once(gloo):
    # CI: a survivor of a SIGKILL waited out elastic.timeout_s (30 s) in a ring allreduce on the other survivor,
    # which had failed fast and gone to a quorum that needed the blocked one (1 of 6 kills on loopback)
    pytest.importorskip("torchft")
    _, waited = gloo.run(_blocked_on_a_peer_that_failed, 2, 20.0, timeout=120)
    assert waited < 6, waited  # about the 1 s before the hang-up; gloo's abort alone waited the full 20 s
