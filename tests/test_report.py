"""`functitan report`: PNG and HTML from runs' metrics.jsonl (written here by the trainer's own JsonlSink)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import pytest

from functitan.cli import main as cli_main
from functitan.metrics import JsonlSink
from functitan.metrics._report import DPI, FIGSIZE, ReportError, load_run, smooth, summarize

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")


def _write_run(run_dir, *, steps: int, lr: float, config: dict | None = None, eval_every: int = 0) -> None:
    sink = JsonlSink(run_dir / "metrics.jsonl")
    for step in range(2, steps + 1, 2):
        evaluated = {"eval/loss": 6.0 - step / 10, "eval/perplexity": math.exp(6.0 - step / 10)}
        sink.write(
            step,
            {
                **(evaluated if eval_every and step % eval_every == 0 else {}),
                "loss": 5.5 * math.exp(-step * lr * 30) + 0.1 * (step % 3),
                "grad_norm": 1 + 1 / step,
                "lr": lr,
                "tokens_per_s": 4000.0 + step,
                "tokens_per_s_per_device": 4000.0,
                "tflops": 0.1,
                "mfu": None if lr < 2e-3 else 40.0,
                "step_time_s": 0.5,
                "data_time_s": 0.001,
                "mem_max_rss_gib": 0.5 + step / 100,
            },
        )
    sink.close()
    if config is not None:
        import json

        (run_dir / "config.json").write_text(json.dumps(config))


def _pixels_std(path) -> float:
    import numpy as np

    return float(np.asarray(PIL.open(path).convert("L"), dtype=float).std())


def test_report_of_two_runs_writes_png_and_html(tmp_path, capsys):
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    a.mkdir(parents=True), b.mkdir(parents=True)
    _write_run(a, steps=30, lr=3e-3, config={"optimizer": {"lr": 3e-3}, "training": {"steps": 30}})
    _write_run(b, steps=20, lr=1e-3, config={"optimizer": {"lr": 1e-3}, "training": {"steps": 20}})

    assert cli_main(["report", str(a), str(b)]) == 0
    png, page = tmp_path / "runs" / "report.png", tmp_path / "runs" / "report.html"
    assert f"wrote {png}" in capsys.readouterr().out
    with PIL.open(png) as img:
        assert img.format == "PNG"
        assert img.size == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
    assert _pixels_std(png) > 20  # curves, text and a table, not a blank canvas

    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # self-contained: nothing fetched
    assert "data:image/png;base64," in text
    # summary rows: steps, final loss, median tokens/s; MFU n/a where the run had none; the differing config key
    rows = re.findall(r"<tr><td>(.*?)</td></tr>", text)
    assert rows[0].split("</td><td>")[:2] == ["a", "30"] and rows[1].split("</td><td>")[:2] == ["b", "20"]
    assert "optimizer.lr" in text and "training.steps" in text
    assert summarize(load_run(b))["median MFU %"] is None


def test_one_run_report_lands_in_the_run_dir_and_summary_is_right(tmp_path):
    _write_run(tmp_path, steps=10, lr=3e-3)
    assert cli_main(["report", str(tmp_path), "--smoothing", "0.5"]) == 0
    assert (tmp_path / "report.png").is_file() and (tmp_path / "report.html").is_file()
    row = summarize(load_run(tmp_path))
    assert row["steps"] == 10
    assert row["median tokens/s"] == 4006.0  # steps 2..10 -> 4002..4010
    assert row["median MFU %"] == 40.0
    assert row["peak memory GiB"] == pytest.approx(0.6)
    assert row["final loss"] == pytest.approx(5.5 * math.exp(-10 * 3e-3 * 30) + 0.1)
    assert row["final eval loss"] is None  # no [eval]: n/a in the table


def test_a_run_with_eval_reports_its_last_eval_loss_and_draws_it(tmp_path):
    """[eval] records (eval/loss every 4 steps) give the summary's final eval loss, in the HTML table too."""
    _write_run(tmp_path, steps=10, lr=3e-3, eval_every=4)
    assert summarize(load_run(tmp_path))["final eval loss"] == pytest.approx(6.0 - 8 / 10)
    assert cli_main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.html").read_text()
    assert "<th>final eval loss</th>" in text and "<td>5.2</td>" in text


def test_smooth_is_debiased_ema():
    assert smooth([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])
    assert smooth([0.0, 2.0], 0.5) == pytest.approx([0.0, 2 * 0.5 / 0.75])
    assert smooth([3.0, 4.0], 0.0) == [3.0, 4.0]


@pytest.mark.parametrize(
    "setup, message",
    [
        ("missing", "no such run directory"),
        ("empty_dir", "metrics.jsonl: not found"),
        ("empty_file", "no metrics yet"),
        ("bad_line", "metrics.jsonl:2: not a metrics record"),
    ],
)
def test_report_errors_are_one_named_line(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    if setup != "missing":
        run.mkdir()
    if setup == "empty_file":
        (run / "metrics.jsonl").write_text("")
    if setup == "bad_line":
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"loss": 1.0}\n')
    assert cli_main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("functitan: error: ") and message in err and err.count("\n") == 1
    with pytest.raises(ReportError, match=re.escape(message)):
        load_run(run)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="no Chromium on this machine (Debian: apt-get install chromium)")
def test_html_report_renders_in_headless_chromium(tmp_path):
    _write_run(tmp_path, steps=30, lr=3e-3)
    assert cli_main(["report", str(tmp_path)]) == 0
    shot = tmp_path / "shot.png"
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1200,1600",
        (tmp_path / "report.html").as_uri(),
    ]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    with PIL.open(shot) as img:
        assert img.size == (1200, 1600)
        # the inline image decoded and drew: some rows deep in the page (the curves) are not uniform
        import numpy as np

        pixels = np.asarray(img.convert("L"), dtype=float)
    assert pixels.std() > 20
    assert pixels[600:1500].std() > 20  # below the tables: the inline PNG
