"""The service's typed settings, read from ``TIMER_*`` environment variables and CLI flags.

Validation happens here, once, at start: a bad value raises :class:`SettingsError`, whose one
line names the variable and what it expected.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs

from timer_core import InvalidIdentifier, TenantId
from timer_core.redaction import REDACTED, redact_url

__all__ = ["ENVIRONMENT", "OTLP_ENDPOINT_VARIABLES", "Settings", "SettingsError", "parse_duration"]

_T = TypeVar("_T")

#: How many fired timers per lateness bucket ``timer.firing.lateness`` (OpenTelemetry)
#: records one of, unless ``TIMER_OTEL_LATENESS_SAMPLE`` says otherwise.
OTEL_LATENESS_SAMPLE = 16


class SettingsError(ValueError):
    """A setting has a value the service cannot use; ``str()`` is one line naming it."""

    def __init__(self, variable: str, expected: str, got: object) -> None:
        self.variable = variable
        # A URL's password or token must not reach the terminal through a typo elsewhere.
        super().__init__(f"{variable}: expected {expected}, got {redact_url(repr(got))}")


def _shown_url(url: str | None) -> str:
    return repr(None if url is None else redact_url(url))


def _shown_secret(secret: str | None) -> str:
    return repr(None if secret is None else REDACTED)


@attrs.frozen
class Settings:
    """Everything ``timer-service`` is configured with; built by :meth:`from_environment`."""

    db_path: Path = Path("timer.db")
    database_url: str | None = attrs.field(default=None, repr=_shown_url)
    broker_url: str | None = attrs.field(default=None, repr=_shown_url)
    polling_interval_ms: int = 5000
    batch_size: int = 100
    command_batch_size: int = 1000
    subject_prefix: str = "timer"
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    http_token: str | None = attrs.field(default=None, repr=_shown_secret)
    """``TIMER_HTTP_TOKEN``: the bearer token the HTTP endpoint's actions and tenant data
    need (:mod:`timer_service.access`); None turns those endpoints off."""
    http_allowed_hosts: tuple[str, ...] | None = None
    """``TIMER_HTTP_ALLOWED_HOSTS``: ``Host`` names accepted besides the listen address."""
    http_probe_hosts: tuple[str, ...] | None = None
    """``TIMER_HTTP_PROBE_HOSTS``: ``Host`` names only ``/healthz`` and ``/metrics`` accept
    besides those (the name a load balancer or Prometheus reaches the service by)."""
    retention_s: float = 7 * 86_400.0
    census_interval_s: float = 30.0
    """``TIMER_CENSUS_INTERVAL``: how often the census of pending timers by due time is
    taken (``timer_timers_due``, ``timer_oldest_overdue_seconds``); 0 turns it off."""
    census_cap: int = 100_000
    """``TIMER_CENSUS_CAP``: each census bucket is counted up to this many timers."""
    console: bool = False
    """``TIMER_CONSOLE``: serve the operator's web console under ``/console``."""
    console_tenants: tuple[str, ...] | None = None
    """``TIMER_CONSOLE_TENANTS``: the only tenants the console shows and acts on."""
    provision: bool = True
    broker_state_grace_s: float = 30.0
    """``TIMER_BROKER_STATE_GRACE``: how long a stream or consumer may stay missing (not
    recreated) before the service exits 1."""
    tenants: tuple[str, ...] | None = None
    """``TIMER_TENANTS``: the tenants of the per-tenant account recipe (their event consumers
    are provisioned and watched; ``timer-service nats-config`` writes their accounts)."""
    consumer_name: str = "timer-service"
    intake: Literal["per-tenant", "shared"] = "per-tenant"
    """``TIMER_INTAKE``: ``per-tenant``, a command consumer per tenant (one tenant's backlog
    holds back its own commands only), or ``shared``, one consumer for every tenant (always
    so with ``TIMER_PROVISION=false``)."""
    stream_replicas: int = 1
    lease_s: float = 30.0
    ack_wait_s: float = 3.0
    max_pending_per_tenant: int | None = None
    max_queued_per_tenant: int | None = None
    """``TIMER_MAX_QUEUED_PER_TENANT``: most commands of one tenant waiting in
    TIMER_COMMANDS (more are refused at publish); unset or 0: no limit."""
    max_dead_letters_per_tenant: int | None = None
    """``TIMER_MAX_DEAD_LETTERS_PER_TENANT``: most dead letters kept per tenant; unset or
    0: no limit."""
    instance_id: str | None = None
    sqlite_synchronous: Literal["NORMAL", "FULL"] = "FULL"
    clock_skew_warning_s: float = 1.0
    """A WARNING is logged while this host's wall clock is further than this off the
    database's (PostgreSQL; the database's clock decides)."""
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"
    broker_tls_ca_file: Path | None = None
    broker_tls_cert_file: Path | None = None
    broker_tls_key_file: Path | None = None
    broker_creds_file: Path | None = None
    broker_nkey_seed_file: Path | None = None
    broker_token: str | None = attrs.field(default=None, repr=_shown_secret)
    broker_inbox_prefix: str = "_INBOX"
    embedded_nats_sync: Literal["always", "interval"] = "always"
    """``TIMER_EMBEDDED_NATS_SYNC``: ``always``: the embedded nats-server forces every write
    to disk before it acknowledges it; ``interval``: nats-server's default, every two minutes
    (a power loss can lose what it acknowledged since)."""
    broker_monitor_url: str | None = attrs.field(default=None, repr=_shown_url)
    """``TIMER_BROKER_MONITOR_URL``: an external nats-server's monitoring endpoint
    (``http://host:8222``), where the service reads at start whether it syncs before it
    acknowledges."""
    require_durable_broker: bool = False
    """``TIMER_REQUIRE_DURABLE_BROKER``: refuse to start unless the broker is known to force
    every acknowledged write to disk."""
    otel: bool = False
    """OpenTelemetry traces and metrics (the ``otel`` extra): ``TIMER_OTEL``, else on when an
    ``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set; ``OTEL_SDK_DISABLED=true`` turns it off."""
    otel_timer_spans: bool = False
    """A ``timer.due`` span per traced timer fired, in the trace that scheduled it."""
    otel_lateness_sample: int = OTEL_LATENESS_SAMPLE
    """``timer.firing.lateness`` records one fired timer in this many in each of its buckets."""

    @property
    def broker_security(self) -> dict[str, Any]:
        """The TLS and authentication arguments of ``NatsSettings`` / ``TimerClient.connect``."""
        return {
            "tls_ca_file": self.broker_tls_ca_file,
            "tls_cert_file": self.broker_tls_cert_file,
            "tls_key_file": self.broker_tls_key_file,
            "creds_file": self.broker_creds_file,
            "nkey_seed_file": self.broker_nkey_seed_file,
            "token": self.broker_token,
            "inbox_prefix": self.broker_inbox_prefix,
        }

    @property
    def polling_interval_s(self) -> float:
        return self.polling_interval_ms / 1000.0

    @property
    def owner_id(self) -> str | None:
        """This instance's name in PostgreSQL claim leases: ``TIMER_INSTANCE_ID``, else None
        for the store's default (``<hostname>-<pid>-<random>``, new at each start)."""
        return self.instance_id

    @property
    def embedded_broker(self) -> bool:
        """Whether ``run`` starts its own ``nats-server`` (no broker URL configured)."""
        return self.broker_url is None

    @property
    def nats_store_dir(self) -> Path:
        """Where the embedded ``nats-server`` keeps JetStream data: beside the database."""
        return self.db_path.parent / f"{self.db_path.name}.nats"

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> Settings:
        """Read ``TIMER_*`` variables; keyword overrides (from CLI flags) win over them.

        Overrides are given as strings or already-typed values under the variable's name
        (``TIMER_DB_PATH="x.db"``); None means "not given".
        """
        env = dict(os.environ if environ is None else environ)
        env.update({key: str(value) for key, value in overrides.items() if value is not None})
        values: dict[str, Any] = {}
        for variable, (field, parse) in ENVIRONMENT.items():
            raw = env.get(variable)
            if raw is None or raw == "":
                continue
            values[field] = parse(variable, raw)
        if "otel" not in values:
            values["otel"] = any(env.get(name) for name in OTLP_ENDPOINT_VARIABLES)
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            values["otel"] = False
        if "database_url" in values and "db_path" in values:
            raise SettingsError(
                "TIMER_DATABASE_URL",
                "to be unset when TIMER_DB_PATH is set",
                values["database_url"],
            )
        _check_broker_security(values)
        return cls(**values)


