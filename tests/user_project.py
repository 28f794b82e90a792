"""A user's own project binding the shipped contract suite to a deliberately broken adapter:
what such a user sees when pytest runs it against the installed packages."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# A store that forgets find_due's limit: exactly one contract test fails, and only the
# rewritten assert can show its fourth item, ('tenant-a', 'call-03').
BROKEN_ADAPTER = '''\
import pytest

from timer_adapters_memory import MemoryTimerStore
from timer_core.testing import TimerStoreContract


class LimitlessStore(MemoryTimerStore):
    """A store that forgets the limit of find_due (and nothing else)."""

    async def find_due(self, now, limit, **kwargs):
        if kwargs:
            return await super().find_due(now, limit, **kwargs)
        return await super().find_due(now, 1000)


class TestLimitlessStore(TimerStoreContract):
    @pytest.fixture
    def make_store(self):
        storage = MemoryTimerStore()
        return lambda: LimitlessStore(shared_with=storage)
'''
SHOWN_VALUE = "('tenant-a', 'call-03')"


def clean_env() -> dict[str, str]:
    """The environment without the outer project's virtualenv or pytest settings."""
    drop = ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "PYTHONPATH")
    return {
        key: value
        for key, value in os.environ.items()
        if key not in drop and not key.startswith("PYTEST_")
    }


def run_user_pytest(
    python: str, project: Path, pytest_settings: str, *arguments: str
) -> subprocess.CompletedProcess[str]:
    """Write the user's project (its pyproject.toml holding ``pytest_settings``, and the
    broken adapter's test module, no conftest) and run pytest in it as its own root."""
    (project / "pyproject.toml").write_text(pytest_settings)
    (project / "test_limitless_store.py").write_text(BROKEN_ADAPTER)
    return subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "-W", "default", *arguments],
        cwd=project,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
