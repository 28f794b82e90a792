"""``timer-service dlq``: list dead-lettered commands with their reasons, and replay them.

Dead letters live in the ``TIMER_DLQ`` stream on ``<prefix>.dlq.<tenantId>`` with the original
bytes and a ``Timer-Error`` header. Replaying re-publishes the bytes unchanged (or a fixed
command given instead) to the command subject of their tenant and removes them from the
dead-letter stream.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import attrs
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from timer_adapters_nats import BrokerUnavailable, connect
from timer_core import DecodeError, decode_command, redact_url
from timer_service.app import StartupError
from timer_service.settings import Settings

__all__ = [
    "DLQ_STREAM",
    "TRUNCATED_HEADER",
    "DeadLetter",
    "list_dead_letters",
    "replay_dead_letters",
    "run_dlq",
]

DLQ_STREAM = "TIMER_DLQ"
#: Set by the command source on a dead letter whose body had to be cut to fit (original size).
TRUNCATED_HEADER = "Timer-Truncated"


@attrs.frozen
class DeadLetter:
    """One rejected command as the dead-letter stream holds it."""

    seq: int
    subject: str
    tenant: str
    reason: str
    data: bytes
    time: datetime | None
    truncated_from: int | None = None
    """The original size in bytes when ``data`` is only the start of the command."""

    def to_json(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "subject": self.subject,
            "tenant": self.tenant,
            "reason": self.reason,
            "time": None if self.time is None else self.time.isoformat(),
            "data": self.data.decode("utf-8", errors="replace"),
            "truncatedFrom": self.truncated_from,
        }


async def list_dead_letters(
    js: JetStreamContext, prefix: str, *, tenant: str | None = None, limit: int = 50
) -> list[DeadLetter]:
    """Dead letters in stream order, of one tenant (``_`` = unreadable tenant) or all."""
    subject = f"{prefix}.dlq.{tenant}" if tenant else f"{prefix}.dlq.>"
    found: list[DeadLetter] = []
    seq = 1
    while len(found) < limit:
        try:
            raw = await js.get_msg(DLQ_STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            break
        assert raw.seq is not None
        found.append(_dead_letter(raw.seq, raw.subject or "", raw.headers, raw.data, raw.time))
        seq = raw.seq + 1
    return found


async def replay_dead_letters(
    js: JetStreamContext, prefix: str, sequences: Sequence[int], *, data: bytes | None = None
) -> list[tuple[int, str]]:
    """Re-publish these dead letters to their tenant's command subject; returns what happened.

    With ``data`` (one sequence only), that fixed command is sent instead of the stored bytes,
    to the command subject of its own tenant, and only if it decodes. A dead letter whose
    tenant was unreadable (``<prefix>.dlq._``) cannot be routed unchanged and stays.
    """
    if data is not None and len(sequences) != 1:
        raise ValueError("a fixed command replaces exactly one dead letter")
    results: list[tuple[int, str]] = []
    for seq in sequences:
        try:
            raw = await js.get_msg(DLQ_STREAM, seq=seq)
        except NotFoundError:
            results.append((seq, "not found"))
            continue
        tenant = (raw.subject or "").rpartition(".")[2]
        body = raw.data or b""
        truncated = (raw.headers or {}).get(TRUNCATED_HEADER)
        if data is None and truncated is not None:
            results.append(
                (
                    seq,
                    f"kept: only the first {len(body)} of {truncated} bytes were "
                    "kept; replay it with --data",
                )
            )
            continue
        if data is not None:
            try:
                tenant = decode_command(data).tenant_id
            except DecodeError as exc:
                results.append((seq, f"kept: the fixed command is still invalid: {exc}"))
                continue
            body = data
        if tenant == "_":
            results.append((seq, "kept: its tenant is unreadable, it cannot be routed"))
            continue
        # No Nats-Msg-Id: the original id may still be in the command stream's duplicate window.
        ack = await js.publish(f"{prefix}.commands.{tenant}", body)
        await js.delete_msg(DLQ_STREAM, seq)
        results.append((seq, f"replayed to {prefix}.commands.{tenant} (seq {ack.seq})"))
    return results


def _read_fixed(path: str) -> bytes:
    # A few kilobytes read once before any I/O starts: blocking the loop here costs nothing.
    return sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()


def _dead_letter(
    seq: int, subject: str, headers: dict[str, str] | None, data: bytes | None, time: object
) -> DeadLetter:
    headers = headers or {}
    truncated = headers.get(TRUNCATED_HEADER, "")
    return DeadLetter(
        seq=seq,
        subject=subject,
        tenant=subject.rpartition(".")[2],
        reason=headers.get("Timer-Error", ""),
        data=data or b"",
        time=time if isinstance(time, datetime) else None,
        truncated_from=int(truncated) if truncated.isdigit() else None,
    )


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
    try:
        nc = await connect(
            url, connect_timeout_s=5.0, name="timer-service-dlq", **settings.broker_security
        )
    except BrokerUnavailable as exc:
        raise StartupError(f"TIMER_BROKER_URL={redact_url(url)}: {exc}") from exc
    try:
        js = nc.jetstream()
        prefix = settings.subject_prefix
        if args.dlq_command == "list":
            letters = await list_dead_letters(js, prefix, tenant=args.tenant, limit=args.limit)
            if args.json:
                print(json.dumps([letter.to_json() for letter in letters], indent=2))
            else:
                for letter in letters:
                    print(f"{letter.seq:>8}  {letter.tenant:<20}  {letter.reason}")
                print(f"{len(letters)} dead letter(s)", file=sys.stderr)
            return 0
        sequences = list(args.sequences)
        if args.all:
            letters = await list_dead_letters(js, prefix, tenant=args.tenant, limit=1_000_000)
            sequences = [letter.seq for letter in letters]
        if not sequences:
            print("timer-service: dlq replay: name sequence numbers or --all", file=sys.stderr)
            return 2
        failed = 0
        for seq, outcome in await replay_dead_letters(js, prefix, sequences, data=data):
            print(f"{seq:>8}  {outcome}")
            failed += not outcome.startswith("replayed")
        return 1 if failed else 0
    finally:
        await nc.close()
