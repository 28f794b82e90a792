"""timer_core stays a pure library: importing it pulls in no database or broker driver."""

from __future__ import annotations

import subprocess
import sys


class TestImports:
    """What `import timer_core` loads."""

    def test_import_loads_no_driver(self) -> None:
        """Importing timer_core loads neither sqlalchemy nor nats (nor the test kit)."""
        code = (
            "import sys, timer_core; "
            "loaded = [m for m in ('sqlalchemy', 'nats', 'pytest', 'hypothesis',"
            " 'timer_core.testing') if m in sys.modules]; "
            "assert not loaded, loaded"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stderr
