"""The documentation site builds with mkdocs --strict: no broken link, anchor or include."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tests.docs.markdown import ROOT


class TestBuild:
    def test_site_builds_strictly(self, site: Path) -> None:
        """`mkdocs build --strict` succeeds and renders every page of the navigation."""
        for page in ("quickstart", "concepts", "contract", "configuration", "adapters"):
            assert (site / page / "index.html").is_file()
        for page in ("operations", "deployment", "design", "benchmarks", "architecture", "faq"):
            assert (site / page / "index.html").is_file()
        for page in ("comparison", "changelog"):
            assert (site / page / "index.html").is_file()
        # The Benchmarks page is curated, its figures rendered from bench/results (no log).
        benchmarks = (site / "benchmarks" / "index.html").read_text()
        assert "python -m timer_bench" in benchmarks and "Measured on " in benchmarks
        assert "<details" not in benchmarks and "{{" not in benchmarks
        # The deployment files are included from deploy/, not left as include markers.
        deployment = (site / "deployment" / "index.html").read_text()
        assert "useradd" in deployment
        assert "--8&lt;--" not in deployment
        # The long Grafana dashboard is linked for download, not shown inline.
        dashboard = ROOT / "deploy" / "grafana" / "timer.json"
        assert (site / "deploy" / "grafana" / "timer.json").read_bytes() == dashboard.read_bytes()
        assert 'href="../deploy/grafana/timer.json"' in deployment
        assert "&quot;panels&quot;" not in deployment
        # The changelog page is CHANGELOG.md itself; diagrams are mermaid blocks for the theme.
        assert "Keep a Changelog" in (site / "changelog" / "index.html").read_text()
        assert '<pre class="mermaid">' in (site / "architecture" / "index.html").read_text()
        # The API reference: a page per package, generated from the docstrings, roles as code.
        reference = {
            "timer_core": "timer_core.Timer",
            "timer_adapters_memory": "timer_adapters_memory.FakeClock",
            "timer_adapters_sqlite": "timer_adapters_sqlite.schedule_in_transaction",
            "timer_adapters_postgres": "timer_adapters_postgres.schedule_in_transaction",
            "timer_adapters_nats": "timer_adapters_nats.DueEventConsumer",
            "timer_service": "timer_service.settings.Settings",
        }
        for package, name in reference.items():
            page = (site / "reference" / package / "index.html").read_text()
            assert f'id="{name}"' in page, package
            assert ":class:" not in page and ":meth:" not in page, package

    @pytest.mark.parametrize(
        ("package", "first"),
        [
            ("timer_core", "Timer"),
            ("timer_adapters_nats", "NatsBroker"),
            ("timer_adapters_memory", "MemoryTimerClient"),
        ],
    )
    def test_reference_shows_every_export_once_main_entry_point_first(
        self, site: Path, package: str, first: str
    ) -> None:
        """Every name a package exports is documented on exactly one of its reference pages
        (timer_core's are split by topic), and the first page opens with its main entry
        point, not with whatever comes first alphabetically (a header constant)."""
        pages = {
            page.parent.name: page.read_text()
            for page in sorted((site / "reference").glob(f"{package}*/index.html"))
        }
        for name in importlib.import_module(package).__all__:
            anchor = f'id="{package}.{name}"'
            assert sum(anchor in html for html in pages.values()) == 1, name
        ids = re.findall(rf'id="({package}\.[A-Za-z_]+)"', pages[package])
        assert ids[0] == f"{package}.{first}"

    def test_pages_load_nothing_from_another_host(self, site: Path) -> None:
        """No page loads a script, a stylesheet or a font from a CDN, and each page with a
        diagram loads the site's own Mermaid, so the theme never fetches one."""
        remote = re.compile(
            r'<script[^>]+src="(?:https?:)?//[^"]*"'
            r'|<link(?![^>]*rel="(?:canonical|alternate|license)")[^>]+href="(?:https?:)?//[^"]*"'
        )
        found = []
        for page in sorted(site.glob("**/*.html")):
            html = page.read_text()
            found += [f"{page.relative_to(site)}: {tag}" for tag in remote.findall(html)]
            if '<pre class="mermaid">' in html:
                assert re.search(r'<script src="[./]*javascripts/mermaid\.min\.js">', html), page
        assert found == []
        assert (site / "javascripts" / "mermaid.min.js").stat().st_size > 1_000_000
