"""Scenario 4: hostile commands through the real broker. Each is dead-lettered with a reason,
the service stays up, good commands sent among them are all processed, and no input reads or
writes another tenant's timer."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import nats.errors
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from tests.chaos.conftest import ServiceFactory
from tests.chaos.rig import ChaosService, db_rows, read_stream, report, wait_until
from tests.timer_service.process import http_get
from timer_core import EnvelopeId
from timer_core.instants import format_timestamp

pytestmark = pytest.mark.chaos

VICTIM = "tenant-victim"
ATTACKER = "tenant-attacker"
GOOD = "tenant-good"
VICTIM_CALL = "victim-call"
VICTIM_DUE = "2031-01-01T00:00:00.000Z"
#: nats-server's default max_payload: the largest message a client may publish.
MAX_PAYLOAD = 1024 * 1024
EXAMPLES = 100


@attrs.frozen
class Hostile:
    """One bad message, and what is wrong with it (for failure messages)."""

    kind: str
    subject: str
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes: {data[:120]!r}>")


def command_subject(tenant: str) -> str:
    return f"timer.commands.{tenant}"


def envelope(
    tenant: str = ATTACKER,
    call: str = VICTIM_CALL,
    *,
    tag: str = "ScheduleTimer",
    payload_tenant: str | None = None,
    due: str = "2030-01-01T00:00:00.000Z",
) -> dict[str, Any]:
    """A valid command envelope as a JSON object, for the strategies to break."""
    payload: dict[str, Any] = {
        "_tag": tag,
        "tenantId": payload_tenant or tenant,
        "serviceCallId": call,
    }
    if tag == "ScheduleTimer":
        payload["dueAt"] = due
    return {
        "id": str(EnvelopeId.generate()),
        "type": tag,
        "tenantId": tenant,
        "aggregateId": call,
        "timestampMs": 1_900_000_000_000,
        "correlationId": "fuzz",
        "payload": payload,
    }


def encode(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


tags = st.sampled_from(["ScheduleTimer", "CancelTimer"])
json_leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
#: Ids the contract forbids: too long, empty, or with a character outside [A-Za-z0-9_-]
#: (subject wildcards and separators among them).
bad_ids = (
    st.sampled_from(["", "a.b", "*", ">", "a b", "tenant-victim.x", "ten*", "é", "a\nb", "\x00"])
    | st.text(min_size=1, max_size=40).filter(
        lambda text: not all(c.isascii() and (c.isalnum() or c in "_-") for c in text)
    )
    | st.integers(129, 200_000).map(lambda n: "v" * n)
)
bad_timestamps = (
    st.sampled_from(
        [
            "2030-01-01T00:00:00",  # no zone
            "2030-01-01 00:00:00",
            "2030-01-01",
            "10000-01-01T00:00:00Z",
            "0000-01-01T00:00:00Z",
            "2030-13-01T00:00:00Z",
            "2030-02-30T00:00:00Z",
            "2030-01-01T24:00:01Z",
            "9999-12-31T23:59:59.999-01:00",  # past year 9999 in UTC
            "0001-01-01T00:00:00+01:00",  # before year 1 in UTC
            "1893456000000",
            "yesterday",
            "",
        ]
    )
    | st.integers()
    | st.none()
    | st.lists(st.integers(), max_size=2)
)


def big(size: int, tag: str = "ScheduleTimer") -> Hostile:
    """An invalid command (a dot in its id) padded by an unknown key to ``size`` bytes: up
    to the largest message a client may publish."""
    obj = envelope(ATTACKER, "x.y", tag=tag)
    obj["padding"] = ""
    obj["padding"] = "p" * max(0, size - len(encode(obj)))
    return Hostile("big", command_subject(ATTACKER), encode(obj))


@st.composite
def hostile(draw: st.DrawFn) -> Hostile:
    """A message the service must reject: the kinds of harm the issue lists, one per draw."""
    kind = draw(
        st.sampled_from(
            [
                "random-bytes",
                "not-an-object",
                "missing-field",
                "wrong-type",
                "bad-id",
                "bad-timestamp",
                "nested-junk",
                "big",
                "type-mismatch",
                "null-optional",
                "tenant-mismatch",
                "subject-tenant",
                "bad-subject",
            ]
        )
    )
    subject = command_subject(ATTACKER)
    base = envelope(ATTACKER, VICTIM_CALL, tag=draw(tags))
    if kind == "random-bytes":
        data = draw(st.binary(min_size=0, max_size=512))
        return Hostile(kind, subject, data)
    if kind == "not-an-object":
        value = draw(json_values.filter(lambda v: not isinstance(v, dict)))
        return Hostile(kind, subject, encode(value))
    obj = copy.deepcopy(base)
    if kind == "missing-field":
        where = draw(st.sampled_from(["id", "type", "tenantId", "timestampMs", "payload", "p"]))
        if where == "p":
            del obj["payload"][draw(st.sampled_from(sorted(obj["payload"])))]
        else:
            del obj[where]
    elif kind == "wrong-type":
        field = draw(st.sampled_from(["id", "type", "tenantId", "timestampMs", "payload", "p"]))
        if field == "timestampMs":
            obj[field] = draw(st.sampled_from([1.5, "1", True, None, [], {}, 10**40, -(10**40)]))
        elif field == "payload":
            obj[field] = draw(json_values.filter(lambda v: not isinstance(v, dict)))
        elif field == "p":
            key = draw(st.sampled_from(sorted(obj["payload"])))
            obj["payload"][key] = draw(st.sampled_from([1, 2.5, False, [], {}, None]))
        else:
            obj[field] = draw(st.sampled_from([1, 2.5, False, [], {"a": 1}, None]))
    elif kind == "bad-id":
        where = draw(st.sampled_from(["tenantId", "serviceCallId", "both", "id", "correlationId"]))
        bad = draw(bad_ids)
        if where in ("tenantId", "both"):
            obj["tenantId"] = bad
            obj["payload"]["tenantId"] = bad
        if where in ("serviceCallId", "both"):
            obj["payload"]["serviceCallId"] = bad
        if where == "id":
            obj["id"] = draw(
                st.sampled_from(["", "not-a-uuid", "01932c8e-7c4f-4000-8000-000000000001"])
                | bad_ids
            )
        if where == "correlationId":
            obj["correlationId"] = bad
    elif kind == "bad-timestamp":
        obj["type"] = obj["payload"]["_tag"] = "ScheduleTimer"
        obj["payload"]["dueAt"] = draw(bad_timestamps)
    elif kind == "nested-junk":
        depth = draw(st.integers(2, 50_000))
        junk: Any = draw(json_values)
        text = "[" * depth + json.dumps(junk) + "]" * depth
        where = draw(st.sampled_from(["payload", "payload.dueAt", "top"]))
        if where == "top":
            return Hostile(kind, subject, text.encode())
        marker = "__JUNK__"
        if where == "payload":
            obj["payload"] = marker
        else:
            obj["type"] = obj["payload"]["_tag"] = "ScheduleTimer"
            obj["payload"]["dueAt"] = marker
        return Hostile(kind, subject, encode(obj).replace(b'"__JUNK__"', text.encode()))
    elif kind == "big":
        size = draw(st.sampled_from([1_000_000, MAX_PAYLOAD]) | st.integers(1, MAX_PAYLOAD))
        return big(size, base["type"])
    elif kind == "type-mismatch":
        obj["type"] = draw(
            st.sampled_from(["DueTimeReached", "ScheduleTimer ", "scheduletimer", "Nope", ""])
            | st.just("CancelTimer" if obj["type"] == "ScheduleTimer" else "ScheduleTimer")
        )
    elif kind == "null-optional":
        obj[draw(st.sampled_from(["correlationId", "causationId", "aggregateId"]))] = None
    elif kind == "tenant-mismatch":
        # The envelope's tenant is not the payload's: one of them is the victim's.
        obj["payload"]["tenantId"] = VICTIM
        subject = command_subject(draw(st.sampled_from([ATTACKER, VICTIM])))
    elif kind == "subject-tenant":
        # A well-formed command for one tenant sent on another tenant's subject.
        victim_side = draw(st.booleans())
        obj = envelope(VICTIM if victim_side else ATTACKER, VICTIM_CALL, tag=base["type"])
        subject = command_subject(ATTACKER if victim_side else VICTIM)
    elif kind == "bad-subject":
        # A well-formed victim command on a subject whose tenant token is not one id.
        obj = envelope(VICTIM, VICTIM_CALL, tag=base["type"])
        subject = draw(
            st.sampled_from(
                [
                    "timer.commands.*",
                    "timer.commands.>",
                    f"timer.commands.{VICTIM}.x",
                    f"timer.commands.{VICTIM}.>",
                    "timer.commands.t\u00e9nant",
                    f"timer.commands.{'v' * 129}",
                ]
            )
        )
    return Hostile(kind, subject, encode(obj))


@attrs.define
class FuzzRig:
    """The service, and what the test saw come out of it."""

    service: ChaosService
    js: JetStreamContext
    db: Path
    dead: dict[str, Msg] = attrs.field(factory=dict)
    """Dead letters seen go by, by their Nats-Msg-Id (``TIMER_COMMANDS-<seq>``)."""
    fired: set[str] = attrs.field(factory=set)
    """Service call ids of the good tenant's events seen go by."""
    sent: dict[int, Hostile] = attrs.field(factory=dict)
    good: set[str] = attrs.field(factory=set)
    refused_by_client: list[Hostile] = attrs.field(factory=list)
    kinds: dict[str, int] = attrs.field(factory=dict)

    victim_registered_at: str = ""

    async def run_example(self, batch: list[Hostile], goods: int) -> None:
        """Send the batch with good commands among it; wait for every outcome and check it."""
        expected: dict[str, Hostile] = {}
        good_calls = []
        for index, item in enumerate(batch):
            try:
                ack = await self.js.publish(item.subject, item.data, timeout=10)
            except (nats.errors.BadSubjectError, nats.errors.MaxPayloadError):
                self.refused_by_client.append(item)
                continue
            self.sent[ack.seq] = item
            expected[f"TIMER_COMMANDS-{ack.seq}"] = item
            self.kinds[item.kind] = self.kinds.get(item.kind, 0) + 1
            if index < goods:
                call = f"good-{len(self.good)}"
                good = envelope(GOOD, call, due=format_timestamp(datetime.now(UTC)))
                await self.js.publish(command_subject(GOOD), encode(good))
                self.good.add(call)
                good_calls.append(call)

        def outcome() -> bool:
            return set(expected) <= set(self.dead) and set(good_calls) <= self.fired

        try:
            await wait_until(outcome, within=15, what="dead letters and good events")
        except AssertionError:
            missing = {k: v for k, v in expected.items() if k not in self.dead}
            raise AssertionError(
                f"not dead-lettered: {missing}; good not fired: "
                f"{set(good_calls) - self.fired}\n" + "".join(self.service.lines()[-20:])
            ) from None
        for msg_id, item in expected.items():
            dead = self.dead[msg_id]
            headers = dead.headers or {}
            reason = headers.get("Timer-Error", "")
            assert reason and "\n" not in reason, (item, headers)
            assert headers.get("Timer-Original-Subject") == item.subject, (item, headers)
            tenant = item.subject.removeprefix("timer.commands.")
            assert dead.subject == f"timer.dlq.{tenant if _is_id(tenant) else '_'}", item
        assert self.service.running, self.service.log()

    async def on_dead(self, msg: Msg) -> None:
        self.dead[(msg.headers or {}).get("Nats-Msg-Id", "")] = msg

    async def on_event(self, msg: Msg) -> None:
        self.fired.add(msg.subject.rsplit(".", 1)[1])