def _check_broker_security(values: dict[str, Any]) -> None:
    if ("broker_tls_cert_file" in values) != ("broker_tls_key_file" in values):
        given, missing = (
            ("TIMER_BROKER_TLS_CERT_FILE", "TIMER_BROKER_TLS_KEY_FILE")
            if "broker_tls_cert_file" in values
            else ("TIMER_BROKER_TLS_KEY_FILE", "TIMER_BROKER_TLS_CERT_FILE")
        )
        raise SettingsError(missing, f"to be set as well when {given} is set", None)
    methods = [
        f"TIMER_BROKER_{name.upper()}"
        for name in ("creds_file", "nkey_seed_file", "token")
        if f"broker_{name}" in values
    ]
    if len(methods) > 1:
        raise SettingsError(methods[1], f"to be unset when {methods[0]} is set", REDACTED)


def _int(low: int, high: int, what: str) -> Callable[[str, str], int]:
    def parse(variable: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise SettingsError(variable, what, raw) from None
        if not low <= value <= high:
            raise SettingsError(variable, what, raw)
        return value

    return parse


def _path(variable: str, raw: str) -> Path:
    if "\x00" in raw:
        raise SettingsError(variable, "a file path", raw)
    return Path(raw).expanduser()


def _url(schemes: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(variable: str, raw: str) -> str:
        raw = raw.strip()
        if not re.fullmatch(rf"({'|'.join(map(re.escape, schemes))})://[^\s]+", raw):
            wanted = " or ".join(f"{scheme}://..." for scheme in schemes)
            raise SettingsError(variable, f"a URL like {wanted}", raw)
        return raw

    return parse


def _nats_urls(variable: str, raw: str) -> str:
    # A cluster is given as several URLs, comma-separated; the client tries each in turn.
    parse = _url(("nats", "tls"))
    parts = [part.strip() for part in raw.split(",")]
    if not all(parts):
        raise SettingsError(variable, "one NATS URL or several separated by commas", raw)
    return ",".join(parse(variable, part) for part in parts)


def _file(variable: str, raw: str) -> Path:
    path = _path(variable, raw)
    if not path.is_file() or not os.access(path, os.R_OK):
        raise SettingsError(variable, "a readable file", raw)
    return path


_MIN_HTTP_TOKEN = 16


def _http_token(variable: str, raw: str) -> str:
    value = _secret(variable, raw)
    if len(value) < _MIN_HTTP_TOKEN:
        raise SettingsError(variable, f"a token of at least {_MIN_HTTP_TOKEN} characters", REDACTED)
    return value


_HOST_NAME = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:\d{1,5})?")


def _host_names(variable: str, raw: str) -> tuple[str, ...]:
    names = tuple(part.strip().lower() for part in raw.split(",") if part.strip())
    if not names or not all(_HOST_NAME.fullmatch(name) for name in names):
        raise SettingsError(variable, "host names (host or host:port), comma-separated", raw)
    return names


def _tenants(variable: str, raw: str) -> tuple[str, ...]:
    tenants: list[str] = []
    for part in raw.split(","):
        if not part.strip():
            continue
        tenant = _token(variable, part)
        if len(tenant) > 64:
            raise SettingsError(variable, "tenant ids of at most 64 characters", part)
        if tenant not in tenants:
            tenants.append(tenant)
    if not tenants:
        raise SettingsError(variable, "tenant ids separated by commas", raw)
    return tuple(tenants)


def _secret(variable: str, raw: str) -> str:
    value = raw.strip()
    if not value or any(char.isspace() for char in value):
        raise SettingsError(variable, "a token without whitespace", REDACTED)
    return value


_SUBJECT_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def _subject_prefix(variable: str, raw: str) -> str:
    value = raw.strip()
    if _SUBJECT_PREFIX.fullmatch(value) is None:
        raise SettingsError(variable, "dot-separated tokens of [A-Za-z0-9_-]", raw)
    return value


def _token(variable: str, raw: str) -> str:
    try:
        return str(TenantId(raw.strip()))
    except InvalidIdentifier:
        raise SettingsError(variable, "1-128 characters of [A-Za-z0-9_-]", raw) from None


def _choice(*options: str, lower: bool = False) -> Callable[[str, str], str]:
    def parse(variable: str, raw: str) -> str:
        value = raw.strip().lower() if lower else raw.strip().upper()
        if value not in options:
            raise SettingsError(variable, "one of " + ", ".join(options), raw)
        return value

    return parse


def _limit(variable: str, raw: str) -> int | None:
    """A per-tenant limit: an integer from 1, or 0 for none."""
    value = _int(0, 1_000_000_000, "an integer between 0 (no limit) and 1000000000")(variable, raw)
    return value or None


def _tenant_ids(variable: str, raw: str) -> tuple[str, ...]:
    # Any tenant id (up to 128 characters; TIMER_TENANTS' are NATS account names, 64 at most).
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not names:
        raise SettingsError(variable, "tenant ids separated by commas", raw)
    return tuple(sorted({_token(variable, name) for name in names}))


def _bool(variable: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(variable, "true or false", raw)


_INSTANCE_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,200}")


def _instance_id(variable: str, raw: str) -> str:
    value = raw.strip()
    if _INSTANCE_ID.fullmatch(value) is None:
        raise SettingsError(variable, "1-200 characters of [A-Za-z0-9_.:@-]", raw)
    return value


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, None: 1.0}


