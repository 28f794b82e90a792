"""The documentation site builds with mkdocs --strict: no broken link, anchor or include."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.docs.markdown import ROOT


class TestBuild:
    def test_site_builds_strictly(self, tmp_path: Path) -> None:
        """`mkdocs build --strict` succeeds and renders every page of the navigation."""
        site = tmp_path / "site"
        result = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        )
        assert result.returncode == 0, result.stderr
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
