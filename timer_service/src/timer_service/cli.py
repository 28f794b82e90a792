"""The ``timer-service`` command: run the service, send commands, inspect timers, run a demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from timer_core import (
    ComponentFailed,
    CorrelationId,
    InvalidIdentifier,
    InvalidTimestamp,
    SchemaNotFound,
    ServiceCallId,
    TenantId,
    TimerEntry,
)
from timer_core.instants import format_timestamp, parse_timestamp
from timer_core.redaction import redact_url
from timer_service.app import StartupError, broker_url_file, build_store, serve
from timer_service.logformat import configure_logging
from timer_service.quarantine import QuarantineError, add_quarantine_parser, run_quarantine
from timer_service.settings import Settings, SettingsError, parse_duration
from timer_service.tenancy import TenantLimits

_DEFAULT_LIMITS = TenantLimits()

__all__ = ["main"]

EXIT_CONFIG = 2


class UsageError(Exception):
    """A command-line argument is unusable; one line says which and why."""


def _add_common(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("settings (override the TIMER_* environment variables)")
    group.add_argument("--db-path", dest="TIMER_DB_PATH", metavar="PATH")
    group.add_argument("--database-url", dest="TIMER_DATABASE_URL", metavar="URL")
    group.add_argument("--broker-url", dest="TIMER_BROKER_URL", metavar="URL")
    group.add_argument("--subject-prefix", dest="TIMER_SUBJECT_PREFIX", metavar="TOKEN")
    group.add_argument("--log-level", dest="TIMER_LOG_LEVEL", metavar="LEVEL")
    group.add_argument(
        "--log-format", dest="TIMER_LOG_FORMAT", choices=("text", "json"), metavar="FORMAT"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timer-service",
        description="Durable multi-tenant single-shot timers over SQLite and NATS JetStream.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="consume commands and fire due timers")
    _add_common(run)
    run.add_argument("--polling-interval", dest="TIMER_POLLING_INTERVAL", metavar="MS")
    run.add_argument("--batch-size", dest="TIMER_BATCH_SIZE", metavar="N")
    run.add_argument("--command-batch-size", dest="TIMER_COMMAND_BATCH_SIZE", metavar="N")
    run.add_argument("--http-port", dest="TIMER_HTTP_PORT", metavar="PORT")
    run.add_argument("--retention", dest="TIMER_RETENTION", metavar="DURATION")

    schedule = sub.add_parser("schedule", help="publish a ScheduleTimer command")
    _add_common(schedule)
    schedule.add_argument("tenant_id")
    schedule.add_argument("service_call_id")
    when = schedule.add_mutually_exclusive_group(required=True)
    when.add_argument("--at", help="due time, RFC 3339 with a zone (2030-01-01T09:00:00Z)")
    when.add_argument("--in", dest="due_in", help="due after a duration from now (10s, 5m, 2h)")
    schedule.add_argument("--correlation-id")

    cancel = sub.add_parser("cancel", help="publish a CancelTimer command")
    _add_common(cancel)
    cancel.add_argument("tenant_id")
    cancel.add_argument("service_call_id")
    cancel.add_argument("--correlation-id")

    inspect = sub.add_parser("inspect", help="show a tenant's timers from the database")
    _add_common(inspect)
    inspect.add_argument("tenant_id")
    what = inspect.add_mutually_exclusive_group()
    what.add_argument("--service-call", dest="service_call_id", help="only this timer")
    what.add_argument("--correlation-id", help="only the timers of this correlation id")
    inspect.add_argument("--limit", type=int, default=100)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")

    demo = sub.add_parser("demo", help="run the service on embedded defaults and watch timers fire")
    demo.add_argument("--timers", type=int, default=3000)
    demo.add_argument("--tenants", type=int, default=30)
    demo.add_argument("--spread", type=float, default=10.0, help="seconds over which they fall due")
    demo.add_argument("--plain", action="store_true", help="no live display (for logs and CI)")

    dlq = sub.add_parser("dlq", help="list or replay dead-lettered commands")
    _add_common(dlq)
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    dlq_list = dlq_sub.add_parser("list", help="show dead letters with their reasons")
    dlq_list.add_argument("--tenant", help="only this tenant's (_ = unreadable tenant)")
    dlq_list.add_argument("--limit", type=int, default=50)
    dlq_list.add_argument("--json", action="store_true", help="print JSON instead of lines")
    replay = dlq_sub.add_parser("replay", help="re-publish dead letters to the command subject")
    replay.add_argument("sequences", nargs="*", type=int, help="stream sequence numbers")
    replay.add_argument("--tenant")
    replay.add_argument("--all", action="store_true", help="every dead letter (of --tenant)")
    replay.add_argument(
        "--data", metavar="FILE", help="send the fixed command in FILE (- = stdin) instead"
    )
    for action in (dlq_list, replay):
        # Also accepted after the action; SUPPRESS keeps a flag given before it.
        _add_common(action)
        for argument in action._actions:
            if argument.dest.startswith("TIMER_"):
                argument.default = argparse.SUPPRESS
    add_quarantine_parser(sub, _add_common)

    nats_config = sub.add_parser(
        "nats-config",
        help="write the nats-server configuration isolating each tenant in its own account",
    )
    nats_config.add_argument(
        "tenants", nargs="*", metavar="TENANT", help="the tenants (default: TIMER_TENANTS)"
    )
    nats_config.add_argument(
        "--auth",
        choices=("password", "nkey"),
        default="password",
        help="users log in with a password or an NKey, read from the environment",
    )
    nats_config.add_argument("--output", metavar="FILE", help="write it there, not to stdout")
    for flag, meaning in (
        ("--max-connections", "connections each tenant may open at once"),
        ("--max-subscriptions", "subscriptions each tenant may hold, all its connections together"),
        ("--max-payload", "bytes of one message a tenant may publish, headers included"),
        ("--max-queued", "commands of one tenant waiting (TIMER_MAX_QUEUED_PER_TENANT)"),
        ("--max-dead-letters", "dead letters kept per tenant (TIMER_MAX_DEAD_LETTERS_PER_TENANT)"),
    ):
        limit = getattr(_DEFAULT_LIMITS, flag[2:].replace("-", "_"))
        nats_config.add_argument(
            flag, type=int, default=limit, metavar="N", help=f"{meaning} (default {limit})"
        )
    _add_common(nats_config)
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {key: value for key, value in vars(args).items() if key.startswith("TIMER_")}
    return Settings.from_environment(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``timer-service`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from timer_service.demo import run_demo

            configure_logging("WARNING")
            return run_demo(
                timers=args.timers, tenants=args.tenants, spread_s=args.spread, plain=args.plain
            )
        settings = _settings(args)
        configure_logging(settings.log_level, settings.log_format)
        if args.command == "run":
            return asyncio.run(_run(settings))
        if args.command in ("schedule", "cancel"):
            return asyncio.run(_send(settings, args))
        if args.command == "inspect":
            return asyncio.run(_inspect(settings, args))
        if args.command == "quarantine":
            return run_quarantine(settings, args)
        if args.command == "nats-config":
            return _nats_config(settings, args)
        if args.command == "dlq":
            from timer_service.deadletters import run_dlq

            return asyncio.run(run_dlq(settings, args, _broker_url(settings)))
    except (SettingsError, StartupError, UsageError, QuarantineError) as exc:
        print(f"timer-service: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    raise AssertionError(args.command)


async def _run(settings: Settings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve(settings, stop)
    except ComponentFailed as exc:  # logged with its traceback; the rest shut down cleanly
        print(f"timer-service: {exc}", file=sys.stderr)
        return 1
    return 0


def _nats_config(settings: Settings, args: argparse.Namespace) -> int:
    from timer_service.tenancy import nats_config

    tenants = args.tenants or list(settings.tenants or ())
    if not tenants:
        raise UsageError("nats-config: name the tenants, or set TIMER_TENANTS")
    try:
        limits = TenantLimits(
            max_connections=args.max_connections,
            max_subscriptions=args.max_subscriptions,
            max_payload=args.max_payload,
            max_queued=args.max_queued,
            max_dead_letters=args.max_dead_letters,
        )
        text = nats_config(
            tenants, subject_prefix=settings.subject_prefix, auth=args.auth, limits=limits
        )
    except ValueError as exc:
        raise UsageError(f"nats-config: {exc}") from None
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "w") as out:
            out.write(text)
    except OSError as exc:
        raise UsageError(f"--output {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {args.output} for {len(tenants)} tenant(s)", file=sys.stderr)
    return 0


def _broker_url(settings: Settings) -> str:
    if settings.broker_url is not None:
        return settings.broker_url
    try:
        return broker_url_file(settings).read_text().strip()
    except OSError:
        raise UsageError(
            "TIMER_BROKER_URL: not set, and no embedded broker is running for "
            f"TIMER_DB_PATH={settings.db_path} (start `timer-service run` first)"
        ) from None


def _ids(args: argparse.Namespace) -> tuple[TenantId, ServiceCallId, CorrelationId | None]:
    try:
        tenant = TenantId(args.tenant_id)
        call = ServiceCallId(args.service_call_id)
        correlation = None if args.correlation_id is None else CorrelationId(args.correlation_id)
    except InvalidIdentifier as exc:
        raise UsageError(str(exc)) from None
    return tenant, call, correlation


async def _send(settings: Settings, args: argparse.Namespace) -> int:
    from timer_adapters_nats import TimerClient

    tenant, call, correlation = _ids(args)
    due = None
    if args.command == "schedule":
        try:
            if args.at is not None:
                due = parse_timestamp(args.at, round_up=True)
            else:
                due = datetime.now(UTC) + timedelta(seconds=parse_duration("--in", args.due_in))
        except (InvalidTimestamp, SettingsError) as exc:
            raise UsageError(f"--at/--in: {exc}") from None
    url = _broker_url(settings)
    try:
        async with TimerClient.connect(
            url, subject_prefix=settings.subject_prefix, **settings.broker_security
        ) as client:
            if due is not None:
                envelope_id = await client.schedule(tenant, call, due, correlation_id=correlation)
                print(f"scheduled {tenant}/{call} due {format_timestamp(due)} (id {envelope_id})")
            else:
                envelope_id = await client.cancel(tenant, call, correlation_id=correlation)
                print(f"cancel sent for {tenant}/{call} (id {envelope_id})")
    except (OSError, TimeoutError) as exc:
        raise StartupError(
            f"TIMER_BROKER_URL={redact_url(url)}: cannot publish: {redact_url(str(exc))}"
        ) from exc
    return 0


def _entry_json(entry: TimerEntry) -> dict[str, Any]:
    return {
        "tenantId": entry.tenant_id,
        "serviceCallId": entry.service_call_id,
        "correlationId": entry.correlation_id,
        "state": entry.state.value,
        "dueAt": format_timestamp(entry.due_at),
        "registeredAt": format_timestamp(entry.registered_at),
        "reachedAt": None if entry.reached_at is None else format_timestamp(entry.reached_at),
    }


async def _inspect(settings: Settings, args: argparse.Namespace) -> int:
    try:
        tenant = TenantId(args.tenant_id)
        call = None if args.service_call_id is None else ServiceCallId(args.service_call_id)
        correlation = None if args.correlation_id is None else CorrelationId(args.correlation_id)
    except InvalidIdentifier as exc:
        raise UsageError(str(exc)) from None
    what = "TIMER_DATABASE_URL" if settings.database_url else f"TIMER_DB_PATH={settings.db_path}"
    # A read-only command: it never creates the file, the schema, nor migrates it.
    store = build_store(settings, read_only=True)
    try:
        await store.start()
    except SchemaNotFound as exc:
        raise UsageError(
            f"{what}: {redact_url(str(exc))}; "
            "run the service first (`timer-service run` creates it)"
        ) from None
    except Exception as exc:
        raise StartupError(f"{what}: cannot open: {redact_url(str(exc))}") from exc
    try:
        if call is not None:
            found = await store.get(tenant, call)
            entries = [] if found is None else [found]
        elif correlation is not None:
            entries = await store.find_by_correlation(tenant, correlation)
        else:
            entries = await store.list_for_tenant(tenant, limit=args.limit)
    finally:
        await store.aclose()
    rows = [_entry_json(entry) for entry in entries]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    columns = ("serviceCallId", "state", "dueAt", "reachedAt", "correlationId")
    table = Table(title=f"timers of tenant {tenant}")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[key] or "") for key in columns))
    Console().print(table)
    if not rows:
        print("no timers found", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
