"""The example shop's settings: one app, its orders and their timers in one database.

SQLite by default (``SHOP_DB``: the file; the test runner uses ``SHOP_TEST_DB``, a file too,
so that the Timer of another connection or process sees what the tests commit); PostgreSQL
when ``SHOP_DATABASE_URL`` is ``postgresql://user:password@host:port/database``.
"""

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "the-example-shop-has-no-secrets"  # an example: never deploy this value
DEBUG = False
ALLOWED_HOSTS: list[str] = []
INSTALLED_APPS = ["shop"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"shop": {"handlers": ["console"], "level": "INFO"}},
}


def _database() -> dict[str, object]:
    url = os.environ.get("SHOP_DATABASE_URL")
    if url:
        parts = urlsplit(url)
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": parts.path.lstrip("/"),
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
        }
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DB", str(BASE_DIR / "shop.sqlite3")),
        "TEST": {"NAME": os.environ.get("SHOP_TEST_DB", str(BASE_DIR / "test_shop.sqlite3"))},
    }


DATABASES = {"default": _database()}
