"""Every relative link and image in README.md and docs/**/*.md points at a file that exists."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.M | re.S)


def relative_links(text: str) -> list[str]:
    """Link targets outside code, without URLs, mail links and in-page anchors, and without their #anchor."""
    text = _CODE.sub("", text)
    targets = (m.group(1).split("#")[0] for m in _LINK.finditer(text))
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_relative_links_finds_links_and_skips_urls_and_code() -> None:
    text = "[a](docs/a.md#x) ![p](img/p.png) [u](https://x.org) [s](#top) `[c](code.md)`"
    assert relative_links(text) == ["docs/a.md", "img/p.png"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: pathlib.Path) -> None:
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
