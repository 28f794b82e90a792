"""The library examples stay as short and as direct as issue 13 asked: a host wires Timer in a
few lines, and the README's example waits for the event instead of polling for it."""

from __future__ import annotations

import ast
import re

from tests.docs.markdown import DOCS, ROOT


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


class TestLibraryExamples:
    def test_a_host_wires_timer_with_sqlite_and_nats_in_at_most_eight_lines(self) -> None:
        """The quickstart's run_timer body (docstring aside) is at most eight lines."""
        (block,) = [
            b for b in python_blocks((DOCS / "quickstart.md").read_text()) if "def run_timer" in b
        ]
        function = next(
            node
            for node in ast.walk(ast.parse(block))
            if isinstance(node, ast.AsyncFunctionDef) and node.name == "run_timer"
        )
        body = function.body[1:] if ast.get_docstring(function) else function.body
        first, last = body[0].lineno, body[-1].end_lineno
        assert last is not None
        lines = [
            line
            for line in block.splitlines()[first - 1 : last]
            if line.strip() and not line.strip().startswith("#")
        ]
        assert len(lines) <= 8, "\n".join(lines)
        assert "Timer(" in block and "SqliteTimerStore(" in block and "NatsBroker(" in block

    def test_the_readme_example_waits_for_the_event_instead_of_polling(self) -> None:
        """The README's library example awaits wait_for_published and has no polling loop."""
        (block,) = [b for b in python_blocks((ROOT / "README.md").read_text()) if "FakeClock" in b]
        assert "wait_for_published(" in block
        assert "while " not in block
        assert "asyncio.sleep" not in block
