"""The figures the slow scenario suites (``chaos``, ``scale_out``) measure: printed as each
scenario reports them (seen with ``pytest -n 0 -s``) and all again at the end of the run, where CI
logs show them.

A reported figure travels with its test's report (``user_properties``), so it reaches the
end-of-run summary from an xdist worker too; the root ``conftest.py`` wires the hooks.
"""

from __future__ import annotations

from typing import Any

import pytest

#: (suite, scenario, figures line) reported by the test running now, not yet on a report.
_unsent: list[tuple[str, str, str]] = []
#: suite -> (scenario, figures line), in the order their reports arrived.
_received: dict[str, list[tuple[str, str]]] = {}
_PROPERTY = "figures"


class Figures:
    """One suite's reported figures."""

    def __init__(self, suite: str) -> None:
        self.suite = suite

    def report(self, scenario: str, **figures: object) -> None:
        """Print a scenario's figures now and send them with the test's report."""
        print(f"\n[{self.suite}] {scenario}: {_line(figures)}", flush=True)
        _unsent.append((self.suite, scenario, _line(figures)))


def attach(report: pytest.TestReport) -> None:
    """Move the figures reported since the last report onto ``report``."""
    report.user_properties.extend((_PROPERTY, sent) for sent in _unsent)
    _unsent.clear()


def receive(report: pytest.TestReport) -> None:
    """Keep the figures a (possibly remote) test report carries."""
    for name, value in report.user_properties:
        if name == _PROPERTY:
            suite, scenario, line = value
            _received.setdefault(suite, []).append((scenario, line))


def summarize(terminalreporter: Any) -> None:
    """Every suite's figures again, each in a section of its own."""
    for suite, reported in _received.items():
        terminalreporter.section(f"{suite} figures")
        for scenario, line in reported:
            terminalreporter.write_line(f"{scenario}: {line}")


def _line(figures: dict[str, object]) -> str:
    return " ".join(f"{key}={value}" for key, value in figures.items())
