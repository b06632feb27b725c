"""The README is the front door: short, its first example the site's, and a link to every page of the site.

Its code blocks run with the site's, in ``tests/test_docs.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_docs import fenced_blocks

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_LINES = 300


def _links(text: str) -> set[str]:
    """The relative link targets of ``text``, without their anchors."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return {t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")}


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < MAX_LINES, f"README.md has {lines} lines; move the details to a page of docs/"


def test_the_readme_links_every_page_of_the_site() -> None:
    links = _links(README.read_text())
    broken = sorted(t for t in links if not (ROOT / t).exists())
    assert not broken, f"README.md links to files that do not exist: {broken}"
    # docs/changelog.md only includes CHANGELOG.md into the site: the README links CHANGELOG.md itself.
    pages = {str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md")} - {"docs/changelog.md"}
    missing = sorted(pages - links)
    assert not missing, f"README.md does not link these pages of the site: {missing}"
    assert "CHANGELOG.md" in links


def test_the_readme_opens_with_the_example_the_site_opens_with() -> None:
    readme = [b for b in fenced_blocks(README.read_text()) if b.lang == "python"]
    site = [b for b in fenced_blocks((DOCS / "index.md").read_text()) if b.lang == "python"]
    assert readme[0].code == site[0].code
    assert readme[0].not_run is None and "@ak.distributed(num_processes=2)" in readme[0].code
