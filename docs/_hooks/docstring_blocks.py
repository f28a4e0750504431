"""griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): reST code blocks in docstrings -> fenced code.

The docstrings are Google style read as Markdown, but many hold two reST forms that Markdown renders raw:

- a literal block: a paragraph ending in ``::``, a blank line and an indented block. Markdown keeps the ``::``
  as text (and shows the block unhighlighted);
- a doctest block: lines starting with ``>>>``. Markdown reads ``>>>`` as three nested block quotes and runs
  the session's lines and output into one paragraph.

Each becomes a fenced block (``pycon`` for a doctest, ``python`` for code that parses, ``text`` otherwise) and
``Paragraph::`` becomes ``Paragraph:`` as in reST, so the docstrings stay doctests that ``python -m doctest``
and reST tools read, and the site shows them as code. Fenced blocks already in a docstring are left alone.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

import griffe

_DOCTEST_FLAG = re.compile(r"\s*#\s*doctest:.*$")
# a section or admonition title ("Example:"), whose content must follow it without a blank line
_TITLE = re.compile(r"^\s*\w[\s\w-]*:\s*$")
# Google sections of "name: description" items: an item's lines are indented under it, so a block there is
# fenced where it stands (elsewhere at its paragraph's indent: four more spaces would make a Markdown code block)
_ITEM_SECTION = re.compile(
    r"^\s*((other |keyword |type )?(args|arguments|params|parameters)|raises|exceptions|returns|yields|receives"
    r"|attributes|functions|methods|classes|type aliases|modules|warns|warnings):\s*$",
    re.IGNORECASE,
)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _language(lines: list[str]) -> str:
    first = next((line for line in lines if line.strip()), "")
    if first.lstrip().startswith(">>>"):
        return "pycon"
    try:
        ast.parse(textwrap.dedent("\n".join(lines)))
    except SyntaxError:
        return "text"
    return "python"


def _fence(block: list[str], indent: int, language: str) -> list[str]:
    body = textwrap.dedent("\n".join(block)).split("\n")
    if language == "pycon":
        body = [_DOCTEST_FLAG.sub("", line) if line.lstrip().startswith((">>>", "...")) else line for line in body]
    pad = " " * indent
    return [f"{pad}```{language}", *[f"{pad}{line}" if line.strip() else "" for line in body], f"{pad}```"]


def convert(text: str) -> str:
    """``text`` (a cleaned docstring) with its reST literal and doctest blocks as fenced code blocks."""
    lines = text.split("\n")
    out: list[str] = []
    fence: str | None = None  # the marker of an open fenced block
    items_at: int | None = None  # the indent of the item section the line is in
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if fence is not None:
            out.append(line)
            if stripped.startswith(fence):
                fence = None
            i += 1
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            out.append(line)
            i += 1
            continue
        if stripped and _ITEM_SECTION.match(line):
            items_at = _indent(line)
        elif stripped and items_at is not None and _indent(line) <= items_at:
            items_at = None

        if stripped.endswith("::"):
            # a literal block: blank line(s), then lines indented deeper than the paragraph
            indent = _indent(line)
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j > i + 1 and j < len(lines) and _indent(lines[j]) > indent:
                end = j
                while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
                    end += 1
                while not lines[end - 1].strip():
                    end -= 1
                block = lines[j:end]
                head = line.rstrip()[:-2]  # "Text::" -> "Text:", "Text ::" -> "Text", "::" -> nothing
                if head.strip():
                    out.extend([head.rstrip() if head[-1].isspace() else f"{head}:", ""])
                at = indent if items_at is None else min(_indent(b) for b in block if b.strip())
                out.extend(_fence(block, at, _language(block)))
                if end < len(lines) and lines[end].strip():
                    out.append("")
                i = end
                continue

        if stripped.startswith(">>>"):
            # a doctest block: up to the first blank line (or a line less indented than its prompt)
            indent = _indent(line)
            end = i
            while end < len(lines) and lines[end].strip() and _indent(lines[end]) >= indent:
                end += 1
            at = indent
            if out and not out[-1].strip():
                above = next((prev for prev in reversed(out) if prev.strip()), None)
                if items_at is None and above is not None and indent >= _indent(above) + 4:
                    at = _indent(above)  # a reST block quote (in Markdown: an indented code block)
            elif out and not _TITLE.match(out[-1]):
                out.append("")  # right under a line of text: the fence starts a block of its own
            out.extend(_fence(lines[i:end], at, "pycon"))
            if end < len(lines) and lines[end].strip():
                out.append("")
            i = end
            continue

        out.append(line)
        i += 1
    return "\n".join(out)


class DocstringBlocks(griffe.Extension):
    """Rewrite every docstring as it is loaded (idempotent: a converted docstring has nothing left to convert)."""

    def _convert(self, obj: griffe.Object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        self._convert(obj)

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        self._convert(obj)
