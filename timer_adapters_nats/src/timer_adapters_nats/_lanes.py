"""Commands taken fairly per tenant: each tenant's commands come through a durable consumer of
its own (its lane), so a tenant's backlog waits behind itself only.

One shared consumer hands commands out in stream order: 188,000 commands of one tenant's
flood sat ahead of another tenant's next command, which waited for all of them (issue 43).
Here every tenant with commands in the stream gets a consumer filtered to its subject, read
by a :class:`~timer_adapters_nats.NatsCommandSource` of its own; the lanes hand their batches
to the one handler side by side, so the store takes them in turns, a batch of each lane at a
time, whatever one tenant has queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import attrs
import nats.js.errors
import uuid_utils
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy

from timer_adapters_nats._connection import NatsConnection
from timer_adapters_nats._pull import PullBatches, stream_sequence
from timer_adapters_nats._settings import NatsSettings
from timer_adapters_nats._source import NatsCommandSource, wait_for_either
from timer_core import CommandBatchHandler, CommandSource, Instrumentation, TenantId
from timer_core.instrumentation import NO_INSTRUMENTATION

__all__ = [
    "CommandBacklog",
    "TenantCommandSource",
    "command_backlog",
    "command_consumer_config",
    "lane_name",
    "stray_lane_name",
]

log = logging.getLogger(__name__)

#: How often the stream is asked which tenants have commands in it: the longest a new
#: tenant's first command waits for its lane to open.
DISCOVERY_INTERVAL_S = 0.25


#: How often each lane's stored commands are removed from the stream (with a queue limit).
TRIM_INTERVAL_S = 1.0


def lane_name(consumer: str, tenant: str) -> str:
    """The durable consumer of ``tenant``'s lane: ``<consumer>_<tenant>``."""
    return f"{consumer}_{TenantId(tenant)}"


def stray_lane_name(consumer: str) -> str:
    """The consumer of the commands on subjects without a valid tenant token (to be
    dead-lettered to ``<prefix>.dlq._``): ``<consumer>~unroutable``, a name no tenant's lane
    can have (``~`` is not in a tenant id)."""
    return f"{consumer}~unroutable"


@attrs.frozen
class CommandBacklog:
    """The commands a service has not settled yet, over all its command consumers."""

    pending: int
    """Not delivered yet (a tenant whose consumer is not made yet: all its commands)."""
    in_hand: int
    """Delivered and not acknowledged yet."""
    delivered: dict[str, int]
    """Per command subject, the last stream sequence delivered on it."""

    @property
    def settled(self) -> bool:
        """Whether nothing waits and nothing is in hand."""
        return self.pending == 0 and self.in_hand == 0


async def command_backlog(js: JetStreamContext, settings: NatsSettings) -> CommandBacklog:
    """What the service of ``settings`` (its ``consumer_name``) has not settled: over its
    consumer per tenant (a tenant without one yet: all its commands in the stream wait),
    else over its one shared consumer. For operators and benchmarks; it asks the server
    once per 256 consumers, and once for the subjects."""
    stream = settings.commands_stream
    subjects = settings.subjects
    consumers = {info.name: info for info in await js.consumers_info(stream)}
    shared = consumers.get(settings.consumer_name)
    lanes = {
        info.config.filter_subject: info
        for name, info in consumers.items()
        if name.startswith(f"{settings.consumer_name}_")
    }
    if shared is not None and not lanes:
        return CommandBacklog(
            int(shared.num_pending or 0),
            int(shared.num_ack_pending or 0),
            {subjects.commands_filter: _delivered(shared)},
        )
    held = await js.stream_info(stream, subjects_filter=subjects.commands_filter)
    pending = in_hand = 0
    delivered: dict[str, int] = {}
    for subject, count in (held.state.subjects or {}).items():
        if subjects.tenant_of_command(subject) is None:
            continue  # the stray lane's, below
        lane = lanes.get(subject)
        if lane is None:
            pending += count
            continue
        pending += int(lane.num_pending or 0)
        in_hand += int(lane.num_ack_pending or 0)
        delivered[subject] = _delivered(lane)
    stray = consumers.get(stray_lane_name(settings.consumer_name))
    if stray is not None:
        pending += int(stray.num_pending or 0)
        in_hand += int(stray.num_ack_pending or 0)
    return CommandBacklog(pending, in_hand, delivered)


def _delivered(info: ConsumerInfo) -> int:
    return info.delivered.stream_seq if info.delivered is not None else 0


