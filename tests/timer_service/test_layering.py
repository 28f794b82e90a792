"""timer_service leaves the broker's driver to timer_adapters_nats: none of its modules imports
``nats``, so the service meets nats-py only through the adapter's names and errors."""

from __future__ import annotations

from tests.timer_core.test_imports import _imports


class TestBrokerDriver:
    def test_no_module_of_the_service_imports_nats(self) -> None:
        """No module of timer_service (lazy imports inside functions included) imports
        ``nats`` or one of its submodules."""
        found = {
            (module, imported)
            for module, imported in _imports("timer_service")
            if imported == "nats" or imported.startswith("nats.")
        }
        assert found == set()
