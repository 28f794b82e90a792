"""The adapter page's example store and bindings, run as the conformance suites they claim to be.

The Python blocks of docs/adapters.md are executed here at import, and the test classes
they define are collected by pytest like any other: the page's store is certified by the
real ``TimerStoreContract``, not just shown.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.docs.markdown import DOCS, ROOT, parse


def _page_namespace() -> dict[str, Any]:
    document = parse(DOCS / "adapters.md")
    for example in document.examples():
        example.evaluate()
    return document.namespace


_namespace = _page_namespace()
TestDictTimerStore = _namespace["TestDictTimerStore"]
TestMemoryEventBus = _namespace["TestMemoryEventBus"]


def test_the_example_store_passes_mypy_strict(tmp_path: Path) -> None:
    """The page's DictTimerStore block, saved as a module, passes ``mypy --strict``."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "adapters.md").read_text(), re.S)
    (store,) = [block for block in blocks if "class DictTimerStore(TimerStore)" in block]
    module = tmp_path / "dict_timer_store.py"
    module.write_text(store)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(module)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
