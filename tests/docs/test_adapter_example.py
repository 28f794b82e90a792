"""The adapter page's example store and bindings, run as the conformance suites they claim to be.

The Python blocks of docs/adapters.md are executed here at import, and the test classes
they define are collected by pytest like any other: the page's store is certified by the
real ``TimerStoreContract``, not just shown.
"""

from __future__ import annotations

from typing import Any

from tests.docs.markdown import DOCS, parse


def _page_namespace() -> dict[str, Any]:
    document = parse(DOCS / "adapters.md")
    for example in document.examples():
        example.evaluate()
    return document.namespace


_namespace = _page_namespace()
TestDictTimerStore = _namespace["TestDictTimerStore"]
TestMemoryEventBus = _namespace["TestMemoryEventBus"]
