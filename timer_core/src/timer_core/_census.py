"""Optional store capabilities for operators: the census of pending timers by due time, and
the look-ups a console needs (a tenant's pending timers by due time, a correlation id across
tenants, one timer's stored record).

A store offers one by deriving from it besides :class:`~timer_core.ports.TimerStore`
(:func:`isinstance` tells); each method is served by an index, at a cost bounded by its
arguments, not by the number of stored timers.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

import attrs

from timer_core._entry import TimerEntry, TimerState
from timer_core._ids import CorrelationId, ServiceCallId, TenantId

if TYPE_CHECKING:  # ports re-exports this module's names
    from timer_core.ports import DueCursor

__all__ = ["PendingTenant", "TimerCensus", "TimerLookup", "TimerRecord"]


@attrs.frozen
class PendingTenant:
    """A tenant with pending timers and the earliest ``due_at`` among them."""

    tenant_id: TenantId
    earliest_due_at: datetime


@attrs.frozen
class TimerRecord:
    """What the store keeps of one timer key, for an operator reading its story.

    ``entry`` is the timer (``None`` once cancelled, purged or never scheduled);
    ``command_position`` the position (JetStream sequence) of the last command applied to
    it, when it came from an ordered source; ``cancelled_at`` and ``cancel_position`` the
    tombstone a positioned cancel left (kept until retention purges it).
    """

    tenant_id: TenantId
    service_call_id: ServiceCallId
    entry: TimerEntry | None
    command_position: int | None = None
    cancelled_at: datetime | None = None
    cancel_position: int | None = None


class TimerCensus(abc.ABC):
    """A store that counts its pending timers by due time, at a bounded cost (a capability a
    :class:`~timer_core.ports.TimerStore` may have).

    The service's census (metrics ``timer_timers_due`` and ``timer_oldest_overdue_seconds``)
    and its console use it; a store without it gets neither.
    """

    @abc.abstractmethod
    async def count_scheduled_due(
        self,
        *,
        after: datetime | None,
        until: datetime | None,
        cap: int,
        tenant_id: TenantId | None = None,
    ) -> int:
        """How many ``Scheduled`` timers have ``after < due_at <= until``, counting at most
        ``cap`` (the answer is ``cap`` when there are at least that many).

        ``None`` leaves that end open; with ``tenant_id`` only that tenant's timers count.
        Served by a range of the due index: the cost grows with ``min(cap, matches)``, never
        with the table.
        """

    @abc.abstractmethod
    async def oldest_scheduled_due_at(self, tenant_id: TenantId | None = None) -> datetime | None:
        """The earliest ``due_at`` of any ``Scheduled`` timer (of ``tenant_id``'s, if given),
        claimed by an instance or not (one index seek), or None when none is pending."""

    @abc.abstractmethod
    async def pending_tenants(
        self, *, limit: int, after: TenantId | None = None
    ) -> Sequence[PendingTenant]:
        """Up to ``limit`` tenants with ``Scheduled`` timers, in tenant order after ``after``,
        each with its earliest due time: a few index seeks per tenant returned."""


class TimerLookup(abc.ABC):
    """A store that finds timers the ways an operator asks for them, each through an index
    (a capability a :class:`~timer_core.ports.TimerStore` may have)."""

    @abc.abstractmethod
    async def scheduled_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        due_from: datetime | None,
        due_until: datetime | None,
        limit: int,
        after: DueCursor | None = None,
    ) -> list[TimerEntry]:
        """Up to ``limit`` of the tenant's ``Scheduled`` timers with
        ``due_from <= due_at <= due_until`` (``None``: open), in ``(due_at,
        service_call_id)`` order, strictly after ``after`` (keyset pagination)."""

    @abc.abstractmethod
    async def scan_tenant(
        self,
        tenant_id: TenantId,
        *,
        state: TimerState | None,
        due_from: datetime | None,
        due_until: datetime | None,
        limit: int,
        scan: int,
        after: ServiceCallId | None = None,
    ) -> tuple[list[TimerEntry], ServiceCallId | None]:
        """Among the tenant's next ``scan`` timers in ``service_call_id`` order after
        ``after`` (keyset), up to ``limit`` in ``state`` (None: either) with ``due_from <=
        due_at <= due_until`` (None: open), in that order; and the key to go on after: the
        last one returned when ``limit`` were found, else the last one read, None when the
        tenant's timers ran out. The primary key bounds the read to ``scan`` rows, however
        few match: the way to page through fired timers, which no index orders by due time.
        """

    @abc.abstractmethod
    async def find_by_correlation_id(
        self, correlation_id: CorrelationId, *, limit: int
    ) -> list[TimerEntry]:
        """Up to ``limit`` timers of any tenant scheduled with this correlation id, in key
        order."""

    @abc.abstractmethod
    async def timer_record(
        self, tenant_id: TenantId, service_call_id: ServiceCallId
    ) -> TimerRecord:
        """What the store keeps of this key: the timer, its command position, its
        tombstone."""
