"""The built site in headless Chromium with no network: every diagram is drawn, and on a
390 px phone every code block keeps its lines (scrolls, never wraps) and no page is wider
than the screen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.browser import Chromium, Tab, chromium, served
from tests.docs.markdown import DOCS
from tests.tools import require_tool

pytestmark = pytest.mark.os_tool

#: What a code block's lines look like once drawn, per block: its text's lines, and how many
#: lines tall it is drawn (one more than its text's means a line wrapped).
CODE_LINES = """
[...document.querySelectorAll('.md-typeset pre > code')].map((code) => {
  const style = getComputedStyle(code);
  const height = code.clientHeight - parseFloat(style.paddingTop)
    - parseFloat(style.paddingBottom);
  return {
    text: code.textContent.replace(/\\n$/, '').split('\\n').length,
    drawn: Math.round(height / parseFloat(style.lineHeight)),
    whiteSpace: style.whiteSpace,
    right: code.closest('pre').getBoundingClientRect().right,
    first: code.textContent.split('\\n')[0],
  };
})
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    """Headless Chromium (the system's) with a fresh profile and no network."""
    executable = require_tool("chromium", "apt-get install chromium")
    with chromium(executable, tmp_path_factory.mktemp("profile")) as running:
        yield running


@pytest.fixture(scope="module")
def base_url(site: Path) -> Iterator[str]:
    with served(site) as url:
        yield url


def pages(site: Path) -> list[str]:
    """Every page of the built site, as a path below its root (``architecture/``)."""
    found = []
    for index in sorted(site.glob("**/index.html")):
        relative = index.parent.relative_to(site).as_posix()
        found.append("" if relative == "." else f"{relative}/")
    return found


def offsite(tab: Tab, base_url: str) -> list[str]:
    """The URLs a tab asked for that are not the site's own."""
    return [
        url for url in tab.requests() if not url.startswith((base_url, "data:", "about:", "blob:"))
    ]


def diagram_count() -> int:
    """How many ```mermaid blocks the Markdown sources hold."""
    return sum(path.read_text().count("```mermaid") for path in DOCS.glob("**/*.md"))


class TestOffline:
    def test_every_diagram_renders_without_network(
        self, browser: Chromium, site: Path, base_url: str
    ) -> None:
        """Each page with a diagram, opened with no network, draws every one of them as an
        SVG, and asks for nothing from another host."""
        with_diagrams = {
            page: (site / page / "index.html").read_text().count('<pre class="mermaid">')
            for page in pages(site)
        }
        drawn = 0
        for page, count in with_diagrams.items():
            if not count:
                continue
            tab = browser.page(1280)
            tab.open(base_url + page)
            tab.wait_for(
                f"document.querySelectorAll('div.mermaid').length === {count}",
                what=f"the {count} diagrams of {page} to be drawn",
            )
            svgs = tab.shadow_html("div.mermaid")
            assert svgs, page
            for svg in svgs:
                assert "<svg" in svg and "Syntax error" not in svg, page
                assert "&lt;" not in svg.split("<style>")[0], page
            drawn += len(svgs)
            assert offsite(tab, base_url) == [], page
        assert drawn == diagram_count() > 0

    def test_no_page_asks_another_host_or_overflows_at_1280_px(
        self, browser: Chromium, site: Path, base_url: str
    ) -> None:
        """Every page loads only from the site itself (no CDN script, font or style), and
        none is wider than a 1280 px screen."""
        tab = browser.page(1280)
        too_wide = []
        for page in pages(site):
            tab.open(base_url + page)
            width = tab.evaluate("document.documentElement.scrollWidth")
            if width > 1280:
                too_wide.append(f"{page}: {width} px")
        assert offsite(tab, base_url) == []
        assert too_wide == []


class TestPhone:
    def test_code_keeps_its_lines_and_nothing_overflows_at_390_px(
        self, browser: Chromium, site: Path, base_url: str
    ) -> None:
        """At 390 px every code block is drawn one line per line of its text (a long line
        scrolls inside its block), no block and no page is wider than the screen."""
        tab = browser.page(390)
        wrapped: list[str] = []
        too_wide: list[str] = []
        for page in pages(site):
            tab.open(base_url + page)
            for block in tab.evaluate(CODE_LINES):
                if block["drawn"] != block["text"] or block["whiteSpace"] != "pre":
                    wrapped.append(f"{page}: {block['first'][:60]!r} {block}")
                if block["right"] > 390:
                    too_wide.append(f"{page}: code block {block['first'][:60]!r}")
            width = tab.evaluate("document.documentElement.scrollWidth")
            if width > 390:
                too_wide.append(f"{page}: the page is {width} px wide")
        assert wrapped == []
        assert too_wide == []
