"""The Django example project (``examples/django_shop``) on PostgreSQL: its own tests, run by
Django's test runner, pass there as they do on SQLite (``pytest examples`` runs those)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.docs.markdown import ROOT
from tests.pg import PostgresCluster

SHOP = ROOT / "examples" / "django_shop"


def test_the_example_shop_passes_its_django_tests_on_postgresql(
    postgres_cluster: PostgresCluster,
) -> None:
    """``SHOP_DATABASE_URL=postgresql://... manage.py test shop``: Django creates the test
    database, its migrations make Timer's tables there, and the five tests pass."""
    url = f"postgresql://{postgres_cluster.user}@127.0.0.1:{postgres_cluster.port}/shop"
    env = {**os.environ, "SHOP_DATABASE_URL": url}
    done = subprocess.run(
        [sys.executable, "manage.py", "test", "shop", "--noinput"],
        cwd=SHOP,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "Ran 5 tests" in done.stderr, done.stderr