def parse_duration(variable: str, raw: str) -> float:
    """Seconds in ``raw`` (``7d``, ``12h``, ``30m``, ``500ms``, ``3600``); a
    :class:`SettingsError` naming ``variable`` when it is not a duration."""
    match = _DURATION.fullmatch(raw.strip())
    if match is None:
        raise SettingsError(variable, "a duration like 7d, 12h, 30m or 3600 (seconds)", raw)
    return float(match.group(1)) * _UNITS[match.group(2)]


def _positive_duration(variable: str, raw: str) -> float:
    value = parse_duration(variable, raw)
    if value <= 0:
        raise SettingsError(variable, "a duration above zero like 30s or 500ms", raw)
    return value


def _census_interval(variable: str, raw: str) -> float:
    value = parse_duration(variable, raw)
    if value != 0 and value < 1:
        raise SettingsError(variable, "0 (off) or a duration of at least 1s like 30s", raw)
    return value


def _str_parse(variable: str, raw: str) -> str:
    return raw.strip()


#: Every environment variable the service reads: name -> (settings field, parser).
ENVIRONMENT: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "TIMER_DB_PATH": ("db_path", _path),
    "TIMER_DATABASE_URL": ("database_url", _url(("postgresql", "postgresql+psycopg"))),
    "TIMER_BROKER_URL": ("broker_url", _nats_urls),
    "TIMER_POLLING_INTERVAL": (
        "polling_interval_ms",
        _int(1, 86_400_000, "milliseconds between 1 and 86400000"),
    ),
    "TIMER_BATCH_SIZE": ("batch_size", _int(1, 100_000, "an integer between 1 and 100000")),
    "TIMER_COMMAND_BATCH_SIZE": (
        "command_batch_size",
        _int(1, 100_000, "an integer between 1 and 100000"),
    ),
    "TIMER_SUBJECT_PREFIX": ("subject_prefix", _token),
    "TIMER_HTTP_HOST": ("http_host", _str_parse),
    "TIMER_HTTP_PORT": ("http_port", _int(0, 65535, "a port between 0 and 65535 (0 = off)")),
    "TIMER_HTTP_TOKEN": ("http_token", _http_token),
    "TIMER_HTTP_ALLOWED_HOSTS": ("http_allowed_hosts", _host_names),
    "TIMER_HTTP_PROBE_HOSTS": ("http_probe_hosts", _host_names),
    "TIMER_RETENTION": ("retention_s", _positive_duration),
    "TIMER_CENSUS_INTERVAL": ("census_interval_s", _census_interval),
    "TIMER_CENSUS_CAP": ("census_cap", _int(1, 100_000_000, "an integer between 1 and 100000000")),
    "TIMER_CONSOLE": ("console", _bool),
    "TIMER_CONSOLE_TENANTS": ("console_tenants", _tenant_ids),
    "TIMER_PROVISION": ("provision", _bool),
    "TIMER_BROKER_STATE_GRACE": ("broker_state_grace_s", _positive_duration),
    "TIMER_TENANTS": ("tenants", _tenants),
    "TIMER_CONSUMER_NAME": ("consumer_name", _token),
    "TIMER_INTAKE": ("intake", _choice("per-tenant", "shared", lower=True)),
    "TIMER_STREAM_REPLICAS": ("stream_replicas", _int(1, 5, "an integer between 1 and 5")),
    "TIMER_LEASE": ("lease_s", _positive_duration),
    "TIMER_ACK_WAIT": ("ack_wait_s", _positive_duration),
    "TIMER_MAX_PENDING_PER_TENANT": (
        "max_pending_per_tenant",
        _int(1, 1_000_000_000, "an integer between 1 and 1000000000 (unset: no cap)"),
    ),
    "TIMER_MAX_QUEUED_PER_TENANT": ("max_queued_per_tenant", _limit),
    "TIMER_MAX_DEAD_LETTERS_PER_TENANT": ("max_dead_letters_per_tenant", _limit),
    "TIMER_INSTANCE_ID": ("instance_id", _instance_id),
    "TIMER_SQLITE_SYNCHRONOUS": ("sqlite_synchronous", _choice("NORMAL", "FULL")),
    "TIMER_CLOCK_SKEW_WARNING": ("clock_skew_warning_s", _positive_duration),
    "TIMER_LOG_LEVEL": ("log_level", _choice("DEBUG", "INFO", "WARNING", "ERROR")),
    "TIMER_LOG_FORMAT": ("log_format", _choice("text", "json", lower=True)),
    "TIMER_BROKER_TLS_CA_FILE": ("broker_tls_ca_file", _file),
    "TIMER_BROKER_TLS_CERT_FILE": ("broker_tls_cert_file", _file),
    "TIMER_BROKER_TLS_KEY_FILE": ("broker_tls_key_file", _file),
    "TIMER_BROKER_CREDS_FILE": ("broker_creds_file", _file),
    "TIMER_BROKER_NKEY_SEED_FILE": ("broker_nkey_seed_file", _file),
    "TIMER_BROKER_TOKEN": ("broker_token", _secret),
    "TIMER_BROKER_INBOX_PREFIX": ("broker_inbox_prefix", _subject_prefix),
    "TIMER_EMBEDDED_NATS_SYNC": ("embedded_nats_sync", _choice("always", "interval", lower=True)),
    "TIMER_BROKER_MONITOR_URL": ("broker_monitor_url", _url(("http", "https"))),
    "TIMER_REQUIRE_DURABLE_BROKER": ("require_durable_broker", _bool),
    "TIMER_OTEL": ("otel", _bool),
    "TIMER_OTEL_TIMER_SPANS": ("otel_timer_spans", _bool),
    "TIMER_OTEL_LATENESS_SAMPLE": (
        "otel_lateness_sample",
        _int(1, 1_000_000, "an integer between 1 and 1000000 (1 records every timer)"),
    ),
}

#: The standard OpenTelemetry variables naming where OTLP goes: any of them set turns
#: OpenTelemetry on (unless ``TIMER_OTEL`` says otherwise) and exporting with it.
OTLP_ENDPOINT_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)
