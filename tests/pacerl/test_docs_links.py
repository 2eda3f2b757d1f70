"""The README and the pages under docs/: every relative link (and image) points at a file of the
repository, every `#anchor` at a heading of its page (as GitHub spells heading anchors), and the README
stays a front door of at most 250 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _unfenced(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (CommonMark: a backtick fence's info string holds no
    backtick, and a closing fence is at least as long as its opening one, with nothing after it)."""
    lines, fence = [], ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence:
            closing = match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)
            if closing and match and not match.group(2).strip():
                fence = ""
        elif match and not (match.group(1)[0] == "`" and "`" in match.group(2)):
            fence = match.group(1)
        else:
            lines.append(line)
    return lines


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, with inline code spans removed."""
    return [_INLINE_CODE.sub("", line) for line in _unfenced(text)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the text of links and code kept, lower case, punctuation and
    symbols dropped (letters of any script, digits, `_`, `-` and spaces kept), spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of `page`, repeated headings numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _unfenced(page.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    return [m.group(1) for line in _prose(page.read_text(encoding="utf-8")) for m in _LINK.finditer(line)]


def test_slug_follows_githubs_spelling() -> None:
    assert slug("8b. Composing the losses in a learner") == "8b-composing-the-losses-in-a-learner"
    assert slug("The learner: losses, updates, micro-batches") == "the-learner-losses-updates-micro-batches"
    assert slug("Calibrating S and η") == "calibrating-s-and-η"
    assert slug("`pacerl/` and [docs](docs/x.md) – 2×") == "pacerl-and-docs--2"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif not destination.resolve().is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, more than {README_MAX_LINES}"


def test_fences_and_inline_code_hide_links_and_headings() -> None:
    text = "```` ```python ```` blocks [a](a.md)\n```\n# no heading [b](b.md)\n```\n`[c](c.md)` [d](d.md#x)"
    assert _unfenced(text) == ["```` ```python ```` blocks [a](a.md)", "`[c](c.md)` [d](d.md#x)"]
    assert [m.group(1) for line in _prose(text) for m in _LINK.finditer(line)] == ["a.md", "d.md#x"]