async def put_command_consumer(
    js: JetStreamContext, stream: str, config: ConsumerConfig, *, start: int | None
) -> None:
    """Create the command consumer of ``config`` at stream sequence ``start`` (None: where
    ``config`` says), or update an existing one, keeping where it starts."""
    try:
        existing = await js.consumer_info(stream, str(config.durable_name))
    except nats.js.errors.NotFoundError:
        if start is not None:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start
    else:
        config.deliver_policy = existing.config.deliver_policy
        config.opt_start_seq = existing.config.opt_start_seq
        config.opt_start_time = existing.config.opt_start_time
    await js.add_consumer(stream, config)


def command_consumer_config(
    settings: NatsSettings, *, name: str, filter_subject: str
) -> ConsumerConfig:
    """A durable pull consumer of commands: explicit acks, bounded ack wait and max deliver.

    The backoff is the source's doubling nak delay. A consumer-level ``backoff`` is left
    out on purpose: the server applies it over explicit nak delays from the second
    redelivery on, which would turn a 1 s retry into an ack-wait-long one. Room for eight
    fetch batches unacknowledged: the one being stored and the next, read ahead, of four
    instances (the server's default of 1000 would stall a read-ahead at batches of 1000;
    room for two instances only cut four instances' batches to a third).
    """
    return ConsumerConfig(
        name=name,
        durable_name=name,
        description="Timer commands (ScheduleTimer, CancelTimer)",
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=max(1000, 8 * settings.fetch_batch),
        filter_subject=filter_subject,
    )


