"""The documentation site builds with --strict, its API reference documents every public name and shows the
docstrings' code as code, and the site works opened as a file (links, search)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

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
        page = (site / "api" / f"{module}.html").read_text(encoding="utf-8")
        ids = set(re.findall(r'id="([\w.]+)"', page))
        missing = [n for n in names if f"{module}.{n}" not in ids]
        assert not missing, f"{module}: public names without an API entry: {missing}"


def test_guides_and_notebooks_are_pages(site):
    for page in (
        "index.html",
        "parallelism.html",
        "pipeline.html",
        "checkpoints.html",
        "reports.html",
    ):
        assert (site / page).is_file(), page
    for nb in notebooks():
        html = (site / "examples" / f"{nb.stem}.html").read_text(encoding="utf-8")
        assert "data:image/png;base64," in html, f"{nb.name}: the rendered page shows no committed plot"
    assert (site / "report_screenshot.png").is_file()


class _Page(HTMLParser):
    """A built page: the text outside code of each paragraph-like element, block quotes nested in block quotes
    (what Markdown makes of a doctest's ``>>>``), and the scripts and links it loads."""

    TEXT = {"p", "li", "dd", "dt", "td", "th", "summary"}
    CODE = {"pre", "code", "script", "style"}

    def __init__(self, path: Path) -> None:
        super().__init__(convert_charrefs=True)
        self.code = self.quotes = self.nested_quotes = 0
        self.open: list[list[str]] = []  # the text of each open TEXT element
        self.texts: list[str] = []
        self.refs: list[str] = []  # script src, link and anchor href
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.code += tag in self.CODE
        if tag == "blockquote":
            self.quotes += 1
            self.nested_quotes += self.quotes > 1
        if tag in self.TEXT:
            self.open.append([])
        ref = attrs.get("src" if tag == "script" else "href") if tag in ("script", "link", "a") else None
        if ref:
            self.refs.append(ref)

    def handle_endtag(self, tag):
        self.code -= tag in self.CODE
        self.quotes -= tag == "blockquote"
        if tag in self.TEXT and self.open:
            text = "".join(self.open.pop())
            self.texts.append(text)
            if self.open:
                self.open[-1].append(text)

    def handle_data(self, data):
        if not self.code and self.open:
            self.open[-1].append(data)


def test_api_pages_show_no_raw_rest_markup(site):
    """A docstring's reST literal block (``Text::`` + an indented block) and its doctests (``>>>``) are code
    blocks on the API pages: as plain Markdown the ``::`` shows and ``>>>`` becomes three nested block quotes
    around one paragraph (docs/_hooks/docstring_blocks.py fences them)."""
    raw = []
    for module in public_modules():
        page = _Page(site / "api" / f"{module}.html")
        raw += [f"{module}: a raw '::' in {t.strip()[-90:]!r}" for t in page.texts if t.rstrip().endswith("::")]
        raw += [f"{module}: '>>>' outside a code block in {t.strip()[:90]!r}" for t in page.texts if ">>>" in t]
        if page.nested_quotes:
            raw.append(f"{module}: {page.nested_quotes} block quotes in block quotes (a doctest read as Markdown)")
    assert not raw, "\n".join(raw)
    # and the doctests are there, as highlighted Python sessions
    pipeline = (site / "api" / "functitan.pipeline.html").read_text(encoding="utf-8")
    assert '<span class="gp">&gt;&gt;&gt; </span>' in pipeline


def test_search_and_links_work_from_the_file_as_the_readme_says(site):
    """The README says to open ``site/index.html``. A file:// page can neither fetch search_index.json nor start a
    Web Worker, and a link to ``dir/`` shows a directory listing: the theme loads ``search/search_index.js`` with
    a script tag instead (the offline plugin writes it), a local iframe-worker shim stands in for the worker,
    and every link, script and stylesheet of every page is a file of the site or a web address."""
    assert "open `site/index.html`" in (ROOT / "README.md").read_text(encoding="utf-8")
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    script = (site / "search" / "search_index.js").read_text(encoding="utf-8")
    assert script.startswith("var __index = ") and json.loads(script.removeprefix("var __index = ")) == index
    assert any(doc["location"].startswith("api/functitan.optim.html") for doc in index["docs"])
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")  # 404.html: for a server only
    assert len(pages) > len(public_modules())
    broken = []
    for path in pages:
        page = _Page(path)
        scripts = [r for r in page.refs if r.endswith(".js")]
        if not any(r.endswith("assets/javascripts/iframe-worker-shim.js") for r in scripts):
            broken.append(f"{path.relative_to(site)}: no iframe-worker shim (search needs a worker)")
        for ref in page.refs:
            url = urlsplit(ref)
            if url.scheme or not url.path:  # a web address, mailto:, data:, or an anchor on the page
                continue
            if not (path.parent / unquote(url.path)).is_file():
                broken.append(f"{path.relative_to(site)}: {ref} is not a file of the site")
        bundle = next(r for r in scripts if "/bundle." in r or r.startswith("bundle."))
        assert "search/search_index.js" in (path.parent / bundle).read_text(encoding="utf-8")
    assert not broken, "\n".join(broken[:20])


_CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


@pytest.mark.skipif(_CHROMIUM is None, reason="no Chromium to open the site with")
def test_search_finds_pages_in_a_browser_from_a_file_url(site, tmp_path):
    """The site opened as a file in headless Chromium: ``?q=`` types a query into the search box, and the results
    list the page and its entry (before the fix the theme hid the search box, its worker refused on file://)."""
    assert _CHROMIUM is not None
    url = (site / "api" / "functitan.optim.html").as_uri() + "?q=adamw"
    argv = [_CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}"]
    proc = subprocess.run(
        [*argv, "--virtual-time-budget=10000", "--dump-dom", url], capture_output=True, text=True, timeout=120
    )
    dom = proc.stdout
    assert 'data-md-component="search"' in dom, proc.stderr[-2000:]
    assert not re.search(r'<div class="md-search"[^>]*\bhidden\b', dom), "the search box is hidden"
    assert re.search(r"md-search-result__meta\">\d+ matching document", dom), "no search results"
    assert "functitan.optim.html?h=adamw#functitan.optim.adamw" in dom
