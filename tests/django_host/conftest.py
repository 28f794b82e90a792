"""A real Django project (settings, an app, its table) on SQLite and on PostgreSQL, configured
once per test process: the ``default`` database is a SQLite file, ``pg`` a database on the
session's PostgreSQL cluster."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import PostgresCluster


@pytest.fixture(scope="session")
def django_databases(
    postgres_cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """Django set up with both databases and the shop's table in each; the timer stores'
    locations: ``{"default": sqlite path, "pg": SQLAlchemy URL}``."""
    import django
    from django.conf import settings
    from django.db import connections

    sqlite_file = tmp_path_factory.mktemp("django") / "shop.db"
    pg_name = f"django_shop_{os.getpid()}"
    pg_url = postgres_cluster.create_database(pg_name)
    settings.configure(
        INSTALLED_APPS=["tests.django_host.shop"],
        DATABASES={
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(sqlite_file)},
            "pg": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": pg_name,
                "USER": postgres_cluster.user,
                "HOST": "127.0.0.1",
                "PORT": str(postgres_cluster.port),
            },
        },
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()
    from tests.django_host.shop.models import Order

    for alias in ("default", "pg"):
        with connections[alias].schema_editor() as editor:
            editor.create_model(Order)
    connections.close_all()
    yield {"default": str(Path(sqlite_file)), "pg": pg_url}
    connections.close_all()
