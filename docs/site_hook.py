"""mkdocs hook: files the site serves that do not live in ``docs/``.

**The repository's deployment files**, every file under ``deploy/``, at the same path in
the site (``deploy/grafana/timer.json``), so a page links a long one for download instead of
showing it inline, and a reader without the repository can fetch it.

**Mermaid, so the site needs no network to show its diagrams.** The Material theme draws
``mermaid`` code blocks with Mermaid, which it loads from a CDN unless a ``mermaid`` global
already exists. This hook adds Mermaid to the built site from the
``mermaidx`` package of the ``docs`` dependency group (which ships Mermaid's browser bundle
as ``mermaidx/assets/mermaid.js``), and a ``<script>`` for it on the pages that have a
diagram, so the theme uses that copy and never fetches one: no third-party file is committed
here, and the build needs nothing but what uv installs.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.utils import get_relative_url

ROOT = Path(__file__).resolve().parents[1]
#: The repository's folder whose files the site serves as they are.
DEPLOY = ROOT / "deploy"
#: Where the site serves Mermaid from.
MERMAID_URI = "javascripts/mermaid.min.js"
#: How a page's HTML shows it has a diagram (pymdownx.superfences' custom fence).
DIAGRAM = '<pre class="mermaid">'


def mermaid_source() -> str:
    """Mermaid's browser bundle, as the ``mermaidx`` package ships it."""
    return resources.files("mermaidx").joinpath("assets", "mermaid.js").read_text("utf-8")


def on_files(files: Files, config: MkDocsConfig, **kwargs: Any) -> Files:
    files.append(File.generated(config, MERMAID_URI, content=mermaid_source()))
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file():
            uri = path.relative_to(ROOT).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_post_page(output: str, page: Page, config: MkDocsConfig, **kwargs: Any) -> str:
    if DIAGRAM not in output:
        return output
    src = get_relative_url(MERMAID_URI, page.url or ".")
    # Before the body ends: it runs before DOMContentLoaded, when the theme looks for it.
    return output.replace("</body>", f'<script src="{src}"></script>\n</body>', 1)
