"""``timer-service dlq``: list dead-lettered commands with their reasons, and replay them.

Dead letters live in the ``TIMER_DLQ`` stream on ``<prefix>.dlq.<tenantId>`` with the original
bytes and a ``Timer-Error`` header. Replaying re-publishes the bytes unchanged to the command
subject of their tenant and removes them from the dead-letter stream.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import datetime

import attrs
import nats
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from timer_service.settings import Settings

__all__ = ["DLQ_STREAM", "DeadLetter", "list_dead_letters", "replay_dead_letters", "run_dlq"]

DLQ_STREAM = "TIMER_DLQ"


@attrs.frozen
class DeadLetter:
    """One rejected command as the dead-letter stream holds it."""

    seq: int
    subject: str
    tenant: str
    reason: str
    data: bytes
    time: datetime | None

    def to_json(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "subject": self.subject,
            "tenant": self.tenant,
            "reason": self.reason,
            "time": None if self.time is None else self.time.isoformat(),
            "data": self.data.decode("utf-8", errors="replace"),
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
    js: JetStreamContext, prefix: str, sequences: Sequence[int]
) -> list[tuple[int, str]]:
    """Re-publish these dead letters to their tenant's command subject; returns what happened.

    A dead letter whose tenant was unreadable (``<prefix>.dlq._``) cannot be routed and stays.
    """
    results: list[tuple[int, str]] = []
    for seq in sequences:
        try:
            raw = await js.get_msg(DLQ_STREAM, seq=seq)
        except NotFoundError:
            results.append((seq, "not found"))
            continue
        tenant = (raw.subject or "").rpartition(".")[2]
        if tenant == "_":
            results.append((seq, "kept: its tenant is unreadable, it cannot be routed"))
            continue
        # No Nats-Msg-Id: the original id may still be in the command stream's duplicate window.
        ack = await js.publish(f"{prefix}.commands.{tenant}", raw.data or b"")
        await js.delete_msg(DLQ_STREAM, seq)
        results.append((seq, f"replayed to {prefix}.commands.{tenant} (seq {ack.seq})"))
    return results


def _dead_letter(
    seq: int, subject: str, headers: dict[str, str] | None, data: bytes | None, time: object
) -> DeadLetter:
    return DeadLetter(
        seq=seq,
        subject=subject,
        tenant=subject.rpartition(".")[2],
        reason=(headers or {}).get("Timer-Error", ""),
        data=data or b"",
        time=time if isinstance(time, datetime) else None,
    )


async def run_dlq(settings: Settings, args: argparse.Namespace, url: str) -> int:
    """The ``dlq list`` and ``dlq replay`` subcommands."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
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
        for seq, outcome in await replay_dead_letters(js, prefix, sequences):
            print(f"{seq:>8}  {outcome}")
            failed += not outcome.startswith("replayed")
        return 1 if failed else 0
    finally:
        await nc.close()
