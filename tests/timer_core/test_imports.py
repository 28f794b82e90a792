"""timer_core stays a pure library (importing it pulls in no database or broker driver), and
the packages import each other only downwards."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import timer_core


class TestImports:
    """What `import timer_core` loads."""

    def test_import_loads_no_driver(self) -> None:
        """Importing timer_core loads neither sqlalchemy, nats nor opentelemetry (nor the test
        kit)."""
        code = (
            "import sys, timer_core; "
            "loaded = [m for m in ('sqlalchemy', 'nats', 'opentelemetry', 'pytest', 'hypothesis',"
            " 'timer_core.testing') if m in sys.modules]; "
            "assert not loaded, loaded"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stderr


_ROOT = Path(__file__).resolve().parents[2]
_CORE = "timer_core"
_ADAPTERS = (
    "timer_adapters_memory",
    "timer_adapters_sqlite",
    "timer_adapters_postgres",
    "timer_adapters_nats",
)
_SERVICE = "timer_service"


def _imports(package: str) -> set[tuple[str, str]]:
    """Every ``(module, imported module)`` of a distribution's source, absolute names."""
    found: set[tuple[str, str]] = set()
    for path in sorted((_ROOT / package / "src" / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update((path.name, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add((path.name, node.module))
    return found


def _ours(module: str) -> str | None:
    top = module.partition(".")[0]
    return top if top in (_CORE, *_ADAPTERS, _SERVICE) else None


class TestPublicNames:
    """timer_core exports the domain, the runtime, the ports and the errors; helpers and
    workflows live in public submodules, importable by name."""

    @pytest.mark.parametrize("module", ["errors", "ports"])
    def test_ports_and_errors_are_re_exported(self, module: str) -> None:
        """Every name of ``timer_core.ports`` and ``timer_core.errors`` is in ``timer_core``."""
        names = set(importlib.import_module(f"timer_core.{module}").__all__)
        assert names - set(timer_core.__all__) == set()

    @pytest.mark.parametrize(
        "module",
        [
            "codec",
            "commands",
            "events",
            "fair_share",
            "firing",
            "instants",
            "instrumentation",
            "maintenance",
            "redaction",
            "replay",
            "trace",
            "worker",
        ],
    )
    def test_public_submodules_export_what_they_name(self, module: str) -> None:
        """Each public submodule's ``__all__`` names what it holds."""
        loaded = importlib.import_module(f"timer_core.{module}")
        assert all(hasattr(loaded, name) for name in loaded.__all__)

    def test_helpers_stay_in_their_submodules(self) -> None:
        """Helpers (instants, redaction, codec functions, workflows) are not top-level names."""
        assert {"floor_ms", "redact_url", "encode_envelope", "handle_commands"} & set(
            dir(timer_core)
        ) == set()

    def test_the_core_names_no_setting_or_command_of_the_service(self) -> None:
        """No text of timer_core names a TIMER_ setting or a timer-service command."""
        source = _ROOT / _CORE / "src" / _CORE
        for path in source.rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            assert "TIMER_" not in text, path
            assert "timer-service quarantine" not in text, path


class TestLayering:
    """Imports only point down: core <- adapters <- service (docs/design.md, Layout)."""

    def test_core_imports_no_adapter_and_no_service(self) -> None:
        """timer_core imports none of the adapters and not the service."""
        upward = {(f, m) for f, m in _imports(_CORE) if _ours(m) not in (None, _CORE)}
        assert upward == set()

    @pytest.mark.parametrize("adapter", _ADAPTERS)
    def test_an_adapter_imports_only_the_core(self, adapter: str) -> None:
        """An adapter imports the core and itself, never another adapter or the service."""
        sideways = {(f, m) for f, m in _imports(adapter) if _ours(m) not in (None, _CORE, adapter)}
        assert sideways == set()

    @pytest.mark.parametrize("package", [*_ADAPTERS, _SERVICE])
    def test_the_core_is_used_through_its_public_names(self, package: str) -> None:
        """Outside timer_core, code imports ``timer_core`` and its public submodules (the
        rules a store applies, the helpers), never a private one."""
        reaching = {
            (f, m)
            for f, m in _imports(package)
            if _ours(m) == _CORE and any(part.startswith("_") for part in m.split("."))
        }
        assert reaching == set()
