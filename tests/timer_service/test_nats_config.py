"""`timer-service nats-config`: the per-tenant account configuration from a list of tenants,
checked, free of secrets, and working with NKey users on a real ``nats-server``."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.secure_nats import new_nkey_user, start_server_from_file
from tests.timer_adapters_nats.test_publisher import firing
from timer_adapters_nats import DueEventConsumerSettings, NatsBroker, NatsSettings, TimerClient
from timer_service.cli import EXIT_CONFIG, main
from timer_service.settings import Settings, SettingsError
from timer_service.tenancy import nats_config, secret_variable


class TestGenerator:
    def test_variables_are_derived_from_the_tenant_ids(self) -> None:
        """Each user's secret is a $VARIABLE named after it; the file holds none."""
        text = nats_config(["billing", "acme-eu"])
        assert "password: $TIMER_SERVICE_PASSWORD" in text
        assert "password: $TIMER_TENANT_BILLING_PASSWORD" in text
        assert "password: $TIMER_TENANT_ACME_EU_PASSWORD" in text
        nkeys = nats_config(["billing"], auth="nkey")
        assert "nkey: $TIMER_TENANT_BILLING_NKEY" in nkeys
        assert "password" not in nkeys.split("jetstream {}")[1]

    def test_subject_prefix(self) -> None:
        """The exported command subject follows the subject prefix."""
        assert '"acme.commands.billing"' in nats_config(["billing"], subject_prefix="acme")

    @pytest.mark.parametrize(
        ("tenants", "message"),
        [
            ([], "at least one"),
            (["a", "a"], "twice"),
            (["a-b", "a_b"], "would share $TIMER_TENANT_A_B_PASSWORD"),
            (["bad.id"], "tenantId must be 1-128 characters"),
            (["x" * 65], "64 characters"),
        ],
    )
    def test_refuses_lists_it_cannot_isolate(self, tenants: list[str], message: str) -> None:
        """An empty list, a repeated, invalid or too long id, or two ids sharing a variable
        are refused with a clear error."""
        with pytest.raises(ValueError, match=re.escape(message)):
            nats_config(tenants)


class TestCommand:
    def test_writes_the_file_for_timer_tenants(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without arguments the tenants come from TIMER_TENANTS; --output writes the file."""
        monkeypatch.setenv("TIMER_TENANTS", "tenant-a, tenant-b")
        out = tmp_path / "timer.conf"
        assert main(["nats-config", "--output", str(out)]) == 0
        assert out.read_text() == nats_config(["tenant-a", "tenant-b"])

    def test_no_tenants_is_a_usage_error(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Neither arguments nor TIMER_TENANTS: exit 2 saying what to give."""
        monkeypatch.delenv("TIMER_TENANTS", raising=False)
        assert main(["nats-config"]) == EXIT_CONFIG
        assert "name the tenants, or set TIMER_TENANTS" in capsys.readouterr().err
        assert main(["nats-config", "a-b", "a_b"]) == EXIT_CONFIG
        assert "would share" in capsys.readouterr().err

    def test_timer_tenants_setting(self) -> None:
        """TIMER_TENANTS is a comma-separated list of tenant ids, repeats dropped."""
        settings = Settings.from_environment({"TIMER_TENANTS": "a, b,a"})
        assert settings.tenants == ("a", "b")
        with pytest.raises(SettingsError, match="TIMER_TENANTS"):
            Settings.from_environment({"TIMER_TENANTS": "a,bad.id"})
        with pytest.raises(SettingsError, match="at most 64"):
            Settings.from_environment({"TIMER_TENANTS": "x" * 65})


class TestNkeyUsers:
    async def test_tenant_with_an_nkey_schedules_and_reads(self, tmp_path: Path) -> None:
        """With --auth nkey, the service and a tenant log in with NKeys whose public keys the
        server reads from the environment; the tenant's command is stored and its event read."""
        text = nats_config(["tenant-a"], auth="nkey")
        config = tmp_path / "timer.conf"
        config.write_text(text)
        service_user = new_nkey_user(tmp_path / "keys", "service")
        tenant_user = new_nkey_user(tmp_path / "keys", "tenant-a")
        server = start_server_from_file(
            tmp_path / "nats",
            config,
            {
                secret_variable(None, "nkey"): service_user.public_key,
                secret_variable("tenant-a", "nkey"): tenant_user.public_key,
            },
        )
        try:
            service = NatsBroker(
                NatsSettings(
                    url=server.url,
                    nkey_seed_file=service_user.seed_file,
                    tenant_consumers=("tenant-a",),
                )
            )
            tenant = NatsBroker(
                NatsSettings(url=server.url, nkey_seed_file=tenant_user.seed_file, provision=False)
            )
            async with service, tenant:
                await TimerClient(tenant).schedule("tenant-a", "n-1", datetime.now(UTC))
                stored = await service.jetstream.get_last_msg(
                    "TIMER_COMMANDS", "timer.commands.tenant-a"
                )
                assert b"n-1" in (stored.data or b"")
                # The service's own publisher fires a timer of the tenant's.
                assert await service.publisher.publish_many([firing(1)]) == [None]
                read_only = DueEventConsumerSettings(provision=False)
                consumer = tenant.due_events("tenant-a", tenant_id="tenant-a", settings=read_only)
                async with consumer as events:
                    delivery = await asyncio.wait_for(anext(aiter(events)), 30)
                    async with delivery:
                        assert delivery.event.service_call_id == "call-1"
        finally:
            server.stop()