class TenantCommandSource(CommandSource):
    """Reads every tenant's commands through a lane of its own: a durable pull consumer
    ``<consumer_name>_<tenantId>`` filtered to ``<prefix>.commands.<tenantId>``.

    - Every :data:`DISCOVERY_INTERVAL_S` it asks the commands stream which tenants have
      commands in it and opens a lane for each new one (its consumer created when absent;
      an existing one keeps its place, so instances sharing the work share each lane).
    - Each lane is a :class:`NatsCommandSource` with all its promises (stream order within
      the tenant, nothing acked before it is stored, dead letters, redelivery backoff). The
      lanes call the one handler side by side: one tenant's backlog holds back its own
      commands only.
    - A lane created while the shared consumer of an earlier version (``consumer_name``)
      exists starts after that consumer's ack floor, so an upgrade re-applies at most what
      was in flight (as stale: no change); otherwise it starts at the tenant's first command.
    - :meth:`run` returns only after :meth:`stop`; a lane that fails stops it with the error.
    """

    def __init__(
        self, connection: NatsConnection, *, instrumentation: Instrumentation = NO_INSTRUMENTATION
    ) -> None:
        self._connection = connection
        self._settings = connection.settings
        self._instrumentation = instrumentation
        self._lanes: dict[str, NatsCommandSource] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stop = asyncio.Event()
        self._retry = asyncio.Event()
        self._run_task: asyncio.Task[None] | None = None
        # Where a new lane starts: after the shared consumer's ack floor, when it exists.
        self._shared_floor: int | None = None
        # The counts of the subjects of one invalid token last swept, and the stream
        # sequence swept through.
        self._swept_counts: dict[str, int] = {}
        self._swept_through = 0
        # Per lane, the ack floor its tenant's commands were last removed up to, and when
        # (loop time) the lanes are looked at next.
        self._trimmed: dict[str, int] = {}
        self._trim_at = 0.0

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is in progress."""
        return self._run_task is not None

    @property
    def lanes(self) -> dict[str, NatsCommandSource]:
        """The open lanes by their consumer's name (a copy)."""
        return dict(self._lanes)

    @property
    def resume_from(self) -> int | None:
        """The lowest stream sequence a lane has not settled for good (see
        :attr:`NatsCommandSource.resume_from`), or None."""
        points = [p for p in (lane.resume_from for lane in self._lanes.values()) if p is not None]
        return min(points) if points else None

    def retry_now(self) -> None:
        """End the backoffs in progress: what failed (a consumer that was missing) is fixed."""
        self._retry.set()
        for lane in self._lanes.values():
            lane.retry_now()

    async def run(self, handler: CommandBatchHandler) -> None:
        if self._run_task is not None:
            raise RuntimeError("this command source is already running")
        self._connection.jetstream  # noqa: B018 - raises now if it was never started
        self._run_task = asyncio.current_task()
        try:
            await self._loop(handler)
        finally:
            await self._close_lanes()
            self._run_task = None

    async def stop(self) -> None:
        """Stop every lane (each acks the batch it has in hand) and wait for :meth:`run`."""
        self._stop.set()
        self._retry.set()
        await asyncio.gather(*(lane.stop() for lane in self._lanes.values()))
        task = self._run_task
        if task is not None and task is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)

    async def recreate(self, lane: str, *, fresh_stream: bool) -> None:
        """Recreate the consumer of the open lane ``lane`` (deleted behind the service's
        back): at the first command the lane has not settled, or at the stream's start when
        the stream itself is new (its sequences begin again)."""
        source = self._lanes[lane]
        if lane == stray_lane_name(self._settings.consumer_name):
            await self._ensure_stray()
            return
        start = None if fresh_stream else source.resume_from
        await self._ensure_consumer(lane, self._tenant_of(lane), start=start)

    async def _loop(self, handler: CommandBatchHandler) -> None:
        settings = self._settings
        failures = 0
        await self._read_shared_floor()
        while not self._stop.is_set():
            self._raise_failed_lane()
            try:
                tenants, strays = await self._tenants()
                for tenant in sorted(tenants):
                    name = lane_name(settings.consumer_name, tenant)
                    if name not in self._lanes and not self._stop.is_set():
                        await self._open(name, tenant, handler)
                stray = stray_lane_name(settings.consumer_name)
                if strays and stray not in self._lanes and not self._stop.is_set():
                    await self._ensure_stray()
                    self._start_lane(stray, handler)
                await self._sweep({s: n for s, n in strays.items() if self._single_token(s)})
                await self._trim()
                failures = 0
            except Exception as exc:  # a disconnect or a server error: back off, go on
                failures += 1
                delay = min(10.0, 0.1 * 2 ** min(failures - 1, 10))
                log.warning(
                    "looking for tenants' commands on %s failed (%s); retrying in %.1fs",
                    settings.commands_stream,
                    exc or type(exc).__name__,
                    delay,
                )
                await self._pause(delay)
                continue
            await self._pause(DISCOVERY_INTERVAL_S)
        self._raise_failed_lane()

    async def _trim(self) -> None:
        """Every :data:`TRIM_INTERVAL_S`, remove from the stream each tenant's commands its
        lane's consumer has acknowledged (below its ack floor, whichever instance acked
        them), when there is a queue limit: the stream's per-tenant limit then counts the
        commands that wait, not the week's history. Only lanes that settled something since
        are asked."""
        settings = self._settings
        loop = asyncio.get_running_loop()
        if settings.max_queued_per_tenant is None or loop.time() < self._trim_at:
            return
        self._trim_at = loop.time() + TRIM_INTERVAL_S
        js = self._connection.jetstream
        stray = stray_lane_name(settings.consumer_name)
        for name, lane in list(self._lanes.items()):
            settled = lane.settled_through
            if name == stray or settled is None or settled <= self._trimmed.get(name, 0):
                continue
            info = await js.consumer_info(settings.commands_stream, name)
            floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
            if floor > self._trimmed.get(name, 0):
                subject = settings.subjects.commands(TenantId(self._tenant_of(name)))
                await js.purge_stream(settings.commands_stream, seq=floor + 1, subject=subject)
            self._trimmed[name] = max(floor, self._trimmed.get(name, 0))

    async def _tenants(self) -> tuple[set[str], dict[str, int]]:
        """The tenants with commands in the stream now (one subject each), and the subjects
        without a valid tenant token, with how many commands each holds."""
        settings = self._settings
        subjects = settings.subjects
        info = await self._connection.jetstream.stream_info(
            settings.commands_stream, subjects_filter=subjects.commands_filter
        )
        tenants: set[str] = set()
        strays: dict[str, int] = {}
        for subject, count in (info.state.subjects or {}).items():
            tenant = subjects.tenant_of_command(subject)
            if tenant is not None:
                tenants.add(str(tenant))
            else:
                strays[subject] = count
        return tenants, strays

    def _single_token(self, subject: str) -> bool:
        """Whether ``subject`` has one token after ``<prefix>.commands.``."""
        return "." not in subject[len(self._settings.subjects.prefix) + len(".commands.") :]

    async def _ensure_stray(self) -> None:
        """Create the consumer of the subjects of more than one token after ``commands``
        (``<prefix>.commands.*.>``), whose commands are all dead-lettered to
        ``<prefix>.dlq._``. Its filter never changes, so nothing stored before a new such
        subject appears is skipped. An invalid single token (``t\u00e9nant``, ``*``, ``>``)
        cannot have a filter of its own that takes it alone and in time: :meth:`_sweep`
        takes those."""
        settings = self._settings
        name = stray_lane_name(settings.consumer_name)
        config = command_consumer_config(
            settings, name=name, filter_subject=f"{settings.subjects.prefix}.commands.*.>"
        )
        js = self._connection.jetstream
        with contextlib.suppress(nats.js.errors.NotFoundError):
            existing = await js.consumer_info(settings.commands_stream, name)
            config.deliver_policy = existing.config.deliver_policy
            config.opt_start_seq = existing.config.opt_start_seq
        await js.add_consumer(settings.commands_stream, config)

    async def _sweep(self, counts: dict[str, int]) -> None:
        """Dead-letter the commands on subjects of one invalid tenant token (``counts``: how
        many each holds now), for which no consumer filter takes them alone and in time
        (``*`` and ``>`` taken literally would take every tenant's): when one holds more
        than last seen, read the stream from where the last sweep ended (one short-lived
        consumer) and hand every such command found to the stray lane to dead-letter. Each
        command is read once more at most, and only while someone publishes on such a
        subject."""
        if not counts or counts == self._swept_counts:
            return
        self._swept_counts = dict(counts)
        settings = self._settings
        js = self._connection.jetstream
        stray = self._lanes.get(stray_lane_name(settings.consumer_name))
        info = await js.stream_info(settings.commands_stream)
        last = info.state.last_seq
        start = max(self._swept_through + 1, info.state.first_seq)
        if stray is None or start > last:
            return
        subjects = settings.subjects
        name = f"{settings.consumer_name}~sweep-{uuid_utils.uuid4().hex[:12]}"
        config = ConsumerConfig(
            name=name,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=AckPolicy.NONE,
            filter_subject=settings.subjects.commands_filter,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        await js.add_consumer(settings.commands_stream, config)
        puller = PullBatches(
            self._connection.client, stream=settings.commands_stream, consumer=name
        )
        await puller.start()
        found: list[Msg] = []
        seq = start - 1
        try:
            while seq < last and not self._stop.is_set():
                batch = await puller.fetch_now(1000, 1.0)
                if not batch:
                    break
                for message in batch:
                    seq = stream_sequence(message)
                    subject = message.subject
                    if self._single_token(subject) and subjects.tenant_of_command(subject) is None:
                        found.append(message)
        finally:
            await puller.aclose()
            with contextlib.suppress(Exception):
                await js.delete_consumer(settings.commands_stream, name)
        self._swept_through = seq
        if found:
            await stray.dead_letter(
                [
                    (
                        message,
                        f"subject: {message.subject!r} is not "
                        f"{settings.subjects.prefix}.commands.<tenantId>",
                    )
                    for message in found
                ]
            )

    async def _read_shared_floor(self) -> None:
        settings = self._settings
        try:
            info = await self._connection.jetstream.consumer_info(
                settings.commands_stream, settings.consumer_name
            )
        except nats.js.errors.NotFoundError:
            return
        self._shared_floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
        log.info(
            "the shared command consumer %s is no longer read (commands go through a consumer "
            "per tenant); new lanes start after its ack floor %d. Delete it once no instance "
            "of an earlier version runs",
            settings.consumer_name,
            self._shared_floor,
        )

    async def _open(self, name: str, tenant: str, handler: CommandBatchHandler) -> None:
        start = None if self._shared_floor is None else self._shared_floor + 1
        await self._ensure_consumer(name, tenant, start=start)
        self._start_lane(name, handler)
        log.info("reading tenant %s's commands through consumer %s", tenant, name)

    def _start_lane(self, name: str, handler: CommandBatchHandler) -> None:
        lane = NatsCommandSource(
            self._connection, instrumentation=self._instrumentation, consumer=name
        )
        self._lanes[name] = lane
        self._tasks[name] = asyncio.create_task(lane.run(handler), name=f"commands {name}")
        self._tasks[name].add_done_callback(lambda _: self._retry.set())

    async def _ensure_consumer(self, name: str, tenant: str, *, start: int | None) -> None:
        """Create the lane's consumer at ``start`` (None: the tenant's first command), or
        update an existing one, keeping where it starts."""
        settings = self._settings
        config = command_consumer_config(
            settings, name=name, filter_subject=settings.subjects.commands(TenantId(tenant))
        )
        await put_command_consumer(
            self._connection.jetstream, settings.commands_stream, config, start=start
        )

    def _tenant_of(self, lane: str) -> str:
        return lane[len(self._settings.consumer_name) + 1 :]

    def _raise_failed_lane(self) -> None:
        """Raise what a lane that ended on its own raised (a lane only ends when stopped)."""
        for name, task in self._tasks.items():
            if task.done() and not self._stop.is_set():
                error = None if task.cancelled() else task.exception()
                raise RuntimeError(f"the command lane {name} stopped") from error

    async def _close_lanes(self) -> None:
        await asyncio.gather(*(lane.stop() for lane in self._lanes.values()))
        tasks = list(self._tasks.values())
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._lanes.clear()

    async def _pause(self, seconds: float) -> None:
        await wait_for_either(self._stop, self._retry, seconds)
