"""``timer-service dlq``: list dead-lettered commands with their reasons, and replay them.

The command line around :class:`timer_adapters_nats.DeadLetters`, which knows the stream,
its subjects and headers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from timer_adapters_nats import (
    BrokerUnavailable,
    DeadLetter,
    DeadLetters,
    NatsConnection,
    NatsSettings,
)
from timer_core import InvalidIdentifier
from timer_core.redaction import redact_url
from timer_service.app import StartupError
from timer_service.settings import Settings

__all__ = ["run_dlq"]


def _dead_letter_json(letter: DeadLetter) -> dict[str, object]:
    """One dead letter as ``dlq list --json`` prints it."""
    return {
        "seq": letter.seq,
        "subject": letter.subject,
        "tenant": letter.tenant,
        "reason": letter.reason,
        "time": None if letter.time is None else letter.time.isoformat(),
        "data": letter.data.decode("utf-8", errors="replace"),
        "truncatedFrom": letter.truncated_from,
    }


def _read_fixed(path: str) -> bytes:
    # A few kilobytes read once before any I/O starts: blocking the loop here costs nothing.
    return sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()


async def run_dlq(settings: Settings, args: argparse.Namespace, url: str) -> int:
    """The ``dlq list`` and ``dlq replay`` subcommands."""
    data: bytes | None = None
    if args.dlq_command == "replay" and args.data is not None:
        if len(args.sequences) != 1 or args.all:
            print("timer-service: dlq replay --data: name exactly one sequence", file=sys.stderr)
            return 2
        try:
            data = _read_fixed(args.data)
        except OSError as exc:
            print(f"timer-service: dlq replay --data {args.data}: {exc}", file=sys.stderr)
            return 2
    connection = NatsConnection(
        NatsSettings(
            url=url,
            subject_prefix=settings.subject_prefix,
            connect_timeout_s=5.0,
            client_name="timer-service-dlq",
            **settings.broker_security,
        )
    )
    try:
        await connection.start()
    except BrokerUnavailable as exc:
        raise StartupError(f"TIMER_BROKER_URL={redact_url(url)}: {exc}") from exc
    dead_letters = DeadLetters(connection)
    try:
        if args.dlq_command == "list":
            letters = await dead_letters.list(tenant=args.tenant, limit=args.limit)
            if args.json:
                print(json.dumps([_dead_letter_json(letter) for letter in letters], indent=2))
            else:
                for letter in letters:
                    print(f"{letter.seq:>8}  {letter.tenant:<20}  {letter.reason}")
                print(f"{len(letters)} dead letter(s)", file=sys.stderr)
            return 0
        sequences = list(args.sequences)
        if args.all:
            letters = await dead_letters.list(tenant=args.tenant, limit=1_000_000)
            sequences = [letter.seq for letter in letters]
        if not sequences:
            print("timer-service: dlq replay: name sequence numbers or --all", file=sys.stderr)
            return 2
        failed = 0
        for result in await dead_letters.replay(sequences, data=data):
            print(f"{result.seq:>8}  {result.outcome}")
            failed += not result.replayed
        return 1 if failed else 0
    except InvalidIdentifier as exc:
        print(f"timer-service: dlq {args.dlq_command} --tenant: {exc}", file=sys.stderr)
        return 2
    finally:
        await connection.aclose()
