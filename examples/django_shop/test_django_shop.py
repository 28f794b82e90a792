"""The Django example's own tests, run by Django's test runner as a Django project runs them,
twice in a row: a second run of the example finds nothing left over from the first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_the_shop_passes_its_django_tests_twice(tmp_path: Path) -> None:
    """``python manage.py test shop`` passes, and passes again."""
    env = {
        **os.environ,
        "SHOP_DB": str(tmp_path / "shop.sqlite3"),
        "SHOP_TEST_DB": str(tmp_path / "test_shop.sqlite3"),
    }
    env.pop("SHOP_DATABASE_URL", None)
    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, "manage.py", "test", "shop", "--noinput", "-v", "2"],
            cwd=HERE,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"run {run}:\n{done.stdout}\n{done.stderr}"
        assert "Ran 5 tests" in done.stderr, done.stderr
