"""How the NATS adapter is configured, and the subjects and streams the contract derives from it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from timer_core import ConfigurationError, ServiceCallId, TenantId, ValidationError
from timer_core.redaction import REDACTED, redact_url

__all__ = ["NatsSettings", "Subjects"]

# A subject prefix is one or more dot-separated tokens without wildcards or whitespace.
_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_STREAM = re.compile(r"[A-Za-z0-9_-]{1,64}")
# What nats-py connects to; anything else fails only later ("Name or service not known").
_SCHEMES = ("nats", "tls", "ws", "wss")
_SCHEME = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://[^/?#]")


def positive(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    """attrs validator: the value is above zero."""
    if not value > 0:
        raise ValidationError(f"{attribute.name} must be positive, got {value!r}")


def at_least_one(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    """attrs validator: the value is 1 or more."""
    if value < 1:
        raise ValidationError(f"{attribute.name} must be at least 1, got {value!r}")


def check_name(what: str, value: str) -> str:
    """``value`` if it is a valid stream or consumer name (1-64 of [A-Za-z0-9_-])."""
    if not isinstance(value, str) or _STREAM.fullmatch(value) is None:
        raise ValidationError(f"{what} must be 1-64 characters of [A-Za-z0-9_-], got {value!r}")
    return value


def doubling_delay(first: float, cap: float, delivery: int) -> float:
    """A redelivery delay: ``first`` after the first delivery, doubling, at most ``cap``."""
    doublings = min(max(delivery, 1) - 1, 30)
    return float(min(cap, first * 2**doublings))


def _prefix(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if _PREFIX.fullmatch(value) is None:
        raise ValidationError(
            f"{attribute.name} must be dot-separated tokens of [A-Za-z0-9_-], got {value!r}"
        )


def _name(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    check_name(attribute.name, value)


def _names_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _tenant_names(instance: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for tenant in value:
        check_name(f"{attribute.name} entry", str(TenantId(tenant)))


def _max_deliver(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value != -1 and value < 2:
        raise ValidationError(f"max_deliver must be -1 (unlimited) or at least 2, got {value!r}")


def _optional_cap(instance: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value < 1:
        raise ValidationError(f"{attribute.name} must be at least 1 (or None), got {value!r}")


def _optional_path(value: str | os.PathLike[str] | None) -> Path | None:
    return None if value is None else Path(value)


def server_urls(url: str) -> list[str]:
    """The servers of a comma-separated URL list; :class:`ValidationError` when there is none
    (nats-py would retry an empty list forever without yielding, past any timeout)."""
    if not isinstance(url, str):
        raise ValidationError(f"the NATS url must be a string, got {type(url).__name__}")
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValidationError(
            f"the NATS url must name at least one server, like nats://127.0.0.1:4222; got {url!r}"
        )
    for server in servers:
        match = _SCHEME.match(server)
        if match is None or match["scheme"].lower() not in _SCHEMES:
            shown = redact_url(server)
            hint = "" if match is not None else f" (nats://{shown}?)"
            raise ConfigurationError(
                f"each NATS server URL must start with nats://, tls://, ws:// or wss:// and "
                f"name a host, like nats://127.0.0.1:4222; got {shown!r}{hint}"
            )
    return servers


def _servers(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    server_urls(value)


def _shown_url(url: str) -> str:
    return repr(redact_url(url))


def _shown_secret(secret: str | None) -> str:
    return "None" if secret is None else repr(REDACTED)


@attrs.frozen
class NatsSettings:
    """Connection, provisioning, publishing and consuming settings; only ``url`` is required.

    Timeouts and delays are in seconds. The defaults suit one service instance against a
    local or nearby server.
    """

    url: str = attrs.field(repr=_shown_url, validator=_servers)
    """Server URL(s), comma-separated for a cluster, e.g. ``nats://127.0.0.1:4222``.

    ``tls://host:port`` asks for TLS (so does any ``tls_*`` setting); a user and password or
    a token may be given in it (``nats://user:password@host``, ``nats://token@host``).
    """
    subject_prefix: str = attrs.field(default="timer", validator=_prefix)
    """First subject token(s): ``<prefix>.commands.<tenantId>`` and so on."""
    consumer_name: str = attrs.field(default="timer", validator=_name)
    """The durable pull consumer on the commands stream. Instances that share the work share
    one name (``timer-service`` passes its ``TIMER_CONSUMER_NAME``, ``timer-service`` by
    default)."""
    provision: bool = True
    """Create missing streams and the consumer at start (and update the consumer's config)."""
    per_tenant_intake: bool = True
    """Read each tenant's commands through a durable consumer of its own,
    ``<consumer_name>_<tenantId>`` (created as tenants appear), so one tenant's backlog holds
    back its own commands only. False (and always with ``provision=False``, as the lanes are
    created while running): one shared consumer ``consumer_name``, in stream order."""
    stream_replicas: int = attrs.field(default=1, validator=at_least_one)
    """Replicas of each stream created by provisioning (3 on a 3-node cluster)."""
    duplicate_window_s: float = attrs.field(default=120.0, validator=positive)
    """JetStream duplicate window of the events and dead-letter streams; the contract wants
    at least 2 minutes. The commands stream gets the shortest JetStream allows (100 ms): its
    window would span tenants, and commands need none (docs/design.md)."""
    stream_max_age_s: float = attrs.field(default=7 * 24 * 3600.0, validator=positive)
    """How long provisioned streams keep messages."""
    max_queued_per_tenant: int | None = attrs.field(default=None, validator=_optional_cap)
    """Most commands of one tenant waiting in the commands stream (its per-subject limit,
    new ones refused: the producer's publish fails with ``maximum messages per subject
    exceeded``); None (the default): no limit. Set when provisioning creates the stream, and
    only with :attr:`per_tenant_intake`, whose lanes then remove each tenant's stored
    commands from the stream once acknowledged, so the limit counts what waits: the stream
    no longer keeps a week of commands to replay after a database restore."""
    max_dead_letters_per_tenant: int | None = attrs.field(default=None, validator=_optional_cap)
    """Most dead letters kept per tenant in the dead-letter stream (the oldest dropped
    first); None (the default): no limit. Set when provisioning creates the stream."""
    commands_stream: str = attrs.field(default="TIMER_COMMANDS", validator=_name)
    events_stream: str = attrs.field(default="TIMER_EVENTS", validator=_name)
    dlq_stream: str = attrs.field(default="TIMER_DLQ", validator=_name)
    tenant_consumers: tuple[str, ...] = attrs.field(
        default=(), converter=_names_tuple, validator=_tenant_names
    )
    """Tenants whose ``DueTimeReached`` consumer provisioning creates when absent: a durable
    pull consumer on the events stream named after the tenant and filtered to its events, as
    :meth:`NatsBroker.due_events` reads it with ``tenant_id``. For tenants that may not
    create consumers themselves (the per-tenant account recipe, docs/operations.md)."""

    publish_window: int = attrs.field(default=256, validator=at_least_one)
    """Most acked publishes in flight at once in a batch."""
    ack_timeout_s: float = attrs.field(default=5.0, validator=positive)
    """How long a publish waits for its JetStream ack before it counts as failed."""

    fetch_batch: int = attrs.field(default=100, validator=at_least_one)
    """Most commands fetched (and handed to the handler) at once."""
    fetch_timeout_s: float = attrs.field(default=1.0, validator=positive)
    """Long-poll time of one fetch (``stop()`` ends it at once, it does not wait it out)."""
    ack_wait_s: float = attrs.field(default=3.0, validator=positive)
    """Time the server gives a fetched command before redelivering it: what a crashed
    consumer costs its in-flight commands (they are re-applied about this long after its
    death). A live consumer keeps every command it holds alive with an in-progress ack at
    most a third of the ack wait after its delivery and after each in-progress ack, however
    long decoding and storing take (one settled sooner gets none); an event loop stalled for
    most of it would see commands redelivered while still in hand (applied twice, harmless).
    Provisioning updates an existing consumer to this value."""
    max_deliver: int = attrs.field(default=100, validator=_max_deliver)
    """Deliveries of one command before it is given up (dead-lettered); -1 is unlimited."""
    nak_delay_s: float = attrs.field(default=1.0, validator=positive)
    """Redelivery delay after the handler failed; it doubles with each delivery (the backoff)."""
    max_nak_delay_s: float = attrs.field(default=30.0, validator=positive)
    """Cap of the doubling redelivery delay."""

    connect_timeout_s: float = attrs.field(default=5.0, validator=positive)
    """How long ``start()`` tries to reach the server before it gives up."""
    reconnect_wait_s: float = attrs.field(default=0.5, validator=positive)
    """Pause between reconnect attempts once connected (reconnects never stop)."""
    ping_interval_s: float = attrs.field(default=10.0, validator=positive)
    """Client pings; a server silent for three of them counts as gone."""
    client_name: str = "timer"
    """Connection name shown in the server's monitoring (``timer-service`` names its own)."""

    tls_ca_file: Path | None = attrs.field(default=None, converter=_optional_path)
    """PEM file of the CA(s) that signed the server's certificate, instead of the system's.

    With it, with a client certificate or with a ``tls://`` URL the connection must be TLS
    and the server's certificate is verified against its host name; there is no switch to
    turn verification off.
    """
    tls_cert_file: Path | None = attrs.field(default=None, converter=_optional_path)
    """PEM client certificate (chain) for mutual TLS; needs :attr:`tls_key_file`."""
    tls_key_file: Path | None = attrs.field(default=None, converter=_optional_path)
    """PEM private key of :attr:`tls_cert_file`."""
    creds_file: Path | None = attrs.field(default=None, converter=_optional_path)
    """A ``.creds`` file (user JWT and NKey seed) for operator-mode servers and NGS/Synadia."""
    nkey_seed_file: Path | None = attrs.field(default=None, converter=_optional_path)
    """A file holding a user's NKey seed (``SU...``), for servers that list NKey users."""
    token: str | None = attrs.field(default=None, repr=_shown_secret)
    """An authentication token (never shown in ``repr``, logs or errors)."""
    inbox_prefix: str = attrs.field(default="_INBOX", validator=_prefix)
    """Subject prefix of this connection's reply inboxes. Give each user of a server with
    per-user permissions its own (``_INBOX.timer-service``) and allow it to subscribe only
    there, so no other user can read its replies (see docs/operations.md, Securing Timer)."""

    def __attrs_post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigurationError("tls_cert_file and tls_key_file must be given together")
        given = [
            name
            for name in ("creds_file", "nkey_seed_file", "token")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise ConfigurationError(
                f"give at most one of creds_file, nkey_seed_file and token, got {given}"
            )
        if self.token == "":
            raise ConfigurationError("token must not be empty (None for no token)")

    def security_options(self) -> dict[str, Any]:
        """The TLS, authentication and inbox arguments that these settings give to
        :func:`~timer_adapters_nats.connect` and ``TimerClient.connect``."""
        return {
            "tls_ca_file": self.tls_ca_file,
            "tls_cert_file": self.tls_cert_file,
            "tls_key_file": self.tls_key_file,
            "creds_file": self.creds_file,
            "nkey_seed_file": self.nkey_seed_file,
            "token": self.token,
            "inbox_prefix": self.inbox_prefix,
        }

    @property
    def lanes(self) -> bool:
        """Whether commands are read through a consumer per tenant (see
        :attr:`per_tenant_intake`)."""
        return self.per_tenant_intake and self.provision

    @property
    def subjects(self) -> Subjects:
        """The subjects derived from :attr:`subject_prefix`."""
        return Subjects(self.subject_prefix)

    def nak_delay(self, delivery: int) -> float:
        """Redelivery delay after the ``delivery``-th delivery failed in the handler."""
        return doubling_delay(self.nak_delay_s, self.max_nak_delay_s, delivery)


@attrs.frozen
class Subjects:
    """The contract's subjects under one prefix."""

    prefix: str = attrs.field(validator=_prefix)

    @property
    def commands_filter(self) -> str:
        """All command subjects: the commands stream's subject filter."""
        return f"{self.prefix}.commands.>"

    @property
    def events_filter(self) -> str:
        """All event subjects: the events stream's subject filter."""
        return f"{self.prefix}.events.>"

    @property
    def dlq_filter(self) -> str:
        """All dead-letter subjects: the DLQ stream's subject filter."""
        return f"{self.prefix}.dlq.>"

    def commands(self, tenant_id: TenantId) -> str:
        """Where commands for ``tenant_id`` are published."""
        return f"{self.prefix}.commands.{TenantId(tenant_id)}"

    def events(self, tenant_id: TenantId, service_call_id: ServiceCallId) -> str:
        """Where ``DueTimeReached`` for one timer is published."""
        # Concatenated, not an f-string, which formats each id (a str subclass) through a
        # __format__ call: once per timer fired.
        return self.prefix + ".events." + TenantId(tenant_id) + "." + ServiceCallId(service_call_id)

    def dlq(self, tenant_id: TenantId | None) -> str:
        """Where a rejected command goes: the tenant's dead-letter subject, or ``_``."""
        return f"{self.prefix}.dlq.{'_' if tenant_id is None else TenantId(tenant_id)}"

    def tenant_of_command(self, subject: str) -> TenantId | None:
        """The tenant token of a command subject, or None when it is not one valid id."""
        head = f"{self.prefix}.commands."
        if not subject.startswith(head):
            return None
        try:
            return TenantId(subject[len(head) :])
        except ValueError:
            return None
