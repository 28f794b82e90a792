"""The figures the slow scenario suites (``chaos``, ``scale_out``) measure: printed as each
scenario reports them (seen with ``pytest -s``) and all again at the end of the run, where CI
logs show them."""

from __future__ import annotations

import pytest


class Figures:
    """One suite's reported figures, in the order the scenarios reported them."""

    def __init__(self, suite: str) -> None:
        self.suite = suite
        self.reported: list[tuple[str, dict[str, object]]] = []

    def report(self, scenario: str, **figures: object) -> None:
        """Print a scenario's figures now and keep them for :meth:`summarize`."""
        print(f"\n[{self.suite}] {scenario}: {_line(figures)}", flush=True)
        self.reported.append((scenario, figures))

    def summarize(self, terminalreporter: pytest.TerminalReporter) -> None:
        """Every figure again in a section of its own (for ``pytest_terminal_summary``)."""
        if not self.reported:
            return
        terminalreporter.section(f"{self.suite} figures")
        for scenario, figures in self.reported:
            terminalreporter.write_line(f"{scenario}: {_line(figures)}")


def _line(figures: dict[str, object]) -> str:
    return " ".join(f"{key}={value}" for key, value in figures.items())
