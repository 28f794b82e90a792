"""The reference pages list everything the code has: variables, flags, metrics, contract tests."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Iterator

import pytest

from tests.docs.markdown import DOCS, table_rows
from timer_core.testing import (
    EventPublisherContract,
    FindsDueByTenantContract,
    TimerStoreContract,
)
from timer_service.cli import _parser
from timer_service.metrics import PrometheusInstrumentation
from timer_service.settings import ENVIRONMENT, Settings

CONFIGURATION = DOCS / "configuration.md"


def documented_defaults() -> dict[str, str]:
    """Variable -> the default cell of its row in the configuration page's tables."""
    return {
        row[0].strip("`"): row[1]
        for row in table_rows(CONFIGURATION)
        if len(row) >= 3 and row[0].startswith("`TIMER_")
    }


def options(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Every long option of the parser and of its subcommands, recursively."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from options(sub)
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                yield option


class TestConfigurationPage:
    @pytest.mark.parametrize("variable", sorted(ENVIRONMENT))
    def test_every_variable_is_documented_with_its_default(self, variable: str) -> None:
        """Each TIMER_* variable has a row whose default is the one Settings really uses."""
        defaults = documented_defaults()
        assert variable in defaults, f"{variable} is missing from docs/configuration.md"
        field, parse = ENVIRONMENT[variable]
        actual = getattr(Settings(), field)
        cell = defaults[variable]
        if cell == "unset":
            assert actual is None
        else:
            assert parse(variable, cell.strip("`")) == actual

    def test_no_variable_is_documented_that_does_not_exist(self) -> None:
        """The page documents no TIMER_* variable the service does not read."""
        assert set(documented_defaults()) <= set(ENVIRONMENT)

    @pytest.mark.parametrize("option", sorted(set(options(_parser()))))
    def test_every_flag_is_documented(self, option: str) -> None:
        """Each command-line option of every subcommand appears on the page."""
        assert f"`{option}" in CONFIGURATION.read_text()


class TestOperationsPage:
    def test_every_metric_is_documented(self) -> None:
        """Each Prometheus series the service exports is named on the operations page."""
        text = (DOCS / "operations.md").read_text()
        names = {
            metric.name + ("_total" if metric.type == "counter" else "")
            for metric in PrometheusInstrumentation().registry.collect()
        }
        missing = sorted(name for name in names if f"`{name}" not in text)
        assert missing == []


class TestAdaptersPage:
    @pytest.mark.parametrize(
        "suite", [TimerStoreContract, FindsDueByTenantContract, EventPublisherContract]
    )
    def test_every_contract_test_is_listed(self, suite: type) -> None:
        """Each test of the shipped conformance suites is named on the adapter page."""
        text = (DOCS / "adapters.md").read_text()
        tests = [name for name, _ in inspect.getmembers(suite) if name.startswith("test_")]
        assert tests
        missing = [name for name in tests if f"`{name}`" not in text]
        assert missing == []
