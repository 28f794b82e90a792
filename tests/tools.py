"""Operating-system tools that pip cannot install (``systemd-analyze``, ``faketime``,
``chromium``): a test that needs one finds it here, or is skipped saying which tool and how
to get it.

Such tests carry the ``os_tool`` marker. The README's test command runs them where the tool
exists and skips them elsewhere; ``.ci/run`` installs the tools and runs the ``os_tool``
tests again afterwards, failing on any skip there.
"""

from __future__ import annotations

import shutil

import pytest

__all__ = ["require_tool"]


def require_tool(name: str, install: str) -> str:
    """The path of the OS tool ``name``; the test is skipped, naming ``install``, without it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"needs the OS tool {name!r} ({install}); .ci/run installs it")
    return path
