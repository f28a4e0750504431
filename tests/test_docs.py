"""The documentation site builds with --strict, and its API reference documents every public name."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings_handlers.python")
pytest.importorskip("mkdocs_jupyter")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
from generate import notebooks, public_modules  # noqa: E402  (the hook that generates the API pages)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {
        **os.environ,
        "NO_MKDOCS_2_WARNING": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return out


def test_every_public_name_has_an_api_entry(site):
    assert {
        "functitan",
        "functitan.optim",
        "functitan.pipeline",
        "functitan.checkpoint",
        "functitan.metrics",
        "functitan.data",
        "functitan.sharding",
        "functitan.mesh",
        "functitan.transforms",
    } <= set(public_modules())
    for module in public_modules():
        names = getattr(importlib.import_module(module), "__all__", [])
        page = (site / "api" / module / "index.html").read_text(encoding="utf-8")
        ids = set(re.findall(r'id="([\w.]+)"', page))
        missing = [n for n in names if f"{module}.{n}" not in ids]
        assert not missing, f"{module}: public names without an API entry: {missing}"


def test_guides_and_notebooks_are_pages(site):
    for page in (
        "index.html",
        "parallelism/index.html",
        "pipeline/index.html",
        "checkpoints/index.html",
        "reports/index.html",
    ):
        assert (site / page).is_file(), page
    for nb in notebooks():
        html = (site / "examples" / nb.stem / "index.html").read_text(encoding="utf-8")
        assert "data:image/png;base64," in html, f"{nb.name}: the rendered page shows no committed plot"
    assert (site / "report_screenshot.png").is_file()
