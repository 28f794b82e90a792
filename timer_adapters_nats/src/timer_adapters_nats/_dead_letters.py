"""The dead-letter stream as operators handle it: list rejected commands, replay them.

The command source writes dead letters (:class:`~timer_adapters_nats.NatsCommandSource`,
with the ``Timer-*`` headers below); :class:`DeadLetters` reads them back and re-publishes
them to the command subject of their tenant.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import datetime

import attrs
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from timer_adapters_nats._settings import NatsSettings
from timer_adapters_nats._source import ERROR_HEADER, TRUNCATED_HEADER
from timer_core import DecodeError, InvalidIdentifier, TenantId, decode_command

__all__ = ["DeadLetter", "DeadLetters", "Replayed"]


@attrs.frozen
class DeadLetter:
    """One rejected command as the dead-letter stream holds it."""

    seq: int
    """Its sequence number in the dead-letter stream (what :meth:`DeadLetters.replay` takes)."""
    subject: str
    tenant: str
    """The tenant token of its subject: ``_`` when the command's tenant was unreadable."""
    reason: str
    """Why it was rejected (the ``Timer-Error`` header)."""
    data: bytes
    time: datetime | None
    truncated_from: int | None = None
    """The original size in bytes when ``data`` is only the start of the command."""


@attrs.frozen
class Replayed:
    """What :meth:`DeadLetters.replay` did with one dead letter."""

    seq: int
    replayed: bool
    """Whether it was re-published (and removed from the dead-letter stream)."""
    outcome: str
    """One line for an operator: where it went, or why it was kept."""


class DeadLetters:
    """The dead-letter stream of one Timer deployment, read and replayed through ``jetstream``.

    ``settings`` names the stream (:attr:`~NatsSettings.dlq_stream`) and the subjects
    (:attr:`~NatsSettings.subject_prefix`); its connection settings are not used here.
    """

    def __init__(self, jetstream: JetStreamContext, settings: NatsSettings) -> None:
        self._js = jetstream
        self._stream = settings.dlq_stream
        self._subjects = settings.subjects

    async def list(self, *, tenant: str | None = None, limit: int = 50) -> list[DeadLetter]:
        """Dead letters in stream order, of one tenant (``_`` = unreadable tenant) or all.

        Raises :class:`~timer_core.errors.InvalidIdentifier` for a ``tenant`` that cannot be
        one.
        """
        subject = (
            self._subjects.dlq_filter if tenant is None else self._subjects.dlq(TenantId(tenant))
        )
        found: list[DeadLetter] = []
        seq = 1
        while len(found) < limit:
            try:
                raw = await self._js.get_msg(self._stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            assert raw.seq is not None
            found.append(
                self._dead_letter(raw.seq, raw.subject or "", raw.headers, raw.data, raw.time)
            )
            seq = raw.seq + 1
        return found

    async def replay(
        self, sequences: Sequence[int], *, data: bytes | None = None
    ) -> builtins.list[Replayed]:
        """Re-publish these dead letters to their tenant's command subject, in order.

        With ``data`` (one sequence only), that fixed command is sent instead of the stored
        bytes, to the command subject of its own tenant, and only if it decodes. A dead letter
        whose tenant was unreadable, or whose body was cut to fit (``Timer-Truncated``), cannot
        be sent unchanged and stays. A replayed one is removed from the stream once JetStream
        acknowledged the command.
        """
        if data is not None and len(sequences) != 1:
            raise ValueError("a fixed command replaces exactly one dead letter")
        results: list[Replayed] = []
        for seq in sequences:
            try:
                raw = await self._js.get_msg(self._stream, seq=seq)
            except NotFoundError:
                results.append(Replayed(seq, False, "not found"))
                continue
            tenant: str = self._tenant_of(raw.subject or "")
            body = raw.data or b""
            truncated = (raw.headers or {}).get(TRUNCATED_HEADER)
            if data is None and truncated is not None:
                results.append(
                    Replayed(
                        seq,
                        False,
                        f"kept: only the first {len(body)} of {truncated} bytes were "
                        "kept; replay it with --data",
                    )
                )
                continue
            if data is not None:
                try:
                    tenant = decode_command(data).tenant_id
                except DecodeError as exc:
                    results.append(
                        Replayed(seq, False, f"kept: the fixed command is still invalid: {exc}")
                    )
                    continue
                body = data
            routed = _routable(tenant)
            if routed is None:
                results.append(
                    Replayed(seq, False, "kept: its tenant is unreadable, it cannot be routed")
                )
                continue
            subject = self._subjects.commands(routed)
            # No Nats-Msg-Id: the original id may still be in the command stream's duplicate
            # window, which would drop the replay.
            ack = await self._js.publish(subject, body)
            await self._js.delete_msg(self._stream, seq)
            results.append(Replayed(seq, True, f"replayed to {subject} (seq {ack.seq})"))
        return results

    def _tenant_of(self, subject: str) -> str:
        return subject.removeprefix(f"{self._subjects.prefix}.dlq.")

    def _dead_letter(
        self,
        seq: int,
        subject: str,
        headers: dict[str, str] | None,
        data: bytes | None,
        time: object,
    ) -> DeadLetter:
        headers = headers or {}
        truncated = headers.get(TRUNCATED_HEADER, "")
        return DeadLetter(
            seq=seq,
            subject=subject,
            tenant=self._tenant_of(subject),
            reason=headers.get(ERROR_HEADER, ""),
            data=data or b"",
            time=time if isinstance(time, datetime) else None,
            truncated_from=int(truncated) if truncated.isdigit() else None,
        )


def _routable(tenant: str) -> TenantId | None:
    """The tenant a dead letter can be sent back to; None for ``_`` (unreadable) or junk."""
    if tenant == "_":
        return None
    try:
        return TenantId(tenant)
    except InvalidIdentifier:
        return None
