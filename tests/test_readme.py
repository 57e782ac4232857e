"""The README is a front page: at most 200 lines, every relative link in it and in the
pages it reaches resolves (file and heading anchor), every page under docs/ and every
figure under sidecar/docs/ is reachable from it (docs/ with its folders: tutorials, how-to,
reference, explanation)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 200

_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _prose(text: str) -> str:
    """The markdown outside fenced code blocks (links there are examples, not links)."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _prose(page.read_text()), re.M)}


def relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def reachable_pages() -> dict[Path, list[str]]:
    """Every markdown page reachable from the README through relative links, with its links."""
    found: dict[Path, list[str]] = {}
    todo = [README]
    while todo:
        page = todo.pop()
        if page in found:
            continue
        found[page] = relative_links(page)
        for target in found[page]:
            path = (page.parent / target.split("#", 1)[0]).resolve() if not target.startswith("#") else page
            if path.suffix == ".md" and path.is_file() and REPO in path.parents:
                todo.append(path)
    return found


def test_the_readme_is_at_most_200_lines():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_every_relative_link_of_the_readme_and_the_pages_it_reaches_resolves():
    broken = []
    for page, links in reachable_pages().items():
        for target in links:
            file_part, _, anchor = target.partition("#")
            path = (page.parent / file_part).resolve() if file_part else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(REPO)}: {target} (no heading #{anchor})")
    assert broken == []


def test_every_docs_page_and_every_figure_is_reachable_from_the_readme():
    pages = reachable_pages()
    docs = set((REPO / "docs").rglob("*.md")) | set((REPO / "sidecar" / "docs").glob("*.md"))
    assert docs - set(pages) == set()
    shown = {(page.parent / t.split("#", 1)[0]).resolve() for page, links in pages.items() for t in links}
    figures = set((REPO / "sidecar" / "docs").glob("*.png")) | set((REPO / "docs").rglob("*.png"))
    assert {f.relative_to(REPO) for f in figures - shown} == set()


def test_slug_matches_githubs_anchors():
    assert slug("A pool of 1,000 pods: where-is-what that stays small") == \
        "a-pool-of-1000-pods-where-is-what-that-stays-small"
    assert slug("3. See the dashboard") == "3-see-the-dashboard"
    assert slug("The nixl data plane (`--transport nixl`)") == "the-nixl-data-plane---transport-nixl"
