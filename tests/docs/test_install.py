"""docs/install.md followed in fresh virtualenvs: what the page says to install is enough."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.docs.markdown import DOCS, ROOT
from tests.user_project import SHOWN_VALUE, clean_env, run_user_pytest

INSTALL = DOCS / "install.md"
# The page's commands assume the checkout at ./timer (pip) or ../timer (uv).
CHECKOUT_PIP, CHECKOUT_UV = "./timer/", "../timer/"

SMOKE = """\
import asyncio, sys, sysconfig
from datetime import UTC, datetime
from pathlib import Path

from timer_adapters_nats.embedded import find_nats_server
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import TimerEntry

binary = find_nats_server()
assert binary.parent == Path(sysconfig.get_path("scripts")), binary


async def main() -> None:
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    async with SqliteTimerStore("smoke.db") as store:
        await store.schedule(TimerEntry("tenant-a", "call-1", t0, t0))
        assert (await store.get("tenant-a", "call-1")) is not None


asyncio.run(main())
print("smoke ok")
"""


def fenced(language: str) -> list[str]:
    """The bodies of the page's fenced blocks in ``language``."""
    pattern = re.compile(rf"^```{language}\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    return pattern.findall(INSTALL.read_text())


def uv() -> str:
    """The uv executable (the project's tool; CI has it)."""
    found = shutil.which("uv")
    assert found is not None, "uv is not on PATH"
    return found


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a command; fail with its output if it fails."""
    result = subprocess.run(
        args, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{shlex.join(args)}\n{result.stdout}\n{result.stderr}"
    return result


class TestInstallPage:
    def test_pip_commands_install_a_working_timer(self, tmp_path: Path) -> None:
        """The page's path-based pip commands, and nothing else, give a virtualenv in which
        Timer imports, stores a timer, finds its own nats-server, and runs the contract suite
        with the compared values shown."""
        commands = [
            line
            for block in fenced("bash")
            for line in block.splitlines()
            if line.startswith("pip install ") and CHECKOUT_PIP in line
        ]
        assert len(commands) == 2, commands
        venv = tmp_path / "venv"
        run([uv(), "venv", "-q", "--python", sys.executable, str(venv)], tmp_path)
        python = str(venv / "bin" / "python")
        for command in commands:
            packages = [arg.replace(CHECKOUT_PIP, f"{ROOT}/") for arg in shlex.split(command)[2:]]
            # --no-sources: resolve as pip does, blind to the workspace's uv sources.
            run([uv(), "pip", "install", "-q", "--no-sources", "--python", python, *packages], ROOT)

        assert "smoke ok" in run([python, "-c", SMOKE], tmp_path).stdout

        pytest_settings = next(block for block in fenced("toml") if "asyncio_default" in block)
        result = run_user_pytest(python, tmp_path, pytest_settings)
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert re.search(r"\b1 failed, \d+ passed\b", output), output
        assert SHOWN_VALUE in output, output  # the rewritten assert's values
        assert "warning" not in output.lower(), output

    def test_uv_path_sources_sync(self, tmp_path: Path) -> None:
        """The page's uv project with path sources syncs and imports Timer and nats-server."""
        project_toml = next(block for block in fenced("toml") if "[project]" in block)
        project = tmp_path / "shop"
        project.mkdir()
        (project / "pyproject.toml").write_text(project_toml.replace(CHECKOUT_UV, f"{ROOT}/"))
        run([uv(), "sync", "-q", "--python", sys.executable], project)
        check = (
            "import timer_core, timer_adapters_sqlite, timer_adapters_nats\n"
            "from timer_adapters_nats.embedded import find_nats_server\n"
            "print(find_nats_server())"
        )
        result = run([str(project / ".venv" / "bin" / "python"), "-c", check], project)
        assert result.stdout.strip() == str(project / ".venv" / "bin" / "nats-server")
