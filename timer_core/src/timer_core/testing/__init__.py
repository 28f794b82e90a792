"""Test kit for Timer adapters and hosts: the shipped conformance suites and Hypothesis strategies.

Bind :class:`TimerStoreContract`, :class:`FindsDueByTenantContract` (a store that shares
finds among tenants), :class:`TimerCensusContract` (the optional census and look-ups),
:class:`TimerStoreLeaseContract` (a store several instances share) or
:class:`EventPublisherContract` to an adapter by subclassing and overriding one fixture;
:class:`TimerIsolationContract` (and :class:`LeasingIsolationContract` for a store several
instances share) run a ``Timer`` on a store through every way out and check that one
timer's or one tenant's trouble stays its own;
:mod:`timer_core.testing.strategies` generates valid (and invalid) identifiers, instants,
timers and envelopes. Needs the ``testing`` extra (pytest, pytest-asyncio, hypothesis);
``import timer_core`` never imports this package.
"""

from timer_core.testing._census_contract import TimerCensusContract
from timer_core.testing._isolation_contract import (
    LeasingIsolationContract,
    TimerIsolationContract,
)
from timer_core.testing._lease_contract import TimerStoreLeaseContract
from timer_core.testing._publisher_contract import EventPublisherContract, PublisherHarness
from timer_core.testing._store_contract import FindsDueByTenantContract, TimerStoreContract

__all__ = [
    "LeasingIsolationContract",
    "TimerCensusContract",
    "TimerIsolationContract",
    "EventPublisherContract",
    "FindsDueByTenantContract",
    "PublisherHarness",
    "TimerStoreContract",
    "TimerStoreLeaseContract",
]
