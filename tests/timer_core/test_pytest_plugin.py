"""The shipped conformance suite in a user's own project: failures show the compared values."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# The one pytest-asyncio setting docs/adapters.md tells a user to make, and nothing else.
USER_PYPROJECT = """\
[tool.pytest.ini_options]
asyncio_default_fixture_loop_scope = "function"
"""

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


def run_user_pytest(project: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    """pytest run in ``project`` as its own root, with the installed packages only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "default", *arguments],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class TestContractInAUsersProject:
    def test_failing_contract_test_shows_the_values(self, tmp_path: Path) -> None:
        """With no conftest, a contract failure in the user's adapter shows what was compared."""
        (tmp_path / "pyproject.toml").write_text(USER_PYPROJECT)
        (tmp_path / "test_limitless_store.py").write_text(textwrap.dedent(BROKEN_ADAPTER))
        result = run_user_pytest(tmp_path, "-k", "respects_limit")
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert "1 failed" in output
        # Only the rewritten assert knows the fourth item: the source line names three.
        assert "('tenant-a', 'call-03')" in output, output

    def test_the_documented_setting_leaves_no_warning(self, tmp_path: Path) -> None:
        """With the one documented setting, the suite's run shows no warning at all."""
        (tmp_path / "pyproject.toml").write_text(USER_PYPROJECT)
        (tmp_path / "test_limitless_store.py").write_text(textwrap.dedent(BROKEN_ADAPTER))
        result = run_user_pytest(tmp_path, "-k", "not respects_limit")
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert "warning" not in output.lower(), output
