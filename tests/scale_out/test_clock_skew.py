"""One clock decides: two ``timer-service`` processes on one PostgreSQL and one nats-server, one
of them with its wall clock shifted by libfaketime; judged by the nats-server's own timestamp
of each stored ``DueTimeReached``, none is early and none is lost."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from tests.scale_out.conftest import ServiceFactory, report
from tests.scale_out.test_scale_out import (
    FIRED,
    SHARING,
    metric,
    quantiles,
    read_events,
    spread_schedules,
    states,
    wait_until_true,
)
from tests.timer_service.process import ServiceProcess, http_get
from tests.tools import require_tool
from timer_adapters_nats import TimerClient
from timer_adapters_nats.embedded import NatsServerProcess

pytestmark = pytest.mark.os_tool

TIMERS = 600
TENANTS = 20
FIRST_DUE_S = 3.0
SPREAD_S = 3.0
SKEW = "timer_clock_skew_seconds"
LATENESS = "timer_firing_lateness_seconds"
# The skew is measured to half a round trip on loopback: well within the 50 ms asked for.
SKEW_TOLERANCE_S = 0.05
# Firing is woken by LISTEN/NOTIFY and a sleep to the due time: milliseconds on a quiet
# machine. A second is far below every injected skew, so a timer held back by a host clock
# that runs behind would show, and still leaves room for a machine other work shares.
PROMPT_P99_S = 1.0


# Where the faketime package puts the library its wrapper preloads ($LIB: the loader's own
# library directory). Preloaded directly, the service is the process the test started (the
# wrapper would stay in between, and take the SIGTERM meant for the service).
LIBFAKETIME = "/usr/$LIB/faketime/libfaketime.so.1"


def skewed_service(make_service: ServiceFactory, offset: str, **settings: str) -> ServiceProcess:
    """A ``timer-service run`` whose wall clock (only: not its monotonic clock) libfaketime
    shifts by ``offset``; killed with the others at teardown."""
    require_tool("faketime", "apt-get install faketime")
    return make_service(
        **settings,
        LD_PRELOAD=LIBFAKETIME,
        FAKETIME=offset,
        FAKETIME_DONT_FAKE_MONOTONIC="1",
    )


def p99_bucket(service: ServiceProcess) -> float:
    """The upper bound of the lateness bucket holding the 99th percentile of the timers this
    instance fired (its reachedAt - dueAt histogram)."""
    status, body = http_get(service.http_port, "/metrics")
    assert status == 200
    buckets: list[tuple[float, float]] = []
    for line in body.splitlines():
        if line.startswith(LATENESS + "_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.split()[-1])))
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= 0.99 * total)


class TestSkewedInstance:
    @pytest.mark.parametrize(("offset", "skew_s"), [("+3", 3.0), ("-3", -3.0), ("+30", 30.0)])
    async def test_a_skewed_instance_fires_nothing_early_and_shows_its_skew(
        self,
        nats_server: NatsServerProcess,
        fresh_postgres_url: str,
        make_service: ServiceFactory,
        offset: str,
        skew_s: float,
    ) -> None:
        """With one of two instances' wall clock shifted, no DueTimeReached is stored by the
        nats-server before its dueAt, every timer is stored at least once, both instances fire
        and promptly, and the shifted one shows its skew (gauge, /healthz within 50 ms) and
        logs the warning."""
        conninfo = fresh_postgres_url.replace("postgresql+psycopg://", "postgresql://")
        settings = {
            "TIMER_DATABASE_URL": fresh_postgres_url,
            "TIMER_BROKER_URL": nats_server.url,
            "TIMER_POLLING_INTERVAL": "1000",
        }
        true_clock = make_service(**settings, TIMER_INSTANCE_ID="true-clock")
        skewed = skewed_service(make_service, offset, **settings, TIMER_INSTANCE_ID="skewed")
        true_clock.start()
        await asyncio.to_thread(true_clock.wait_healthy, 60.0)  # it provisions the streams
        skewed.start()
        health = await asyncio.to_thread(skewed.wait_healthy, 60.0)
        assert health["clock"] == "database"
        assert health["clock_skew_s"] == pytest.approx(skew_s, abs=SKEW_TOLERANCE_S)
        assert metric(skewed, SKEW) == pytest.approx(skew_s, abs=SKEW_TOLERANCE_S)
        assert metric(true_clock, SKEW) == pytest.approx(0.0, abs=SKEW_TOLERANCE_S)
        warned = [
            float(line.split("this host's clock is ", 1)[1].split()[0])
            for line in skewed.output().splitlines()
            if "WARNING" in line and "this host's clock is" in line
        ]
        assert warned and warned[0] == pytest.approx(skew_s, abs=SKEW_TOLERANCE_S), warned
        assert "WARNING" not in "".join(
            line for line in true_clock.output().splitlines() if "clock" in line
        )

        async def sharing() -> bool:
            gauges = [await asyncio.to_thread(metric, s, SHARING) for s in (true_clock, skewed)]
            return gauges == [2, 2]

        await wait_until_true(sharing, within=30, what="the instances hearing each other")

        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream(timeout=10)
            client = TimerClient(nc, publish_window=256)
            envelopes, due_by_key = spread_schedules(client, TIMERS, TENANTS, FIRST_DUE_S, SPREAD_S)
            started = time.monotonic()
            assert await client.send_many(envelopes) == [None] * TIMERS

            async def all_reached() -> bool:
                return (await asyncio.to_thread(states, conninfo)).get("Reached", 0) == TIMERS

            await wait_until_true(all_reached, within=60, what="every timer Reached")
            done_s = time.monotonic() - started
            fired = await read_events(js, TIMERS)
        finally:
            await nc.close()

        per_instance = {
            "true-clock": (metric(true_clock, FIRED), p99_bucket(true_clock)),
            "skewed": (metric(skewed, FIRED), p99_bucket(skewed)),
        }
        early = [f for f in fired if f.stored_at < f.due_at]
        stamped_wrong = [f for f in fired if not f.due_at <= f.reached_at <= f.stored_at]
        keys = {f.key for f in fired}
        report(
            f"skewed instance ({offset} s by libfaketime) beside a true-clock one",
            timers=TIMERS,
            all_reached_s=f"{done_s:.2f}",
            events=len(fired),
            early=len(early),
            least_lateness_s=min(
                ((f.stored_at - f.due_at).total_seconds() for f in fired), default=0
            ),
            stored_lateness=quantiles([(f.stored_at - f.due_at).total_seconds() for f in fired]),
            fired_and_p99_bucket=json.dumps(per_instance),
            measured_skew_s=health["clock_skew_s"],
        )
        assert early == [], f"{len(early)} of {len(fired)} events stored before their dueAt"
        assert keys == set(due_by_key), f"{len(set(due_by_key) - keys)} timers never fired"
        assert stamped_wrong == [], "reachedAt is not the database's time of firing"
        assert all(count > 0 for count, _ in per_instance.values()), per_instance
        assert all(p99 <= PROMPT_P99_S for _, p99 in per_instance.values()), per_instance
        assert [await asyncio.to_thread(s.terminate) for s in (true_clock, skewed)] == [0, 0]
