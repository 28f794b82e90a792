"""DeadLetters: the dead-letter stream read back and replayed, on a real nats-server."""

from __future__ import annotations

import json

import pytest

from tests.timer_adapters_nats.jetstream import read_stream
from timer_adapters_nats import (
    ERROR_HEADER,
    TRUNCATED_HEADER,
    BrokerUnavailable,
    DeadLetters,
    NatsBroker,
)
from timer_adapters_nats.embedded import NatsServerProcess
from timer_core import InvalidIdentifier


def command(tenant: str, call: str = "call-1") -> bytes:
    """A valid ScheduleTimer envelope of ``tenant``, as JSON bytes."""
    return json.dumps(
        {
            "id": "0190b6a4-7e4e-7b3c-9a51-3f1e2d4c5b6a",
            "type": "ScheduleTimer",
            "tenantId": tenant,
            "timestampMs": 1,
            "payload": {
                "_tag": "ScheduleTimer",
                "tenantId": tenant,
                "serviceCallId": call,
                "dueAt": "2031-01-01T00:00:00.000Z",
            },
        }
    ).encode()


async def dead_letter(
    broker: NatsBroker, token: str, data: bytes, reason: str = "bad", **headers: str
) -> int:
    """Put one dead letter on ``<prefix>.dlq.<token>`` as the command source does; its seq."""
    ack = await broker.jetstream.publish(
        f"timer.dlq.{token}", data, headers={ERROR_HEADER: reason, **headers}
    )
    return ack.seq


class TestList:
    async def test_lists_each_dead_letter_with_its_reason(self, broker: NatsBroker) -> None:
        """Each dead letter comes back in stream order with its tenant, reason and bytes."""
        first = await dead_letter(broker, "tenant-a", b"not json", "$: not valid JSON")
        second = await dead_letter(broker, "_", b"{}", "subject: not a tenant")
        letters = await DeadLetters(broker).list()
        assert [(d.seq, d.tenant, d.reason, d.data) for d in letters] == [
            (first, "tenant-a", "$: not valid JSON", b"not json"),
            (second, "_", "subject: not a tenant", b"{}"),
        ]
        assert letters[0].subject == "timer.dlq.tenant-a"
        assert letters[0].time is not None and letters[0].truncated_from is None

    async def test_tenant_and_limit_narrow_the_listing(self, broker: NatsBroker) -> None:
        """``tenant`` keeps one tenant's dead letters (``_``: unreadable ones); ``limit`` caps."""
        for token in ("tenant-a", "tenant-b", "tenant-a", "_"):
            await dead_letter(broker, token, b"[]")
        dead_letters = DeadLetters(broker)
        assert [d.tenant for d in await dead_letters.list(tenant="tenant-a")] == ["tenant-a"] * 2
        assert [d.tenant for d in await dead_letters.list(tenant="_")] == ["_"]
        assert len(await dead_letters.list(limit=3)) == 3

    async def test_an_invalid_tenant_is_refused(self, broker: NatsBroker) -> None:
        """A tenant that cannot be one is an InvalidIdentifier, not an empty listing."""
        with pytest.raises(InvalidIdentifier):
            await DeadLetters(broker).list(tenant="a.b")

    async def test_a_cut_dead_letter_says_its_original_size(self, broker: NatsBroker) -> None:
        """A dead letter marked ``Timer-Truncated`` reports the size the command had."""
        await dead_letter(broker, "tenant-a", b'{"id":', **{TRUNCATED_HEADER: "1048576"})
        (letter,) = await DeadLetters(broker).list()
        assert letter.truncated_from == 1048576


class TestReplay:
    async def test_replayed_unchanged_to_its_tenant_and_removed(self, broker: NatsBroker) -> None:
        """A dead letter is re-published unchanged to its tenant's command subject and deleted."""
        seq = await dead_letter(broker, "tenant-a", command("tenant-a"))
        dead_letters = DeadLetters(broker)
        (result,) = await dead_letters.replay([seq])
        assert result.replayed and result.seq == seq
        assert result.outcome.startswith("replayed to timer.commands.tenant-a")
        (sent,) = await read_stream(broker.jetstream, broker.settings.commands_stream)
        assert (sent.subject, sent.data) == ("timer.commands.tenant-a", command("tenant-a"))
        assert await dead_letters.list() == []

    async def test_a_fixed_command_goes_to_its_own_tenant(self, broker: NatsBroker) -> None:
        """With ``data``, the fixed command is sent instead, routed by its own tenant."""
        seq = await dead_letter(broker, "_", b"{}")
        dead_letters = DeadLetters(broker)
        (result,) = await dead_letters.replay([seq], data=command("tenant-b"))
        assert result.replayed
        (sent,) = await read_stream(broker.jetstream, broker.settings.commands_stream)
        assert sent.subject == "timer.commands.tenant-b"
        assert await dead_letters.list() == []

    async def test_what_cannot_be_sent_is_kept(self, broker: NatsBroker) -> None:
        """Unroutable, cut, still-invalid and unknown dead letters are kept, each said why."""
        unroutable = await dead_letter(broker, "_", b"{}")
        cut = await dead_letter(broker, "tenant-a", b'{"id":', **{TRUNCATED_HEADER: "2000000"})
        invalid = await dead_letter(broker, "tenant-a", b"not json")
        dead_letters = DeadLetters(broker)
        results = await dead_letters.replay([unroutable, cut, 999_999])
        results += await dead_letters.replay([invalid], data=b"still not json")
        assert [(r.seq, r.replayed) for r in results] == [
            (unroutable, False),
            (cut, False),
            (999_999, False),
            (invalid, False),
        ]
        outcomes = [r.outcome for r in results]
        assert outcomes[0] == "kept: its tenant is unreadable, it cannot be routed"
        assert "replay it with --data" in outcomes[1]
        assert outcomes[2] == "not found"
        assert outcomes[3].startswith("kept: the fixed command is still invalid: $:")
        assert [d.seq for d in await dead_letters.list()] == [unroutable, cut, invalid]
        assert await read_stream(broker.jetstream, broker.settings.commands_stream) == []

    async def test_a_fixed_command_replaces_exactly_one(self, broker: NatsBroker) -> None:
        """``data`` with other than one sequence is a ValueError before anything is sent."""
        with pytest.raises(ValueError, match="exactly one"):
            await DeadLetters(broker).replay([1, 2], data=b"{}")


class TestBrokerGone:
    async def test_listing_without_an_answer_is_broker_unavailable(
        self, broker: NatsBroker, nats_server: NatsServerProcess
    ) -> None:
        """With the server gone, listing dead letters raises the adapter's BrokerUnavailable
        naming the broker, not an error of nats-py's."""
        nats_server.stop()
        with pytest.raises(BrokerUnavailable, match="did not answer a dead-letter list") as caught:
            await DeadLetters(broker).list()
        assert broker.settings.url in str(caught.value)
