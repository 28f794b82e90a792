"""The dead-letter stream: the form of a dead letter, and listing and replaying them.

The command source writes dead letters (:class:`~timer_adapters_nats.NatsCommandSource`,
built by :func:`dead_letter_message` with the ``Timer-*`` headers below); :class:`DeadLetters`
reads them back and re-publishes them to the command subject of their tenant.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator, Sequence
from datetime import datetime

import attrs
import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from timer_adapters_nats._acked import MSG_ID, Outgoing
from timer_adapters_nats._connection import BrokerUnavailable, NatsConnection
from timer_adapters_nats._settings import Subjects
from timer_core import DecodeError, InvalidIdentifier, TenantId
from timer_core.codec import decode_command
from timer_core.redaction import redact_url

__all__ = [
    "ERROR_HEADER",
    "ORIGINAL_SUBJECT_HEADER",
    "TRUNCATED_HEADER",
    "DeadLetter",
    "DeadLetters",
    "Replayed",
    "dead_letter_message",
]

ERROR_HEADER = "Timer-Error"
"""The dead-letter header saying in one line why a command was rejected."""
ORIGINAL_SUBJECT_HEADER = "Timer-Original-Subject"
"""The dead-letter header naming the subject the rejected command was sent to."""

TRUNCATED_HEADER = "Timer-Truncated"
"""Set on a dead letter whose body had to be cut to fit the server's max_payload beside the
headers: the original length in bytes (the whole command stays in the commands stream)."""

_MAX_REASON = 1000


def _headers_size(headers: dict[str, str]) -> int:
    """Bytes of the NATS/1.0 header block these headers are sent as."""
    lines = sum(len(key.encode()) + len(value.encode()) + 4 for key, value in headers.items())
    return len(b"NATS/1.0\r\n") + lines + 2


def _one_line(reason: str) -> str:
    """A header-safe reason: one ASCII line of bounded length."""
    text = " ".join(reason.split())
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def dead_letter_message(
    message: Msg, reason: str, subjects: Subjects, *, max_payload: int
) -> Outgoing:
    """The dead letter of a rejected command ``message``: its body unchanged, to
    ``<prefix>.dlq.<subject tenant>``, the reason as one line in :data:`ERROR_HEADER`.

    Its id is the command's stream and sequence, so a redelivery dead-lettered again (a crash
    before the command was terminated) is dropped as a duplicate. A body that cannot go out
    beside the headers within ``max_payload`` is cut to fit and marked :data:`TRUNCATED_HEADER`.
    """
    subject = subjects.dlq(subjects.tenant_of_command(message.subject))
    metadata = message.metadata
    msg_id = f"{metadata.stream}-{metadata.sequence.stream}"
    headers = {ERROR_HEADER: _one_line(reason), ORIGINAL_SUBJECT_HEADER: message.subject}
    data = message.data
    # The server counts headers against max_payload and drops the whole connection when
    # a publish exceeds it, so a command that only just fit cannot go out unchanged.
    room = max_payload - _headers_size(
        {**headers, TRUNCATED_HEADER: str(len(data)), MSG_ID: msg_id}
    )
    if len(data) > room:
        headers[TRUNCATED_HEADER] = str(len(data))
        data = data[: max(0, room)]
    return Outgoing(subject=subject, data=data, msg_id=msg_id, headers=headers)


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
    """The dead-letter stream of one Timer deployment, read and replayed on ``connection``.

    The connection's settings name the stream (:attr:`~NatsSettings.dlq_stream`) and the
    subjects (:attr:`~NatsSettings.subject_prefix`); a :class:`NatsBroker` is a connection.
    """

    def __init__(self, connection: NatsConnection) -> None:
        self._connection = connection
        self._stream = connection.settings.dlq_stream
        self._subjects = connection.settings.subjects

    async def list(
        self, *, tenant: str | None = None, limit: int = 50, after: int = 0
    ) -> list[DeadLetter]:
        """Dead letters in stream order, of one tenant (``_`` = unreadable tenant) or all,
        from the first after sequence number ``after`` (the last of the previous page).

        Raises :class:`~timer_core.errors.InvalidIdentifier` for a ``tenant`` that cannot be
        one, :class:`~timer_adapters_nats.BrokerUnavailable` when the broker does not answer.
        """
        subject = (
            self._subjects.dlq_filter if tenant is None else self._subjects.dlq(TenantId(tenant))
        )
        js = self._connection.jetstream
        found: list[DeadLetter] = []
        seq = after + 1
        while len(found) < limit:
            try:
                with self._answering("list"):
                    raw = await js.get_msg(self._stream, seq=seq, subject=subject, next=True)
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
        acknowledged the command. Raises :class:`~timer_adapters_nats.BrokerUnavailable` when
        the broker does not answer (what was replayed before stays replayed).
        """
        if data is not None and len(sequences) != 1:
            raise ValueError("a fixed command replaces exactly one dead letter")
        js = self._connection.jetstream
        results: list[Replayed] = []
        for seq in sequences:
            try:
                with self._answering("replay"):
                    raw = await js.get_msg(self._stream, seq=seq)
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
            with self._answering("replay"):
                ack = await js.publish(subject, body)
                await js.delete_msg(self._stream, seq)
            results.append(Replayed(seq, True, f"replayed to {subject} (seq {ack.seq})"))
        return results

    @contextlib.contextmanager
    def _answering(self, what: str) -> Iterator[None]:
        """nats-py's errors as the adapter's own (the not-found ones pass: they are answers)."""
        try:
            yield
        except NotFoundError:
            raise
        except nats.errors.Error as exc:
            url = redact_url(self._connection.settings.url)
            raise BrokerUnavailable(
                f"the broker at {url} did not answer a dead-letter {what}: "
                f"{type(exc).__name__} {redact_url(str(exc))}".rstrip()
            ) from exc

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
