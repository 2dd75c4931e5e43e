"""The README and docs/: every relative link resolves, the README stays short, and every
generated section has its markers in the page render_readme.py writes it to.

Reads text files only (no torch), so it runs in well under a second.
"""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RENDER = ROOT / "benchmarks" / "render_readme.py"
README_MAX_LINES = 220

# An sdist carries tests/ but neither docs/ nor benchmarks/: nothing to check there.
pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="no docs/ in this tree")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
MARKER = re.compile(r"<!-- ([A-Z0-9-]+):(START|END) -->")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """``text`` without code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lowercased, punctuation dropped
    (hyphens and underscores kept), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(match.group(2))
        # GitHub numbers repeated headings: name, name-1, name-2...
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    return problems


def render_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_readme", RENDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; keep it under {README_MAX_LINES} and move depth to docs/"
    )


def test_slug_matches_github() -> None:
    assert slug("The `flashspec` command") == "the-flashspec-command"
    assert slug("HTTP server (OpenAI-compatible)") == "http-server-openai-compatible"
    assert slug("Where the model's time goes: the ablation") == (
        "where-the-models-time-goes-the-ablation"
    )


@pytest.mark.skipif(not RENDER.exists(), reason="no benchmarks/ in this tree")
def test_every_generated_section_has_its_markers() -> None:
    targets: dict[str, Path] = render_module().PAGES
    for tag, page in targets.items():
        text = page.read_text()
        for end in ("START", "END"):
            marker = f"<!-- {tag}:{end} -->"
            assert text.count(marker) == 1, f"{page.name} needs {marker} exactly once"
        assert text.index(f"<!-- {tag}:START -->") < text.index(f"<!-- {tag}:END -->")
    # A marker no entry of PAGES names would never be rendered: its table would go stale.
    for page in pages():
        for tag, _ in MARKER.findall(prose(page.read_text())):
            assert targets.get(tag) == page, f"{page.name}: {tag} is not rendered into it"
