"""The Grafana dashboard in deploy/grafana: every query names series the service really exports."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from tests.timer_service.process import http_get
from tests.timer_service.test_otel import Telemetry, running_service, settings_for
from timer_service.otel import OtelInstrumentation

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "timer.json"
_SERIES = re.compile(r"\btimer_[a-z_]+\b")


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and templating queries."""
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append(variable["definition"])
    return found


class TestDashboard:
    async def test_every_query_names_an_exported_series(
        self, tmp_path: Path, nats_url: str
    ) -> None:
        """Each timer_* name in a query is a series of a started service's /metrics."""
        dashboard = json.loads(DASHBOARD.read_text())
        async with running_service(settings_for(tmp_path, nats_url), Telemetry()) as service:
            assert isinstance(service.telemetry, OtelInstrumentation)
            # Its endpoint, off in the settings (TIMER_HTTP_PORT=0), started on a port the
            # kernel picks as it binds: no other process can take it first.
            await service.http.start()
            try:
                status, text = await asyncio.to_thread(http_get, service.http.port, "/metrics")
            finally:
                await service.http.aclose()
        assert status == 200
        exported = {
            line.split("{")[0].split(" ")[0]
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        named = {name for query in queries(dashboard) for name in _SERIES.findall(query)}
        assert named, "the dashboard names no timer series"
        assert named - exported == set()

    def test_the_panels_the_operations_page_describes_are_there(self) -> None:
        """Commands by outcome, firings/s, lateness p50/p99, pending, publish failures, worker
        errors, last poll age and retention's deletions each have a panel, with unique ids
        and a description."""
        dashboard = json.loads(DASHBOARD.read_text())
        titles = [panel["title"] for panel in dashboard["panels"]]
        for wanted in (
            "Commands by outcome",
            "Firings/s",
            "Firing lateness p50 / p99",
            "Pending timers",
            "Publish failures/s",
            "Worker errors/s",
            "Last poll age",
            "Retention purged/s",
        ):
            assert wanted in titles
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        assert all(panel["description"] for panel in dashboard["panels"])
        operations = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
        assert all(f"**{title}**" in operations for title in set(titles))
