"""mkdocs hook: an API reference page per public module of functitan, and a nav entry per notebook.

Pages are generated, not written: every public module (``functitan``, each subpackage, each module whose
name does not start with ``_``) gets ``api/<module>.md`` holding one mkdocstrings directive, so a new module
appears in the reference without touching the docs. Notebooks are ``examples/*.ipynb`` (docs/examples links
there), rendered by mkdocs-jupyter from their committed outputs.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "functitan"


def public_modules() -> list[str]:
    """``functitan``, its subpackages and its public modules, in a reading order: package, then by name."""
    names = ["functitan"]
    for path in sorted(PACKAGE.iterdir()):
        if path.name.startswith("_"):
            continue
        if path.is_dir() and (path / "__init__.py").is_file():
            names.append(f"functitan.{path.name}")
        elif path.suffix == ".py":
            names.append(f"functitan.{path.stem}")
    return names


def notebooks() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.ipynb"))


def _title(path: Path) -> str:
    import json

    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            first = "".join(cell["source"]).lstrip().splitlines()[0]
            return first.lstrip("# ").strip()
    return path.stem


def on_config(config, **kwargs):
    nav = list(config.nav or [])
    nav.append({"Notebooks": [{_title(p): f"examples/{p.name}"} for p in notebooks()]})
    nav.append({"API reference": [{m: f"api/{m}.md"} for m in public_modules()]})
    config.nav = nav
    return config


def on_files(files, config, **kwargs):
    for module in public_modules():
        content = f"# `{module}`\n\n::: {module}\n"
        files.append(File.generated(config, f"api/{module}.md", content=content))
    return files
