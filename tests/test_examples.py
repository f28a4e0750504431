"""The scripts under examples/ run (CI runs them through this test)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_print_layouts_example():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "print_layouts.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "layers.0.attn.wq             (dp_shard=Shard(dim=1), tp=Shard(dim=0))" in out.stdout
    doc = (ROOT / "docs" / "parallelism.md").read_text()
    shown = doc.split("`python examples/print_layouts.py`", 1)[1].split("```\n", 2)[1]
    assert shown.strip() == out.stdout.strip()  # docs/parallelism.md shows what the example prints


def test_ensemble_example():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ensemble.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ensemble losses:" in out.stdout and "per-example gradient norms:" in out.stdout


def test_plan_then_train_example():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan_then_train.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "recommended:" in out.stdout and "[parallelism]" in out.stdout
    assert "20 steps, first loss" in out.stdout
