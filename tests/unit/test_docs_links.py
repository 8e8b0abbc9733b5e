"""Every relative link of README.md and of the examples' READMEs points to a file that exists,
and to a heading of it where an anchor is given (GitHub's slug), so those links cannot rot.
The docs site itself is checked by ``mkdocs build --strict`` (.ci/run)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "examples").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans: links there are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    text = prose(path.read_text())
    return INLINE.findall(text) + REFERENCE.findall(text)


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//", target)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (letters,
    digits, ``_`` and ``-`` kept), each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file: its headings' slugs, repeats numbered as GitHub does."""
    found: set[str] = set()
    text = FENCE.sub("", path.read_text())
    for match in re.finditer(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", text, re.MULTILINE):
        base = slug(match[1])
        name, n = base, 0
        while name in found:
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


CASES = [(page, target) for page in PAGES for target in links(page) if is_relative(target)]


def test_the_pages_have_relative_links_to_check():
    assert any(page.name == "README.md" and page.parent == ROOT for page, _ in CASES)


@pytest.mark.parametrize(
    ("page", "target"), CASES, ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in CASES]
)
def test_a_relative_link_points_to_an_existing_file_and_heading(page, target):
    file_part, _, anchor = target.partition("#")
    linked = (page.parent / unquote(file_part)).resolve() if file_part else page
    assert linked.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
    assert linked.is_relative_to(ROOT), f"{page.relative_to(ROOT)}: {target} leaves the repo"
    if anchor:
        assert linked.suffix == ".md", f"{page.relative_to(ROOT)}: an anchor into {linked.name}"
        assert unquote(anchor) in anchors(linked), (
            f"{page.relative_to(ROOT)}: {target}: no heading {anchor!r} in {linked.name}"
        )
