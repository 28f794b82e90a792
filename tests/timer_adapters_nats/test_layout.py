"""The NATS adapter's modules import each other as a DAG: no cycle, not even one switched off
for the type checker under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import timer_adapters_nats

_PACKAGE = "timer_adapters_nats"
_SOURCE = Path(timer_adapters_nats.__file__).parent


def _module_name(path: Path) -> str:
    return _PACKAGE if path.name == "__init__.py" else f"{_PACKAGE}.{path.stem}"


def _imported(path: Path) -> set[str]:
    """The package's modules ``path`` imports anywhere: top level, functions, TYPE_CHECKING."""
    module = _module_name(path)
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                parent = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                target = f"{parent}.{node.module}" if node.module else parent
            else:
                target = node.module or ""
            # ``from package import module`` imports the module as well as the package.
            names = [target, *(f"{target}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(n for n in names if n == _PACKAGE or n.startswith(f"{_PACKAGE}."))
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package with the modules of the package it imports."""
    paths = sorted(_SOURCE.glob("*.py"))
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imported(path) & modules for path in paths}


class TestImportGraph:
    """What the adapter's modules import from one another."""

    def test_the_graph_is_read(self) -> None:
        """The graph knows the broker's imports (so an empty graph cannot pass as acyclic)."""
        graph = import_graph()
        assert {"timer_adapters_nats._connection", "timer_adapters_nats._source"} <= graph[
            "timer_adapters_nats._broker"
        ]

    def test_type_checking_imports_are_edges(self, tmp_path: Path) -> None:
        """An import under ``if TYPE_CHECKING:`` counts as an edge like any other."""
        module = tmp_path / "_probe.py"
        module.write_text(
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from timer_adapters_nats._broker import NatsBroker\n"
            "    from . import _source\n",
            encoding="utf-8",
        )
        assert _imported(module) >= {"timer_adapters_nats._broker", "timer_adapters_nats._source"}

    def test_modules_form_a_dag(self) -> None:
        """No module of the package imports, even indirectly, one that imports it back."""
        try:
            order = list(TopologicalSorter(import_graph()).static_order())
        except CycleError as exc:
            pytest.fail(f"import cycle in {_PACKAGE}: {' -> '.join(exc.args[1])}")
        assert order[-1] == _PACKAGE

    def test_adapters_depend_on_the_connection_not_the_broker(self) -> None:
        """Only the package's ``__init__`` imports the broker: the adapters it hands out
        depend on the connection."""
        importers = {
            m for m, imported in import_graph().items() if f"{_PACKAGE}._broker" in imported
        }
        assert importers == {_PACKAGE}
