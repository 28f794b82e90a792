"""The README's command for this example, run twice in a row in one folder on one file.

The second run finds the first one's order (and its timeout) and starts as the first did:
nothing the first run left behind (its database, the store's firing lock) stands in its way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: Starting means importing FastAPI, SQLAlchemy and Timer in a new interpreter: seconds on a
#: busy machine, so the budget is generous; a run that cannot start fails well within it.
START_BUDGET_S = 60.0
STOP_BUDGET_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def call(port: int, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def wait_until_serving(process: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + START_BUDGET_S
    while True:
        assert process.poll() is None, f"the service exited with {process.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            assert time.monotonic() < deadline, f"not serving within {START_BUDGET_S:g}s"
            time.sleep(0.1)  # polling a port that only a connection attempt can observe


def run_once(folder: Path, seen: list[str]) -> str:
    """Start the service as the README does, check it, place an order, stop it with SIGTERM."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "orders_service:app",
            "--app-dir",
            str(HERE),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=folder,
        env={**os.environ, "ORDERS_DB": "orders.db"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until_serving(process, port)
        for order_id in seen:  # what an earlier run stored is there, still unpaid
            assert call(port, "GET", f"/orders/{order_id}")["status"] == "unpaid"
        order = call(port, "POST", "/orders", {"amount_cents": 990})
        assert order["status"] == "unpaid"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=STOP_BUDGET_S)
        text = output.decode(errors="replace")
        # uvicorn shuts down gracefully, then ends by the signal it got (recent versions).
        assert process.returncode in (0, -signal.SIGTERM), text
        assert "Application shutdown complete" in text, text
        order_id: str = order["id"]
        return order_id
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def test_the_readme_command_runs_twice_in_one_folder(tmp_path: Path) -> None:
    """Two runs in a row on one orders.db: the second starts, and sees the first's order."""
    seen: list[str] = []
    for _ in range(2):
        seen.append(run_once(tmp_path, seen))
    assert (tmp_path / "orders.db").exists()
