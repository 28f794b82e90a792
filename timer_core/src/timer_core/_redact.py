"""Credentials out of what Timer prints: broker and database URLs lose their secrets."""

from __future__ import annotations

import re

__all__ = ["REDACTED", "redact_url"]

#: What a secret is replaced with.
REDACTED = "***"

# Schemes whose user info without a colon is a token (``nats://s3cret@host``); elsewhere
# (``postgresql://alice@host``) it is a user name, kept so an operator sees who connects.
_TOKEN_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})

# ``scheme://userinfo@``: the user info runs to the last "@" before the host part ends (a
# "/", "?", "#" or whitespace), so an unescaped "@" in a password is covered too, and a
# second comma-separated URL (whose "//" ends the first host part) is matched on its own.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<userinfo>[^/?#\s]*)@")

# ``password=...`` and kin in a query string or a libpq conninfo (``sslpassword``,
# ``token``, ``client_secret``...), the value quoted or up to the next separator.
_PARAMETER = re.compile(
    r"(?P<key>\b[A-Za-z_]*(?:password|passwd|pwd|secret|token)[A-Za-z_]*)"
    r"(?P<eq>\s*=\s*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s&#;'\"]+)",
    re.IGNORECASE,
)


def _userinfo(match: re.Match[str]) -> str:
    scheme, userinfo = match["scheme"], match["userinfo"]
    user, colon, _secret = userinfo.partition(":")
    if colon:
        shown = f"{user}:{REDACTED}"
    elif userinfo and scheme.lower() in _TOKEN_SCHEMES:
        shown = REDACTED
    else:
        shown = userinfo
    return f"{scheme}://{shown}@"


def _parameter(match: re.Match[str]) -> str:
    return f"{match['key']}{match['eq']}{REDACTED}"


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``.

    ``text`` may be one URL, several separated by commas (a NATS cluster), a libpq
    connection string, or a whole message quoting any of them. Replaced: the password of
    ``user:password@`` (the user name stays), a NATS token given as the user info
    (``nats://token@host``), and the values of ``password=``, ``sslpassword=``, ``token=``
    and similar parameters. Hosts, ports, paths and other parameters stay, so the result
    still says where Timer tried to connect. Pure and idempotent: ``redact_url`` of its own
    result changes nothing.

    >>> redact_url("nats://alice:s3cret@10.0.0.1:4222,nats://tok3n@10.0.0.2:4222")
    'nats://alice:***@10.0.0.1:4222,nats://***@10.0.0.2:4222'
    >>> redact_url("postgresql://timer@db/timer?sslmode=verify-full&password=s3cret")
    'postgresql://timer@db/timer?sslmode=verify-full&password=***'
    """
    return _PARAMETER.sub(_parameter, _USERINFO.sub(_userinfo, text))
