"""The shipped conformance suite in a user's own project: failures show the compared values."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.user_project import SHOWN_VALUE, run_user_pytest

# The one pytest-asyncio setting docs/adapters.md tells a user to make, and nothing else.
USER_SETTINGS = """\
[tool.pytest.ini_options]
asyncio_default_fixture_loop_scope = "function"
"""


class TestContractInAUsersProject:
    def test_failing_contract_test_shows_the_values(self, tmp_path: Path) -> None:
        """With no conftest, a contract failure in the user's adapter shows what was compared."""
        result = run_user_pytest(sys.executable, tmp_path, USER_SETTINGS, "-k", "respects_limit")
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert "1 failed" in output
        assert SHOWN_VALUE in output, output

    def test_the_documented_setting_leaves_no_warning(self, tmp_path: Path) -> None:
        """With the one documented setting, the suite's run shows no warning at all."""
        result = run_user_pytest(
            sys.executable, tmp_path, USER_SETTINGS, "-k", "not respects_limit"
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert "warning" not in output.lower(), output
