"""``timer-service nats-config``: the ``nats-server`` configuration that isolates tenants, one
NATS account each, written from the list of tenants so that nobody edits it by hand.

The service's account (``TIMER``) holds JetStream: the streams, the service's command
consumer and one event consumer per tenant (the service provisions them, ``TIMER_TENANTS``).
Each tenant's account has no JetStream at all; it imports from ``TIMER`` exactly five
subjects, exported to it alone:

- ``<prefix>.commands.<tenant>``: its commands (the JetStream publish ack comes back);
- ``$JS.API.CONSUMER.MSG.NEXT.TIMER_EVENTS.<tenant>``: pulls from its own event consumer;
- ``$JS.ACK.TIMER_EVENTS.<tenant>.>``: acks, naks and in-progress of those events;
- ``$JS.API.CONSUMER.MSG.NEXT.TIMER_DLQ.<tenant>`` and ``$JS.ACK.TIMER_DLQ.<tenant>.>``: the
  same for its own dead letters (why a command of its was refused).

Each tenant's account has limits (:class:`TenantLimits`): connections, subscriptions and
payload, which ``nats-server`` enforces; its commands waiting and its dead letters kept are
limited on the streams the service creates (``TIMER_MAX_QUEUED_PER_TENANT``,
``TIMER_MAX_DEAD_LETTERS_PER_TENANT``), which the file's header names.

What crosses an account boundary is a service import, whose reply subject the server
replaces with a private one: whatever reply subject a tenant gives, the answer lands in the
tenant's own account, never on a subject of the service's (its JetStream API included) or
of another tenant's. Passwords or NKeys are ``$VARIABLES`` that ``nats-server`` reads from
its environment, never written in the file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import attrs

from timer_core import TenantId

__all__ = ["SERVICE_ACCOUNT", "SERVICE_USER", "TenantLimits", "nats_config", "secret_variable"]

#: The account holding JetStream and the service's user.
SERVICE_ACCOUNT = "TIMER"
#: The service's user name in it (password auth).
SERVICE_USER = "timer-service"

Auth = Literal["password", "nkey"]

_EVENTS_STREAM = "TIMER_EVENTS"
_DLQ_STREAM = "TIMER_DLQ"


def _at_least_one(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name.replace('_', '-')} must be at least 1, got {value}")


@attrs.frozen
class TenantLimits:
    """What one tenant may use; each a ``nats-config`` flag (``--max-connections`` ...)."""

    max_connections: int = attrs.field(default=16, validator=_at_least_one)
    """Connections open at once (the account's ``max_connections``)."""
    max_subscriptions: int = attrs.field(default=128, validator=_at_least_one)
    """Subscriptions of all its connections together (a client uses two to five)."""
    max_payload: int = attrs.field(default=8192, validator=_at_least_one)
    """Bytes of one message with its headers (a command with trace context is under 1 KiB)."""
    max_queued: int = attrs.field(default=20_000, validator=_at_least_one)
    """Its commands waiting in TIMER_COMMANDS (``TIMER_MAX_QUEUED_PER_TENANT``)."""
    max_dead_letters: int = attrs.field(default=5000, validator=_at_least_one)
    """Its dead letters kept in TIMER_DLQ (``TIMER_MAX_DEAD_LETTERS_PER_TENANT``)."""

    @property
    def max_bytes(self) -> int:
        """The most one tenant can have stored: its commands waiting and its dead letters
        (each at most ``max_payload``, a dead letter with up to 1 KiB of headers more)."""
        return self.max_queued * self.max_payload + self.max_dead_letters * (
            self.max_payload + 1024
        )


def secret_variable(tenant: str | None, auth: Auth) -> str:
    """The environment variable holding a user's password or NKey public key:
    ``TIMER_SERVICE_PASSWORD`` for the service (``tenant`` None),
    ``TIMER_TENANT_<TENANT>_PASSWORD`` for a tenant (upper case, ``-`` as ``_``)."""
    kind = "PASSWORD" if auth == "password" else "NKEY"
    if tenant is None:
        return f"TIMER_SERVICE_{kind}"
    return f"TIMER_TENANT_{re.sub(r'[^A-Z0-9_]', '_', tenant.upper())}_{kind}"


def account_name(tenant: str) -> str:
    """The NATS account of ``tenant``."""
    return f"TENANT_{tenant}"


def nats_config(
    tenants: Sequence[str],
    *,
    subject_prefix: str = "timer",
    auth: Auth = "password",
    limits: TenantLimits | None = None,
) -> str:
    """The configuration for ``tenants`` (valid tenant ids, at most 64 characters each), each
    with ``limits`` (the defaults of :class:`TenantLimits` when None).

    Raises :class:`ValueError` for an invalid, repeated or too long tenant id, or for two
    tenants whose secrets would share one variable name (``a-b`` and ``a_b``).
    """
    checked: list[str] = []
    variables: dict[str, str] = {}
    for raw in tenants:
        tenant = str(TenantId(raw))
        if len(tenant) > 64:
            raise ValueError(f"tenant id {tenant!r}: at most 64 characters (a consumer name)")
        if tenant in checked:
            raise ValueError(f"tenant {tenant!r} is listed twice")
        variable = secret_variable(tenant, auth)
        if variable in variables:
            raise ValueError(
                f"tenants {variables[variable]!r} and {tenant!r} would share ${variable}"
            )
        variables[variable] = tenant
        checked.append(tenant)
    if not checked:
        raise ValueError("name at least one tenant")
    limits = TenantLimits() if limits is None else limits
    flags = "".join(
        f" --{name.replace('_', '-')} {value}"
        for name, value in attrs.asdict(limits).items()
        if value != getattr(TenantLimits(), name)
    )
    lines = [
        "# nats-server configuration for Timer: one NATS account per tenant. Written by",
        f"# `timer-service nats-config{flags} {' '.join(checked)}`; regenerate it, do not",
        "# edit it.",
        "#",
        f"# Account {SERVICE_ACCOUNT} holds JetStream: the streams, the service's consumers",
        "# and one event and one dead-letter consumer per tenant (the service creates them:",
        "# TIMER_TENANTS). A tenant's account has no JetStream; it imports its command",
        "# subject, pulls from its own event and dead-letter consumers and acks what it read,",
        "# nothing else. Secrets come from the environment:",
        f"#   {secret_variable(None, auth)}",
        *(f"#   {variable}" for variable in variables),
        "#",
        f"# Each tenant: at most {limits.max_connections} connections, "
        f"{limits.max_subscriptions} subscriptions, {limits.max_payload} bytes a message",
        "# (nats-server refuses more). The service limits the rest on its streams; run it",
        "# with the same figures:",
        f"#   TIMER_MAX_QUEUED_PER_TENANT={limits.max_queued} (commands waiting; more refused)",
        f"#   TIMER_MAX_DEAD_LETTERS_PER_TENANT={limits.max_dead_letters} (oldest dropped)",
        f"# so a tenant stores at most {limits.max_bytes / 2**20:,.0f} MiB.",
        "",
        "jetstream {}",
        "",
        "accounts {",
        f"  {SERVICE_ACCOUNT}: {{",
        "    jetstream: enabled",
        f"    users: [{_user(SERVICE_USER, secret_variable(None, auth), auth)}]",
        "    exports: [",
    ]
    for tenant in checked:
        account = account_name(tenant)
        for subject, streamed in _exported(tenant, subject_prefix):
            response = ", response_type: stream" if streamed else ""
            lines.append(f'      {{service: "{subject}"{response}, accounts: [{account}]}}')
    lines += ["    ]", "  }"]
    for tenant in checked:
        subjects = [subject for subject, _ in _exported(tenant, subject_prefix)]
        allowed = ", ".join(f'"{subject}"' for subject in subjects)
        permissions = f'{{publish: {{allow: [{allowed}]}}, subscribe: {{allow: ["_INBOX.>"]}}}}'
        lines += [
            f"  {account_name(tenant)}: {{",
            "    users: [",
            f"      {_user(tenant, secret_variable(tenant, auth), auth, permissions)}",
            "    ]",
            f"    limits: {{max_connections: {limits.max_connections}, "
            f"max_subscriptions: {limits.max_subscriptions}, "
            f"max_payload: {limits.max_payload}, max_leafnodes: 0}}",
            "    imports: [",
            *(
                f'      {{service: {{account: {SERVICE_ACCOUNT}, subject: "{subject}"}}}}'
                for subject in subjects
            ),
            "    ]",
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _exported(tenant: str, prefix: str) -> list[tuple[str, bool]]:
    """The subjects the service's account exports to ``tenant``'s, and whether the answer to
    a request on it is a stream of messages (a pull) rather than one."""
    return [
        (f"{prefix}.commands.{tenant}", False),
        (f"$JS.API.CONSUMER.MSG.NEXT.{_EVENTS_STREAM}.{tenant}", True),
        (f"$JS.ACK.{_EVENTS_STREAM}.{tenant}.>", False),
        (f"$JS.API.CONSUMER.MSG.NEXT.{_DLQ_STREAM}.{tenant}", True),
        (f"$JS.ACK.{_DLQ_STREAM}.{tenant}.>", False),
    ]


def _user(name: str, variable: str, auth: Auth, permissions: str | None = None) -> str:
    fields = (
        [f'user: "{name}"', f"password: ${variable}"]
        if auth == "password"
        else [f"nkey: ${variable}"]
    )
    if permissions is not None:
        fields.append(f"permissions: {permissions}")
    return "{" + ", ".join(fields) + "}"
