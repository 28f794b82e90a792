"""The example service end to end: HTTP requests in, its own Timer expiring unpaid orders."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from orders_service import create_app


def wait_for_status(
    client: TestClient, order_id: str, status: str, budget: float
) -> dict[str, Any]:
    """Poll the order until it has ``status``; fails after ``budget`` seconds."""
    deadline = time.monotonic() + budget
    while True:
        order = client.get(f"/orders/{order_id}").json()
        if order["status"] == status or time.monotonic() > deadline:
            return order
        time.sleep(0.02)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """The service with a 300 ms payment window, its lifespan (and Timer) running."""
    with TestClient(
        create_app(str(tmp_path / "orders.db"), payment_window=timedelta(seconds=0.3))
    ) as client:
        yield client


def test_an_unpaid_order_expires_when_its_timeout_fires(client: TestClient) -> None:
    """The timeout created with the order expires it once the window has passed, not before."""
    order = client.post("/orders", json={"amount_cents": 1250}).json()
    assert order["status"] == "unpaid"
    assert wait_for_status(client, order["id"], "expired", budget=15)["status"] == "expired"


def test_a_paid_order_is_not_expired(client: TestClient) -> None:
    """Paying cancels the timeout in the same transaction: the order stays paid."""
    order = client.post("/orders", json={"amount_cents": 990}).json()
    assert client.post(f"/orders/{order['id']}/pay").json()["status"] == "paid"
    other = client.post("/orders", json={"amount_cents": 1}).json()
    wait_for_status(client, other["id"], "expired", budget=15)  # past the first one's window
    assert client.get(f"/orders/{order['id']}").json()["status"] == "paid"
    assert client.post(f"/orders/{other['id']}/pay").status_code == 409


def test_a_timeout_due_while_the_service_was_down_fires_at_the_next_start(tmp_path: Path) -> None:
    """An order placed before a stop expires once the service is started again."""
    db = str(tmp_path / "orders.db")
    with TestClient(create_app(db, payment_window=timedelta(seconds=0.2))) as client:
        order = client.post("/orders", json={"amount_cents": 5}).json()
    time.sleep(0.3)  # the window passes while nothing runs
    with TestClient(create_app(db)) as client:
        assert wait_for_status(client, order["id"], "expired", budget=15)["status"] == "expired"
