"""The shipped store contract bound to the reference store and to each planted bug.

Not collected by the suite (its name does not start with ``test_``): ``test_planted_bugs.py``
runs it in a pytest of its own and reads each class's results.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.timer_core.planted import PLANTED
from timer_adapters_memory import MemoryTimerStore
from timer_core import TimerStore
from timer_core.testing import FindsDueByTenantContract, TimerStoreContract


def _binding(store_type: type[MemoryTimerStore]) -> type:
    class Bound(TimerStoreContract, FindsDueByTenantContract):
        @pytest.fixture
        def make_store(self) -> Callable[[], TimerStore]:
            storage = store_type()
            return lambda: store_type(shared_with=storage)

    return Bound


TestReference = _binding(MemoryTimerStore)
for _name, _store_type in PLANTED.items():
    globals()[f"Test{_name}"] = _binding(_store_type)