@pytest.fixture
async def fuzz(
    tmp_path: Path, make_service: ServiceFactory, nc: Client, js: JetStreamContext
) -> AsyncIterator[FuzzRig]:
    """A running service with a victim timer stored, and the test watching its outputs."""
    service = make_service(TIMER_POLLING_INTERVAL=500)
    service.start()
    await asyncio.to_thread(service.wait_healthy, 60)
    rig = FuzzRig(service, js, tmp_path / "timer.db")
    dead_sub = await nc.subscribe("timer.dlq.>", cb=rig.on_dead)
    events_sub = await nc.subscribe(f"timer.events.{GOOD}.>", cb=rig.on_event)
    victim = envelope(VICTIM, VICTIM_CALL, due=VICTIM_DUE)
    await js.publish(command_subject(VICTIM), encode(victim), headers={"Nats-Msg-Id": victim["id"]})
    await wait_until(
        lambda: any(r["tenant_id"] == VICTIM for r in db_rows(rig.db)),
        within=30,
        what="the victim's timer",
    )
    (row,) = db_rows(rig.db)
    rig.victim_registered_at = row["registered_at"]
    yield rig
    await dead_sub.unsubscribe()
    await events_sub.unsubscribe()


class TestHostileInput:
    async def test_each_bad_command_is_dead_lettered_and_harms_nothing(self, fuzz: FuzzRig) -> None:
        """Every hostile command lands in TIMER_DLQ with a one-line Timer-Error reason, the
        good commands among them are processed, the service stays up, and no other tenant's
        timer was read or written."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()

        # Hypothesis drives from a thread; each example runs on this loop, where the
        # connection lives.
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            # Examples run against one real service: shrinking a failure would replay dozens
            # of slow ones, so the failing example is reported as found.
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(batch=st.lists(hostile(), min_size=1, max_size=6), goods=st.integers(1, 3))
        @example(batch=[big(MAX_PAYLOAD)], goods=1)  # cannot go to the DLQ unchanged
        def fuzz_examples(batch: list[Hostile], goods: int) -> None:
            asyncio.run_coroutine_threadsafe(fuzz.run_example(batch, goods), loop).result(60)

        await asyncio.to_thread(fuzz_examples)
        fuzz_s = time.monotonic() - started

        # The dead-letter stream holds every hostile command that reached the broker,
        # unchanged, with its reason.
        stored = {
            (msg.headers or {}).get("Nats-Msg-Id"): msg
            for msg in await read_stream(fuzz.js, "TIMER_DLQ")
        }
        truncated = 0
        for seq, item in fuzz.sent.items():
            msg = stored[f"TIMER_COMMANDS-{seq}"]
            headers = msg.headers or {}
            assert headers.get("Timer-Error"), item
            if "Timer-Truncated" in headers:
                # Only a body that could not go out beside the headers is cut, to a prefix.
                truncated += 1
                assert int(headers["Timer-Truncated"]) == len(item.data) > MAX_PAYLOAD - 4096
                assert item.data.startswith(msg.data)
            else:
                assert msg.data == item.data, item

        # Isolation: the victim's timer is as it was stored, and the only timers are the
        # victim's and the good tenant's.
        rows = await asyncio.to_thread(db_rows, fuzz.db)
        victim = [r for r in rows if r["tenant_id"] == VICTIM]
        assert [(r["service_call_id"], r["due_at"], r["state"]) for r in victim] == [
            (VICTIM_CALL, VICTIM_DUE, "Scheduled")
        ]
        assert victim[0]["registered_at"] == fuzz.victim_registered_at
        others = {(r["tenant_id"], r["service_call_id"]) for r in rows} - {(VICTIM, VICTIM_CALL)}
        assert others == {(GOOD, call) for call in fuzz.good}
        assert all(r["state"] == "Reached" for r in rows if r["tenant_id"] == GOOD)
        assert http_get(fuzz.service.http_port, "/healthz")[0] == 200
        rejected = fuzz.service.metric('timer_commands_received_total{outcome="rejected"}')
        assert fuzz.service.terminate() == 0
        report(
            "hostile-input",
            examples=EXAMPLES,
            hostile_sent=len(fuzz.sent),
            dead_lettered=len(stored),
            dead_lettered_truncated=truncated,
            rejected_metric=int(rejected),
            refused_by_client=len(fuzz.refused_by_client),
            largest_bytes=max((len(h.data) for h in fuzz.sent.values()), default=0),
            good_processed=len(fuzz.good),
            kinds=",".join(f"{kind}:{count}" for kind, count in sorted(fuzz.kinds.items())),
            fuzz_s=round(fuzz_s, 1),
            service_restarts=fuzz.service.starts - 1,
            peak_rss_mb=fuzz.service.watch.peak_rss_mb,
        )


def _is_id(text: str) -> bool:
    return 1 <= len(text) <= 128 and all(c.isascii() and (c.isalnum() or c in "_-") for c in text)
