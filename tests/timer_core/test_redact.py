"""redact_url: the one place that takes credentials out of the URLs Timer prints."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from timer_core.redaction import redact_url

# Characters a password may hold in a URL without ending the host part early.
_SECRET = st.text(
    alphabet=st.characters(
        blacklist_characters="/?#&;'\"\\", blacklist_categories=("Cs", "Z", "Cc")
    ),
    min_size=1,
    max_size=40,
).map(lambda text: f"Q{text}Q")  # marked, so it cannot be mistaken for the rest


class TestRedactUrl:
    """What is hidden and what stays."""

    @pytest.mark.parametrize(
        ("url", "shown"),
        [
            ("nats://alice:s3cret@10.0.0.1:4222", "nats://alice:***@10.0.0.1:4222"),
            ("tls://tok3n@nats.internal:4222", "tls://***@nats.internal:4222"),
            (
                "nats://a:p1@h1:4222,nats://t2@h2:4222,nats://h3:4222",
                "nats://a:***@h1:4222,nats://***@h2:4222,nats://h3:4222",
            ),
            ("nats://u:p@ss@h:4222", "nats://u:***@h:4222"),
            ("postgresql://timer@db/timer", "postgresql://timer@db/timer"),
            (
                "postgresql+psycopg://timer:pw@db:5432/timer?sslmode=verify-full&password=pw2",
                "postgresql+psycopg://timer:***@db:5432/timer?sslmode=verify-full&password=***",
            ),
            (
                "postgresql://t@h1:5432,h2:5432/db?sslpassword=k&sslkey=/etc/k.pem",
                "postgresql://t@h1:5432,h2:5432/db?sslpassword=***&sslkey=/etc/k.pem",
            ),
            (
                "host=db user=timer password='a b c' sslmode=require",
                "host=db user=timer password=*** sslmode=require",
            ),
            (
                "cannot connect to NATS at nats://x:y@h:1: refused",
                "cannot connect to NATS at nats://x:***@h:1: refused",
            ),
            ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
            ("", ""),
        ],
    )
    def test_cases(self, url: str, shown: str) -> None:
        """Passwords, tokens and password-like parameters become ***; the rest stays."""
        assert redact_url(url) == shown

    @given(password=_SECRET, token=_SECRET)
    def test_no_secret_survives(self, password: str, token: str) -> None:
        """Whatever a password or token holds, it is gone from a cluster URL, and redacting
        the result again changes nothing."""
        url = f"nats://alice:{password}@h1:4222,tls://{token}@h2:4222?token={token}"
        shown = redact_url(url)
        assert password not in shown
        assert token not in shown
        assert redact_url(shown) == shown
